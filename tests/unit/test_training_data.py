"""Training data: assistant-only labels token by token, ShareGPT = messages, alpaca formats, raw text chunks, and a
named error for each malformed file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from modules.training.args import TrainingArgs, field_docs
from modules.training.datasets import IGNORE, DatasetError, load_training_data
from tests.conftest import ROOT, hf_default_model

EXAMPLES = ROOT / "user_data" / "training"
CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name a colour."},
    {"role": "assistant", "content": "Teal."},
    {"role": "user", "content": "Another?"},
    {"role": "assistant", "content": "Ochre, then maybe plum."},
]


@pytest.fixture(scope="module")
def tokenizer():  # type: ignore[no-untyped-def]
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(hf_default_model()), local_files_only=True)


def runs(ids: list[int], labels: list[int]) -> list[list[int]]:
    """The maximal runs of consecutive labelled tokens."""
    out: list[list[int]] = []
    previous = IGNORE
    for token, label in zip(ids, labels, strict=True):
        if label != IGNORE:
            assert label == token  # a label is the token itself (the Trainer shifts)
            if previous == IGNORE:
                out.append([])
            out[-1].append(token)
        previous = label
    return out


def write(path: Path, text: str | bytes) -> Path:
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return path


def test_chat_labels_cover_exactly_the_assistant_turns(tokenizer, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    path = write(tmp_path / "c.jsonl", json.dumps({"messages": CONVERSATION}) + "\n")
    sample = load_training_data(tokenizer, path, cutoff=512).train[0]
    full = tokenizer.apply_chat_template(CONVERSATION, tokenize=False)
    assert tokenizer.decode(sample.input_ids) == full  # the model's own template, whole
    labelled = [tokenizer.decode(run) for run in runs(sample.input_ids, sample.labels)]
    assert labelled == ["Teal.<|im_end|>\n", "Ochre, then maybe plum.<|im_end|>\n"]
    # token by token: every token outside those runs (system, user turns, role headers) has no loss
    unlabelled = "".join(
        tokenizer.decode([t]) for t, lab in zip(sample.input_ids, sample.labels, strict=True) if lab == IGNORE
    )
    assert unlabelled == full.replace(labelled[0], "").replace(labelled[1], "")
    assert "You are terse." in unlabelled and "Name a colour." in unlabelled and "Another?" in unlabelled


def test_sharegpt_gives_the_same_samples_as_messages(tokenizer, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    share = [{"from": {"system": "system", "user": "human", "assistant": "gpt"}[m["role"]], "value": m["content"]}
             for m in CONVERSATION]  # fmt: skip
    a = load_training_data(tokenizer, write(tmp_path / "a.jsonl", json.dumps({"messages": CONVERSATION})), cutoff=512)
    b = load_training_data(tokenizer, write(tmp_path / "b.json", json.dumps([{"conversations": share}])), cutoff=512)
    assert (a.kind, b.kind) == ("chat", "sharegpt")
    assert a.train == b.train


def test_alpaca_format_file_and_loss_on_the_output(tokenizer) -> None:  # type: ignore[no-untyped-def]
    data = load_training_data(
        tokenizer, EXAMPLES / "datasets" / "example-alpaca.json", cutoff=512,
        format_path=EXAMPLES / "formats" / "alpaca-format.json",
    )  # fmt: skip
    records = json.loads((EXAMPLES / "datasets" / "example-alpaca.json").read_text())
    assert len(data.train) == len(records)
    for sample, record in zip(data.train, records, strict=True):
        text = tokenizer.decode(sample.input_ids)
        assert f"### Instruction:\n{record['instruction']}" in text
        assert ("### Input:" in text) == ("input" in record)  # the key set picks the template
        assert [tokenizer.decode(r) for r in runs(sample.input_ids, sample.labels)] == [record["output"] + "<|im_end|>"]


def test_raw_text_is_chunked_at_the_cutoff_with_overlap(tokenizer) -> None:  # type: ignore[no-untyped-def]
    path = EXAMPLES / "datasets" / "example-text.txt"
    data = load_training_data(tokenizer, path, cutoff=32, overlap=8)
    ids = tokenizer(path.read_text(), add_special_tokens=False)["input_ids"]
    assert data.kind == "text" and len(data.train) > 3
    assert all(len(s.input_ids) <= 32 and s.labels == s.input_ids for s in data.train)
    assert data.train[1].input_ids[:8] == data.train[0].input_ids[-8:]
    assert data.train[0].input_ids + data.train[1].input_ids[8:] == ids[: 32 + 24]


def test_eval_split_holds_out_samples(tokenizer) -> None:  # type: ignore[no-untyped-def]
    path = EXAMPLES / "datasets" / "example-chat.jsonl"
    data = load_training_data(tokenizer, path, cutoff=512, eval_split=0.25)
    assert (len(data.train), len(data.eval)) == (6, 2)
    assert not {tuple(s.input_ids) for s in data.eval} & {tuple(s.input_ids) for s in data.train}


BAD = [
    ("bad.jsonl", '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}\n{"messages": [}\n',
     "bad.jsonl, line 2: invalid JSON"),
    ("role.json", '[{"messages": [{"role": "user", "content": "hi"}, {"role": "bot", "content": "yo"}]}]',
     "role.json, record 1, messages[1]: unknown role 'bot'"),
    ("noanswer.jsonl", '{"messages": [{"role": "user", "content": "hi"}]}', "noanswer.jsonl, line 1: no assistant turn"),
    ("content.jsonl", '{"messages": [{"role": "user", "content": 3}, {"role": "assistant", "content": "x"}]}',
     "content.jsonl, line 1, messages[0]: the content must be a string, not int"),
    ("share.json", '[{"conversations": [{"from": "human", "value": "a"}, {"from": "robot", "value": "b"}]}]',
     "share.json, record 1, conversations[1]: unknown 'from' 'robot'"),
    ("mixed.jsonl", '{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}\n'
     '{"conversations": []}\n', "mixed.jsonl, line 2: every record needs 'messages'"),
    ("alpaca.json", '[{"instruction": "a", "output": "b"}]', "alpaca.json, record 1: records without 'messages'"),
    ("empty.jsonl", "  \n", "empty.jsonl: the file is empty"),
    ("dict.json", '{"messages": []}', "dict.json: a JSON dataset must be a list of records"),
    ("broken.json", '[{"messages": [', "broken.json, line 1 column 16: invalid JSON"),
    ("latin.txt", b"caf\xe9 au lait", "latin.txt: not UTF-8 text"),
    ("notes.csv", "a,b\n", "notes.csv: use .json or .jsonl"),
]  # fmt: skip


@pytest.mark.parametrize(("name", "content", "message"), BAD, ids=[b[0] for b in BAD])
def test_each_malformed_file_names_file_place_and_problem(tokenizer, tmp_path: Path, name, content, message) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(DatasetError) as error:
        load_training_data(tokenizer, write(tmp_path / name, content), cutoff=512)
    assert str(error.value).startswith(message)


def test_alpaca_record_matching_no_format_entry(tokenizer, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    path = write(tmp_path / "a.json", '[{"instruction": "a", "output": "b"}, {"question": "q", "output": "b"}]')
    with pytest.raises(DatasetError, match=r"a.json, record 2: its keys \['output', 'question'\] match no entry"):
        load_training_data(tokenizer, path, cutoff=512, format_path=EXAMPLES / "formats" / "alpaca-format.json")


def test_every_argument_is_documented() -> None:
    from dataclasses import fields

    docs = field_docs()
    assert [f.name for f in fields(TrainingArgs)] == list(docs)
    assert all(len(text) > 10 for text in docs.values())


def test_the_web_ui_cannot_name_files_outside_user_data(tmp_path: Path) -> None:
    from modules.errors import InvalidRequest
    from modules.training import datasets as ds

    outside = tmp_path / "secret.jsonl"
    outside.write_text('{"messages": []}\n')
    folder = tmp_path / "datasets"
    folder.mkdir()
    for name in (str(outside), "../secret.jsonl"):
        with pytest.raises(InvalidRequest):
            ds.resolve_file(folder, name, "dataset")
    with ds.allow_paths():  # the CLI and scripts
        assert ds.resolve_file(folder, str(outside), "dataset") == outside
    with pytest.raises(InvalidRequest):  # and only inside the block
        ds.resolve_file(folder, str(outside), "dataset")


def test_the_cli_permission_reaches_its_foreground_job_and_no_other_thread() -> None:
    import threading

    from modules import jobs
    from modules.training import datasets as ds

    with ds.allow_paths():  # what the training CLI does around its run
        in_the_job = jobs.run_foreground("paths", lambda report, cancel: ds.paths_allowed(), progress=False)
        elsewhere: list[bool] = []
        server = threading.Thread(target=lambda: elsewhere.append(ds.paths_allowed()))
        server.start()
        server.join()
    assert in_the_job is True and elsewhere == [False] and not ds.paths_allowed()
