"""Property tests: stop-string hold-back, chat template rendering and the tool-call parser on generated input.

Each property runs on at most a couple of hundred generated cases, so the whole file stays well under 20 s.
"""

from __future__ import annotations

import itertools
import json
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from extensions.openai import tools
from modules.chat import templates
from modules.chat.prompt import ChatOptions, build_chat_prompt
from modules.generation.params import GenerationParams
from modules.generation.pipeline import DeltaBuilder, Prepared
from modules.generation.stopping import StopMatcher, Utf8Stream
from modules.loaders.base import Backend, TokenEvent

FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# A small alphabet (ASCII, a 2-byte, a 3-byte and a 4-byte character, a newline) makes stop strings,
# overlaps between them and split multi-byte characters common in generated cases.
ALPHABET = "ab:\né€😀"
stop_lists = st.lists(st.text(ALPHABET, min_size=1, max_size=4), max_size=3)
texts = st.text(ALPHABET, max_size=40)


def one_shot(text: str, stops: list[str]) -> str:
    """What a user must see: the text up to the stop string that is complete first (as if fed char by char)."""
    first: tuple[int, int] | None = None
    for stop in (s for s in stops if s):
        pos = text.find(stop)
        if pos != -1 and (first is None or (pos + len(stop), pos) < first):
            first = (pos + len(stop), pos)
    return text if first is None else text[: first[1]]


@st.composite
def splits(draw: st.DrawFn, data: Any) -> list[Any]:
    """``data`` (str or bytes) cut into consecutive pieces at arbitrary points (empty pieces included)."""
    cuts = sorted(draw(st.lists(st.integers(0, len(data)), max_size=12)))
    bounds = [0, *cuts, len(data)]
    return [data[a:b] for a, b in itertools.pairwise(bounds)]


def stream_matcher(pieces: list[str], stops: list[str]) -> tuple[list[str], str]:
    matcher = StopMatcher(stops)
    shown = []
    for piece in pieces:
        out, stopped = matcher.feed(piece)
        shown.append(out)
        if stopped:
            break
    return shown, matcher.flush()


@FAST
@given(data=st.data(), text=texts, stops=stop_lists)
@example(data=None, text="abcd", stops=["abcd", "bc"]).via("the earliest-completed stop wins, however chunked")
def test_stop_matcher_streamed_equals_one_shot_for_any_chunking(data: Any, text: str, stops: list[str]) -> None:
    pieces = data.draw(splits(text)) if data is not None else [text]
    shown, tail = stream_matcher(pieces, stops)
    assert "".join(shown) + tail == one_shot(text, stops)
    assert "".join(stream_matcher([text], stops)[0]) + stream_matcher([text], stops)[1] == one_shot(text, stops)
    released = ""
    for out in shown:  # at no moment has any stop string been visible
        released += out
        assert not any(stop in released for stop in stops), (released, stops)


@st.composite
def token_stream(draw: st.DrawFn) -> tuple[str, list[bytes], list[str]]:
    text = draw(texts)
    return text, draw(splits(text.encode("utf-8"))), draw(stop_lists)


def run_delta_builder(pieces: list[bytes], stops: list[str]) -> tuple[list[str], str | None]:
    """The pipeline's own delta builder fed one token per piece, ending with EOS."""
    prepared = Prepared(prompt_ids=[1], params=GenerationParams(stop=stops), started=time.perf_counter())
    builder = DeltaBuilder(prepared)
    deltas = []
    for i, piece in enumerate(pieces):
        deltas += builder.feed(TokenEvent(token_id=i + 2, piece=piece))
    deltas += builder.feed(TokenEvent(token_id=-1, piece=b"", finish_reason="stop"))
    final = deltas[-1].stats
    assert final is not None and sum(d.stats is not None for d in deltas) == 1
    return [d.text for d in deltas], final.stop_string


@FAST
@given(case=token_stream())
@example(case=("ok </", [b"ok </"], ["</s>"])).via("a held-back partial stop string is released at the end")
@example(case=("é", [b"\xc3", b"\xa9"], ["é"])).via("a stop string completed by the second byte of a character")
def test_pipeline_deltas_equal_one_shot_for_any_byte_split(case: tuple[str, list[bytes], list[str]]) -> None:
    text, pieces, stops = case
    shown, matched = run_delta_builder(pieces, stops)
    assert "".join(shown) == one_shot(text, stops)
    assert "\ufffd" not in "".join(shown)  # a character split across tokens is never shown half-decoded
    released = ""
    for out in shown:
        released += out
        assert not any(stop in released for stop in stops if stop)
    expected_stop = one_shot(text, stops) != text
    assert (matched is not None) == expected_stop


