"""Tool-call planning and parsing (the formats models write calls in)."""

from __future__ import annotations

import json

import pytest

from extensions.openai import tools
from modules.errors import InvalidRequest

WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}},
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}


def test_plans() -> None:
    assert tools.plan_tools(None, None, None).mode == "none"
    assert tools.plan_tools([WEATHER], None, None).mode == "auto"
    plan = tools.plan_tools([WEATHER, TIME], {"type": "function", "function": {"name": "get_time"}}, None)
    assert plan.mode == "named" and plan.forced and [f["name"] for f in plan.functions()] == ["get_time"]
    with pytest.raises(InvalidRequest):
        tools.plan_tools([WEATHER], {"type": "function", "function": {"name": "nope"}}, None)
    with pytest.raises(InvalidRequest):
        tools.plan_tools([], "required", None)
    with pytest.raises(InvalidRequest):
        tools.plan_tools([WEATHER, WEATHER], None, None)


def test_forced_schema_shapes() -> None:
    one = tools.forced_schema(tools.plan_tools([WEATHER], "required", False))
    assert one["properties"]["name"] == {"const": "get_weather"}
    many = tools.forced_schema(tools.plan_tools([WEATHER, TIME], "required", True))
    assert many["type"] == "array" and len(many["items"]["anyOf"]) == 2


@pytest.mark.parametrize(
    ("text", "content", "names"),
    [
        (
            'Let me check.<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>',
            "Let me check.",
            ["get_weather"],
        ),
        (
            '<tool_call>{"name": "get_weather", "arguments": {"city": "A"}}</tool_call>\n<tool_call>{"name": "get_time", "arguments": {}}</tool_call>',
            "",
            ["get_weather", "get_time"],
        ),
        ('[TOOL_CALLS] [{"name": "get_time", "arguments": {}}]', "", ["get_time"]),
        ('{"name": "get_weather", "parameters": {"city": "B"}}', "", ["get_weather"]),
        ("Just text, no call.", "Just text, no call.", []),
        ('{"name": "unknown_fn", "arguments": {}}', '{"name": "unknown_fn", "arguments": {}}', []),
        (
            '<tool_call>{"name": "get_weather", "arguments": {broken</tool_call>',
            '<tool_call>{"name": "get_weather", "arguments": {broken</tool_call>',
            [],
        ),
    ],
)
def test_parse_tool_calls(text: str, content: str, names: list[str]) -> None:
    found_content, calls = tools.parse_tool_calls(text, ["get_weather", "get_time"])
    assert found_content == content and [c.name for c in calls] == names
    for call in calls:
        json.loads(call.arguments)


def test_tool_stream_passes_text_and_holds_calls() -> None:
    stream = tools.ToolStream(tools.plan_tools([WEATHER], "auto", None))
    shown = []
    for piece in [
        "Sure",
        ", checking <to",
        "ol_call>",
        '{"name": "get_weather", ',
        '"arguments": {"city": "X"}}',
        "</tool_call>",
    ]:
        text, calls = stream.feed(piece)
        shown.append(text)
        assert not calls
    tail, calls = stream.finish()
    assert "".join(shown) + tail == "Sure, checking " and [c.name for c in calls] == ["get_weather"]


def test_text_held_with_a_mistral_call_keeps_its_space_after_text_shown() -> None:
    """Found by the property test: "ab" shown, then a line and "[TOOL_CALLS]" in one piece; the held text's leading
    line break is inside the reply, as the one-shot parse keeps it."""
    text = 'ab\ncd [TOOL_CALLS] [{"name": "get_time", "arguments": {}}]'
    stream = tools.ToolStream(tools.plan_tools([WEATHER, TIME], "auto", None))
    shown = stream.feed("ab")[0] + stream.feed(text[2:])[0]
    content, calls = stream.finish()
    assert shown + content == tools.parse_tool_calls(text, ["get_time"])[0] == "ab\ncd"
    assert [c.name for c in calls] == ["get_time"]


def test_forced_stream_emits_each_call_once_complete() -> None:
    stream = tools.ToolStream(tools.plan_tools([WEATHER, TIME], "required", True))
    emitted = []
    for piece in [
        '[{"name": "get_time", "argu',
        'ments": {}}, {"name": "get_weather",',
        ' "arguments": {"city": "Y"}}]',
    ]:
        _, calls = stream.feed(piece)
        emitted.append([c.name for c in calls])
    assert emitted == [[], ["get_time"], ["get_weather"]]
    assert stream.finish() == ("", [])


def test_parallel_tool_calls_false_keeps_one_call_in_auto_mode() -> None:
    text = '<tool_call>{"name": "get_time", "arguments": {}}</tool_call><tool_call>{"name": "get_weather", "arguments": {"city": "Y"}}</tool_call>'
    for parallel, names in ((None, ["get_time", "get_weather"]), (False, ["get_time"])):
        plan = tools.plan_tools([WEATHER, TIME], "auto", parallel)
        stream = tools.ToolStream(plan)
        stream.feed(text)
        assert [c.name for c in stream.finish()[1]] == names
        assert ("at most one call" in tools.system_prompt(plan)) is (parallel is False)
