"""Training data: chat (OpenAI ``messages``, ShareGPT ``conversations``), alpaca-style records through a format file,
and raw text, tokenized into samples whose labels are -100 everywhere the model must not learn (prompts, padding).

Chat samples are rendered with the model's own chat template; the loss falls on the assistant turns only. A bad file
raises :class:`DatasetError` naming the file, the line or record, and the problem, before anything trains.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from modules.errors import InvalidRequest
from modules.paths import UnsafePath, safe_child

IGNORE = -100  # the label of a token that carries no loss
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "system": "system", "tool": "tool", "function_call": "assistant", "observation": "tool"}  # fmt: skip
CHAT_ROLES = {"system", "user", "assistant", "tool", "developer"}
SUFFIXES = (".json", ".jsonl", ".txt")


class DatasetError(InvalidRequest):
    """A training file is malformed; the message names the file, the line or record, and the problem."""

    def __init__(self, path: Path, problem: str, where: str = "") -> None:
        super().__init__(f"{path.name}{', ' + where if where else ''}: {problem}", param="dataset")
        self.path, self.where, self.problem = path, where, problem


@dataclass
class Sample:
    """One training sequence: token ids and their labels (IGNORE where there is no loss)."""

    input_ids: list[int]
    labels: list[int]


@dataclass
class TrainingData:
    """The tokenized training and evaluation samples, and what they came from."""

    kind: str  # chat, sharegpt, alpaca, text
    train: list[Sample]
    eval: list[Sample] = field(default_factory=list)
    dropped: int = 0  # samples with nothing to learn after the cutoff

    def trained_tokens(self) -> int:
        """Tokens with a loss, over one epoch."""
        return sum(sum(1 for x in s.labels if x != IGNORE) for s in self.train)


# Paths outside user_data are taken from the CLI and scripts (their user owns the machine), never from the web UI or
# the API: only calls made inside allow_paths() get them, so a script in a server's process never lends them out.
_paths_allowed: ContextVar[bool] = ContextVar("training_paths_allowed", default=False)


@contextmanager
def allow_paths() -> Iterator[None]:
    """Within this block, the calls of this thread (and the jobs it runs with :func:`modules.jobs.run_foreground`,
    which inherit its context) may name a dataset, format or model by any path their user can read. Other threads
    (the server's requests, the Training tab's jobs) keep the user_data rule, also while the block runs."""
    token = _paths_allowed.set(True)
    try:
        yield
    finally:
        _paths_allowed.reset(token)


def paths_allowed() -> bool:
    """True inside :func:`allow_paths` (the CLI, a script); the web UI and the API never are."""
    return _paths_allowed.get()


def resolve_file(folder: Path, name: str, what: str, suffixes: tuple[str, ...] = SUFFIXES) -> Path:
    """A user's file: ``name`` (with or without suffix) inside ``folder``; from the CLI, also a path as given."""
    direct = Path(name).expanduser()
    if paths_allowed() and direct.is_absolute() and direct.is_file():
        return direct
    try:
        candidates = [safe_child(folder, name)] + [safe_child(folder, name + s) for s in suffixes]
    except UnsafePath as exc:
        raise InvalidRequest(f"invalid {what} name: {exc}", param=what) from exc
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    if paths_allowed() and direct.is_file():
        return direct.resolve()
    raise InvalidRequest(f"{what} {name!r} is not a file in {folder}", param=what)


def read_records(path: Path) -> list[tuple[str, Any]]:
    """The records of a JSON list or a JSONL file, each with where it is (``line 3`` or ``record 3``)."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise DatasetError(path, f"not UTF-8 text ({exc.reason} at byte {exc.start})") from exc
    if not text.strip():
        raise DatasetError(path, "the file is empty")
    if path.suffix == ".jsonl":
        records = []
        for number, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    records.append((f"line {number}", json.loads(line)))
                except json.JSONDecodeError as exc:
                    raise DatasetError(
                        path, f"invalid JSON ({exc.msg} at column {exc.colno})", f"line {number}"
                    ) from exc
        return records
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise DatasetError(path, f"invalid JSON ({exc.msg})", f"line {exc.lineno} column {exc.colno}") from exc
    if isinstance(data, dict) and isinstance(data.get("data"), list):
        data = data["data"]
    if not isinstance(data, list):
        raise DatasetError(path, "a JSON dataset must be a list of records (or use .jsonl, one record a line)")
    return [(f"record {number}", record) for number, record in enumerate(data, 1)]


def detect_kind(path: Path, records: list[tuple[str, Any]]) -> str:
    """chat, sharegpt or alpaca, from the first record's keys."""
    where, first = records[0]
    if not isinstance(first, dict):
        raise DatasetError(path, f"a record must be a JSON object, not {type(first).__name__}", where)
    if "messages" in first:
        return "chat"
    if "conversations" in first:
        return "sharegpt"
    return "alpaca"