@FAST
@given(data=st.data(), raw=st.binary(max_size=40))
def test_utf8_stream_equals_one_shot_decode_for_any_bytes(data: Any, raw: bytes) -> None:
    stream = Utf8Stream()
    out = "".join(stream.feed(piece) for piece in data.draw(splits(raw))) + stream.flush()
    assert out == raw.decode("utf-8", errors="replace")


# ---- chat templates -------------------------------------------------------------------------------------


def _shipped_templates() -> dict[str, str]:
    from modules.lifecycle.gguf import read_metadata
    from modules.settings import read_yaml
    from tests.conftest import ROOT, default_model_path

    found = {"fallback": templates.FALLBACK_TEMPLATE}
    for path in sorted((ROOT / "user_data" / "instruction-templates").glob("*.yaml")):
        found[path.stem] = read_yaml(path)["instruction_template"]
    own = read_metadata(default_model_path()).chat_template
    assert own
    found["default-model"] = own
    return found


TEMPLATES = _shipped_templates()
TRIMS = {"Llama-3"}  # templates that `| trim` each message
messages_strategy = st.lists(
    st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]), "content": st.text(max_size=30)}),
    min_size=1,
    max_size=6,
)


@pytest.mark.parametrize("name", sorted(TEMPLATES))
@settings(max_examples=100, deadline=None)
@given(messages=messages_strategy, add_generation_prompt=st.booleans())
def test_any_unicode_messages_render_in_order(
    name: str, messages: list[dict[str, str]], add_generation_prompt: bool
) -> None:
    text = templates.render(
        TEMPLATES[name],
        messages,
        add_generation_prompt=add_generation_prompt,
        bos_token="<s>",
        eos_token="</s>",
    )
    pos = 0
    for message in messages:
        content = message["content"].strip() if name in TRIMS else message["content"]
        found = text.find(content, pos)
        assert found >= 0, (content, text)
        pos = found + len(content)


class ByteBackend(Backend):
    """A model stand-in whose tokens are UTF-8 bytes (prompt building is what is tested, not the model)."""

    def __init__(self, context: int, template: str | None) -> None:
        super().__init__()
        self.context = context
        self.metadata.chat_template = template

    @classmethod
    def load(cls, path: Path, options: dict[str, Any]) -> Backend:
        raise NotImplementedError

    def unload(self) -> None:
        pass

    def encode(self, text: str, add_special: bool = True) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")

    def token_piece(self, token_id: int) -> bytes:
        return bytes([token_id])

    @property
    def context_length(self) -> int:
        return self.context

    def generate(self, prompt_ids: list[int], params: Any, cancel: Any, extra: Any = None) -> Iterator[TokenEvent]:
        raise NotImplementedError


HUB_SETTINGS = settings(
    max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)


@HUB_SETTINGS
@given(history=messages_strategy, mode=st.sampled_from(["instruct", "chat", "chat-instruct"]))
@example(history=[{"role": "user", "content": "{{char}} and {{user}}"}], mode="chat-instruct")  # kept as written
def test_any_history_builds_a_prompt_with_every_message_in_order(
    hub: object, history: list[dict[str, str]], mode: str
) -> None:
    backend = ByteBackend(1_000_000, TEMPLATES["default-model"])
    built = build_chat_prompt(backend, history, ChatOptions(mode=mode), max_new_tokens=16)
    assert built.kept == len(history)
    bot = built.character.name if built.character else ""
    pos = 0
    for message in history:
        if mode == "instruct":
            needle = message["content"]
        else:  # a transcript line per message, under the speaker's name
            speaker = {"assistant": bot + ": ", "system": ""}.get(message["role"], "You: ")  # system: plain context
            needle = speaker + message["content"]
        found = built.prompt.find(needle, pos)
        assert found >= 0, (needle, built.prompt)
        pos = found + len(needle)
    if mode != "instruct":
        assert built.prompt.endswith(f"{bot}:") and "\nYou:" in built.stop


numbered = st.lists(
    st.tuples(st.sampled_from(["system", "user", "assistant"]), st.text("abc é\n", max_size=40)),
    min_size=1,
    max_size=8,
).map(lambda items: [{"role": r, "content": f"<{i}>{t}"} for i, (r, t) in enumerate(items)])


@HUB_SETTINGS
@given(history=numbered, context=st.integers(40, 700), max_new=st.integers(1, 64))
def test_truncation_drops_the_oldest_turns_first_and_keeps_system_and_newest(
    hub: object, history: list[dict[str, str]], context: int, max_new: int
) -> None:
    backend = ByteBackend(context, TEMPLATES["default-model"])
    built = build_chat_prompt(backend, history, ChatOptions(), max_new_tokens=max_new)
    kept = [i for i in range(len(history)) if f"<{i}>" in built.prompt]
    assert len(kept) == built.kept
    systems = [i for i, m in enumerate(history) if m["role"] == "system"]
    assert set(systems) | {len(history) - 1} <= set(kept)  # system messages and the newest always stay
    others = [i for i in kept if i not in systems]
    dropped = [i for i in range(len(history)) if i not in kept]
    assert all(d < min(others, default=len(history)) for d in dropped)  # only the oldest turns went
    budget = context - max(1, min(max_new, context // 2))
    droppable = [i for i in range(len(history) - 1) if i not in systems]
    if len(backend.encode(built.prompt)) > budget:  # it does not fit: only when nothing more could go
        assert not set(droppable) & set(kept)
    elif dropped:  # it fits: keeping one more turn would not have
        one_more = [m for i, m in enumerate(history) if i in kept or i == max(dropped)]
        assert build_chat_prompt(backend, one_more, ChatOptions(), max_new_tokens=max_new).kept < len(one_more)


# ---- tool calls -----------------------------------------------------------------------------------------

names = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,15}", fullmatch=True)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=10),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)
arguments = st.dictionaries(st.text(max_size=8), json_values, max_size=4)
calls_strategy = st.lists(st.tuples(names, arguments), min_size=1, max_size=3)
# text before the calls: anything that does not itself start a call
content_text = st.text(max_size=30).filter(lambda t: tools.TOOL_OPEN not in t and "[TOOL_CALLS]" not in t)


def _call_json(name: str, args: dict[str, Any], key: str, as_string: bool) -> dict[str, Any]:
    return {"name": name, key: json.dumps(args) if as_string else args}


@st.composite
def written_calls(draw: st.DrawFn) -> tuple[str, str, list[tuple[str, dict[str, Any]]]]:
    """Model output holding calls in one of the supported formats, the content expected, and the calls."""
    calls = draw(calls_strategy)
    key = draw(st.sampled_from(["arguments", "parameters"]))
    as_string = draw(st.booleans())
    objects = [_call_json(n, a, key, as_string) for n, a in calls]
    style = draw(st.sampled_from(["hermes", "hermes-unclosed", "mistral", "bare"]))
    if style == "bare":
        body = json.dumps(objects[0] if len(objects) == 1 else objects, ensure_ascii=draw(st.booleans()))
        return draw(st.sampled_from(["", " ", "\n"])) + body, "", calls
    content = draw(content_text)
    if style == "mistral":
        return content + "[TOOL_CALLS] " + json.dumps(objects, ensure_ascii=False), content.strip(), calls
    sep = draw(st.sampled_from(["", "\n", " "]))
    tagged = [tools.TOOL_OPEN + json.dumps(o, ensure_ascii=False) + tools.TOOL_CLOSE for o in objects]
    if style == "hermes-unclosed":  # generation ended (max_tokens, stop) before the closing tag
        tagged[-1] = tagged[-1][: -len(tools.TOOL_CLOSE)]
    return content + sep.join(tagged), content.strip(), calls


def _assert_same_calls(found: list[tools.ToolCall], calls: list[tuple[str, dict[str, Any]]]) -> None:
    assert [c.name for c in found] == [n for n, _ in calls]
    assert [json.loads(c.arguments) for c in found] == [a for _, a in calls]


@FAST
@given(case=written_calls())
def test_tool_calls_round_trip_through_the_parser(case: tuple[str, str, list[tuple[str, dict[str, Any]]]]) -> None:
    text, content, calls = case
    known = [n for n, _ in calls]
    parsed_content, found = tools.parse_tool_calls(text, known)
    assert parsed_content == content
    _assert_same_calls(found, calls)
    # an earlier call rendered back into a prompt (render_call) parses to the same call
    again = "".join(tools.render_call(c.to_openai()) for c in found)
    _assert_same_calls(tools.parse_tool_calls(again, known)[1], calls)
    # calls to functions the request did not offer are left as text
    assert tools.parse_tool_calls(text, [n + "_other" for n in known]) == (text, [])


@FAST
@given(case=written_calls(), data=st.data(), parallel=st.booleans())
def test_streamed_tool_calls_equal_one_shot_parse(
    case: tuple[str, str, list[tuple[str, dict[str, Any]]]], data: Any, parallel: bool
) -> None:
    text, content, calls = case
    offered = [{"type": "function", "function": {"name": n}} for n in dict.fromkeys(n for n, _ in calls)]
    stream = tools.ToolStream(tools.plan_tools(offered, "auto", parallel))
    shown, found = "", []
    for piece in data.draw(splits(text)):
        out, new = stream.feed(piece)
        shown, found = shown + out, found + new
    out, new = stream.finish()
    shown, found = shown + out, found + new
    assert shown.strip() == content
    _assert_same_calls(found, calls if parallel else calls[:1])


fragments = st.sampled_from(
    [tools.TOOL_OPEN, tools.TOOL_CLOSE, "[TOOL_CALLS]", "{", "}", "[", "]", '"name"', '"f"', ":", ",", '"arguments"']
    + [" ", "\n", '"', "\\", "null", "1e999", "\ud800", "é"]
)
any_text = st.text(max_size=60) | st.lists(fragments, max_size=30).map("".join)


@st.composite
def model_outputs(draw: st.DrawFn) -> tuple[str, int]:
    """Any output and a place where a piece ends: arbitrary text, calls written in a supported format, or some text
    and then a bare JSON call, cut where the JSON starts (a bare call is one only when it is the whole reply)."""
    kind = draw(st.sampled_from(["any", "written", "text-then-bare"]))
    if kind == "any":
        return draw(any_text), 0
    if kind == "written":
        return draw(written_calls())[0], 0
    objects = [_call_json("f", args, "arguments", False) for _, args in draw(calls_strategy)]
    head = draw(content_text) + draw(st.sampled_from(["", " ", "\n"]))
    return head + json.dumps(objects[0]), len(head)


@FAST
@given(case=model_outputs(), data=st.data())
def test_any_output_streams_to_what_the_one_shot_parse_gives(case: tuple[str, int], data: Any) -> None:
    text, cut = case
    offered = [
        {"type": "function", "function": {"name": n}}
        for n in dict.fromkeys(["f", *re.findall(r'"name": "(\w+)"', text)])
    ]
    stream = tools.ToolStream(tools.plan_tools(offered, "auto", True))
    shown, found = "", []
    for part in (text[:cut], text[cut:]):
        for piece in data.draw(splits(part)):
            out, new = stream.feed(piece)
            shown, found = shown + out, found + new
    out, new = stream.finish()
    content, calls = tools.parse_tool_calls(text, [f["function"]["name"] for f in offered])
    assert [(c.name, c.arguments) for c in found + new] == [(c.name, c.arguments) for c in calls]
    assert (shown + out).strip() == content.strip()


@FAST
@given(text=any_text, forced=st.booleans(), data=st.data())
@example(text="[" * 100_000, forced=False, data=None).via("deep nesting must not raise RecursionError")
@example(text="[" * 100_000, forced=True, data=None).via("deep nesting in forced mode")
@example(text=tools.TOOL_OPEN + "[" * 100_000, forced=False, data=None)
def test_tool_parser_never_raises_on_arbitrary_text(text: str, forced: bool, data: Any) -> None:
    content, calls = tools.parse_tool_calls(text, ["f"])
    assert isinstance(content, str)
    assert all(c.name == "f" and isinstance(json.loads(c.arguments), dict) for c in calls)  # a JSON object
    offered = [{"type": "function", "function": {"name": "f"}}]
    stream = tools.ToolStream(tools.plan_tools(offered, "required" if forced else "auto", None))
    for piece in data.draw(splits(text)) if data is not None else [text]:
        stream.feed(piece)
    stream.finish()