def chat_messages(path: Path, where: str, record: Any, kind: str) -> list[dict[str, str]]:
    """The validated messages of one chat or ShareGPT record."""
    if not isinstance(record, dict):
        raise DatasetError(path, f"a record must be a JSON object, not {type(record).__name__}", where)
    key = "messages" if kind == "chat" else "conversations"
    turns = record.get(key)
    if not isinstance(turns, list) or not turns:
        raise DatasetError(path, f"'{key}' must be a non-empty list of turns", where)
    messages = []
    for index, turn in enumerate(turns):
        at = f"{where}, {key}[{index}]"
        if not isinstance(turn, dict):
            raise DatasetError(path, "a turn must be an object", at)
        if kind == "chat":
            role, content = turn.get("role"), turn.get("content")
            if role not in CHAT_ROLES:
                raise DatasetError(path, f"unknown role {role!r} (use {', '.join(sorted(CHAT_ROLES))})", at)
        else:
            source, content = turn.get("from"), turn.get("value")
            role = SHAREGPT_ROLES.get(str(source))
            if role is None:
                raise DatasetError(path, f"unknown 'from' {source!r} (use human, gpt or system)", at)
        if not isinstance(content, str):
            raise DatasetError(path, f"the content must be a string, not {type(content).__name__}", at)
        messages.append({"role": role, "content": content})
    if not any(m["role"] == "assistant" and m["content"].strip() for m in messages):
        raise DatasetError(path, "no assistant turn with text: there is nothing to learn", where)
    return messages


def render_chat(tokenizer: Any, messages: list[dict[str, str]], path: Path, where: str) -> tuple[str, list[range]]:
    """The conversation in the model's chat template, and the character spans of the assistant turns."""
    if not getattr(tokenizer, "chat_template", None):
        raise DatasetError(path, "the model's tokenizer has no chat template; use alpaca records or raw text")

    def render(part: list[dict[str, str]], prompt: bool) -> str:
        return str(tokenizer.apply_chat_template(part, tokenize=False, add_generation_prompt=prompt))

    full = render(messages, False)
    spans = []
    for index, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = render(messages[:index], True) if index else ""
        through = render(messages[: index + 1], False)
        if not full.startswith(before) or not full.startswith(through) or len(through) < len(before):
            raise DatasetError(path, "the chat template does not render this conversation turn by turn", where)
        spans.append(range(len(before), len(through)))
    return full, spans


def tokenize_chat(tokenizer: Any, text: str, spans: list[range], cutoff: int) -> Sample:
    """Token ids of ``text`` with labels only on tokens that start inside an assistant span."""
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = list(encoded["input_ids"]), encoded["offset_mapping"]
    labels = [
        token if any(start in span for span in spans) else IGNORE
        for token, (start, _end) in zip(ids, offsets, strict=True)
    ]
    return Sample(ids[:cutoff], labels[:cutoff])


def load_format(path: Path) -> dict[str, str]:
    """A text-generation-webui format file: {"key1,key2": "template with %key1% and %key2%"}."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise DatasetError(path, f"cannot read the format file ({exc})") from exc
    if not isinstance(data, dict) or not data or not all(isinstance(v, str) for v in data.values()):
        raise DatasetError(path, 'a format file maps key sets to templates: {"instruction,output": "...%output%"}')
    return data


def alpaca_sample(tokenizer: Any, formats: dict[str, str], record: Any, path: Path, where: str, cutoff: int) -> Sample:
    """One alpaca-style record through the format whose key set matches its non-empty keys; loss on the output."""
    if not isinstance(record, dict):
        raise DatasetError(path, f"a record must be a JSON object, not {type(record).__name__}", where)
    present = {k for k, v in record.items() if isinstance(v, str) and v.strip()}
    template = next((t for keys, t in formats.items() if {k.strip() for k in keys.split(",")} == present), None)
    if template is None:
        options = "; ".join(formats)
        raise DatasetError(path, f"its keys {sorted(present)} match no entry of the format file ({options})", where)
    head, marker, _ = template.partition("%output%")
    for key, value in record.items():
        if isinstance(value, str):
            head = head.replace(f"%{key}%", value)
    if not marker:  # no output placeholder: learn the whole text
        prompt_ids: list[int] = []
        answer = head
    else:
        prompt_ids = tokenizer(head, add_special_tokens=False)["input_ids"]
        answer = template.partition("%output%")[2]
        for key, value in record.items():
            if isinstance(value, str):
                answer = answer.replace(f"%{key}%", value)
        answer = str(record.get("output", "")) + answer
    answer_ids = list(tokenizer(answer, add_special_tokens=False)["input_ids"])
    if tokenizer.eos_token_id is not None:
        answer_ids.append(int(tokenizer.eos_token_id))
    bos = [int(tokenizer.bos_token_id)] if getattr(tokenizer, "add_bos_token", False) and tokenizer.bos_token_id else []
    ids = bos + list(prompt_ids) + answer_ids
    labels = [IGNORE] * (len(bos) + len(prompt_ids)) + answer_ids
    return Sample(ids[:cutoff], labels[:cutoff])


def text_samples(tokenizer: Any, path: Path, cutoff: int, overlap: int) -> list[Sample]:
    """Raw text cut into chunks of ``cutoff`` tokens, consecutive chunks sharing ``overlap`` tokens."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise DatasetError(path, f"not UTF-8 text ({exc.reason} at byte {exc.start})") from exc
    if not text.strip():
        raise DatasetError(path, "the file is empty")
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    step = cutoff - overlap
    chunks = [ids[start : start + cutoff] for start in range(0, max(1, len(ids) - overlap), step)]
    return [Sample(chunk, list(chunk)) for chunk in chunks if len(chunk) > 1]


def load_file(tokenizer: Any, path: Path, cutoff: int, overlap: int, format_path: Path | None) -> TrainingData:
    """Every sample of one file (validated whole before anything is returned)."""
    if path.suffix == ".txt":
        return TrainingData("text", text_samples(tokenizer, path, cutoff, overlap))
    if path.suffix not in (".json", ".jsonl"):
        raise DatasetError(path, "use .json or .jsonl (records) or .txt (raw text)")
    records = read_records(path)
    if not records:
        raise DatasetError(path, "no records")
    kind = detect_kind(path, records)
    samples: list[Sample] = []
    if kind == "alpaca":
        if format_path is None:
            where, first = records[0]
            keys = ", ".join(sorted(first)) if isinstance(first, dict) else ""
            raise DatasetError(
                path, f"records without 'messages' or 'conversations' (keys: {keys}) need a format file", where
            )
        formats = load_format(format_path)
        samples = [alpaca_sample(tokenizer, formats, rec, path, where, cutoff) for where, rec in records]
    else:
        for where, record in records:
            if not isinstance(record, dict) or ("messages" if kind == "chat" else "conversations") not in record:
                key = "messages" if kind == "chat" else "conversations"
                raise DatasetError(path, f"every record needs '{key}' like the first one", where)
            text, spans = render_chat(tokenizer, chat_messages(path, where, record, kind), path, where)
            samples.append(tokenize_chat(tokenizer, text, spans, cutoff))
    kept = [s for s in samples if any(x != IGNORE for x in s.labels[1:])]
    if not kept:
        raise DatasetError(path, f"no sample keeps an answer within the cutoff of {cutoff} tokens; raise cutoff_len")
    return TrainingData(kind, kept, dropped=len(samples) - len(kept))


def load_training_data(
    tokenizer: Any,
    path: Path,
    *,
    cutoff: int,
    overlap: int = 0,
    format_path: Path | None = None,
    eval_path: Path | None = None,
    eval_split: float = 0.0,
    seed: int = 42,
) -> TrainingData:
    """The training samples of ``path`` and the evaluation samples (an eval file, or a held-out split)."""
    data = load_file(tokenizer, path, cutoff, overlap, format_path)
    if eval_path is not None:
        data.eval = load_file(tokenizer, eval_path, cutoff, overlap, format_path).train
    elif eval_split > 0:
        if len(data.train) < 2:
            raise DatasetError(path, "an eval split needs at least 2 samples; give an eval file instead")
        order = list(range(len(data.train)))
        random.Random(seed).shuffle(order)
        held = set(order[: max(1, round(len(order) * eval_split))])
        data.eval = [s for i, s in enumerate(data.train) if i in held]
        data.train = [s for i, s in enumerate(data.train) if i not in held]
    return data
