"""Tool calling: tell the model about the tools, constrain it when a call is required, and find calls in its output.

Models whose chat template knows tools get them through the template. Others get a system message describing
the tools and the format ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``. With ``tool_choice``
``required`` or a named function, the output is constrained by a grammar to JSON tool calls, so a call always
comes back. Parsing understands the Hermes/Qwen ``<tool_call>`` tags, Mistral's ``[TOOL_CALLS]`` and bare JSON.
"""

from __future__ import annotations

import contextlib
import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from modules.errors import InvalidRequest

TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"
_MISTRAL = "[TOOL_CALLS]"
# what json.loads raises on text that is not JSON; absurdly deep nesting is a RecursionError, not a ValueError
_BAD_JSON = (ValueError, RecursionError)


@dataclass
class ToolCall:
    """One parsed call: the function's name and its arguments as a JSON string."""

    name: str
    arguments: str
    id: str = ""

    def __post_init__(self) -> None:
        self.id = self.id or "call_" + uuid.uuid4().hex[:24]

    def to_openai(self, index: int | None = None) -> dict[str, Any]:
        """The chat completions shape."""
        call: dict[str, Any] = {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        if index is not None:
            call["index"] = index
        return call


@dataclass
class ToolPlan:
    """What a request's tools ask of generation."""

    tools: list[dict[str, Any]]  # OpenAI tool objects
    mode: str  # "none" | "auto" | "required" | "named"
    named: str | None = None
    parallel: bool = True

    @property
    def active(self) -> bool:
        """True when the model may call a tool."""
        return bool(self.tools) and self.mode != "none"

    @property
    def forced(self) -> bool:
        """True when the output is constrained to tool calls."""
        return self.active and self.mode in ("required", "named")

    def functions(self) -> list[dict[str, Any]]:
        """The function definitions the model may call."""
        funcs = [t["function"] for t in self.tools]
        return [f for f in funcs if f["name"] == self.named] if self.mode == "named" else funcs


def plan_tools(tools: list[dict[str, Any]] | None, tool_choice: Any, parallel: bool | None) -> ToolPlan:
    """Validate ``tools`` / ``tool_choice`` and decide the mode."""
    tools = tools or []
    names = [t["function"]["name"] for t in tools]
    if len(set(names)) != len(names):
        raise InvalidRequest("tool names must be unique", param="tools")
    plan = ToolPlan(tools=tools, mode="auto" if tools else "none", parallel=parallel is not False)
    if tool_choice is None:
        return plan
    if isinstance(tool_choice, str):
        if tool_choice not in ("none", "auto", "required"):
            raise InvalidRequest("tool_choice must be 'none', 'auto', 'required' or a function", param="tool_choice")
        if tool_choice == "required" and not tools:
            raise InvalidRequest("tool_choice 'required' needs tools", param="tool_choice")
        plan.mode = tool_choice
        return plan
    if isinstance(tool_choice, dict):
        function = tool_choice.get("function") if tool_choice.get("type", "function") == "function" else None
        name = function.get("name") if isinstance(function, dict) else tool_choice.get("name")
        if not isinstance(name, str) or name not in names:
            raise InvalidRequest(f"tool_choice names a function that is not in tools: {name!r}", param="tool_choice")
        plan.mode, plan.named, plan.parallel = "named", name, False
        return plan
    raise InvalidRequest("tool_choice must be a string or an object", param="tool_choice")


def template_knows_tools(template: str | None) -> bool:
    """True when a chat template renders ``tools`` itself."""
    return bool(template) and "tools" in str(template)


def system_prompt(plan: ToolPlan) -> str:
    """Instructions for models whose template does not render tools."""
    listing = "\n".join(json.dumps(f, ensure_ascii=False) for f in plan.functions())
    rule = "You must call one of these functions." if plan.forced else "Call a function only when it helps."
    if not plan.parallel:
        rule += " Make at most one call."
    return (
        "You can call functions. Their definitions, as JSON schema:\n"
        f"{listing}\n"
        f"{rule} To call one, reply with {TOOL_OPEN}"
        '{"name": "<function name>", "arguments": {<arguments as JSON>}}'
        f"{TOOL_CLOSE} for each call, and nothing else."
    )


def call_schema(function: dict[str, Any]) -> dict[str, Any]:
    """JSON schema of one call to ``function``."""
    parameters = function.get("parameters") or {"type": "object", "properties": {}}
    return {
        "type": "object",
        "properties": {"name": {"const": function["name"]}, "arguments": parameters},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def forced_schema(plan: ToolPlan) -> dict[str, Any]:
    """The schema constraining the output when a call is required: one call, or a list of calls."""
    calls = [call_schema(f) for f in plan.functions()]
    one = calls[0] if len(calls) == 1 else {"anyOf": calls}
    if plan.parallel and plan.mode != "named":
        return {"type": "array", "items": one, "minItems": 1, "maxItems": 8}
    return one


def _calls_from_json(value: Any) -> list[ToolCall] | None:
    items = value if isinstance(value, list) else [value]
    calls = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return None
        args = item.get("arguments", item.get("parameters", {}))
        if isinstance(args, str):
            try:
                json.loads(args)
            except _BAD_JSON:
                return None
            arguments = args
        else:
            arguments = json.dumps(args, ensure_ascii=False)
        calls.append(ToolCall(name=item["name"], arguments=arguments))
    return calls or None


def parse_tool_calls(text: str, known: list[str]) -> tuple[str, list[ToolCall]]:
    """Split model output into (content, tool calls). Calls to unknown functions are left as content."""
    calls: list[ToolCall] = []
    content = text
    if TOOL_OPEN in text:
        parts = re.findall(re.escape(TOOL_OPEN) + r"(.*?)(?:" + re.escape(TOOL_CLOSE) + r"|$)", text, flags=re.S)
        for part in parts:
            try:
                found = _calls_from_json(json.loads(part.strip()))
            except _BAD_JSON:
                found = None
            if found:
                calls.extend(found)
        if calls:
            content = text[: text.index(TOOL_OPEN)]
    elif _MISTRAL in text:
        head, _, tail = text.partition(_MISTRAL)
        try:
            found = _calls_from_json(json.loads(tail.strip()))
        except _BAD_JSON:
            found = None
        if found:
            calls, content = found, head
    else:
        stripped = text.strip()
        if stripped[:1] in ("{", "["):
            try:
                found = _calls_from_json(json.loads(stripped))
            except _BAD_JSON:
                found = None
            if found:
                calls, content = found, ""
    if any(c.name not in known for c in calls):
        return text, []
    return content.strip() if calls else content, calls


def render_call(call: dict[str, Any]) -> str:
    """An assistant's earlier tool call as text, for templates that do not render ``tool_calls``."""
    function = call.get("function") or {}
    arguments = function.get("arguments", "{}")
    try:
        arguments_value = json.loads(arguments) if isinstance(arguments, str) else arguments
    except _BAD_JSON:
        arguments_value = arguments
    return (
        TOOL_OPEN
        + json.dumps({"name": function.get("name"), "arguments": arguments_value}, ensure_ascii=False)
        + TOOL_CLOSE
    )


class ToolStream:
    """Watch streamed text for tool calls: plain text passes through, a call is held back until complete.

    ``feed`` returns (content to show now, calls completed now). In forced mode the whole output is JSON calls.
    """

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.known = [f["name"] for f in plan.functions()]
        self.buffer = ""
        self.holding = plan.forced
        self.emitted = 0  # calls already returned (forced mode)
        self.shown = False  # some content has been returned

    def _forced_calls(self, final: bool) -> list[ToolCall]:
        decoder = json.JSONDecoder()
        text = self.buffer.strip()
        if not text:
            return []
        values: list[Any] = []
        if text.startswith("["):
            pos = 1
            while pos < len(text):
                while pos < len(text) and text[pos] in " \n\t\r,":
                    pos += 1
                if pos >= len(text) or text[pos] == "]":
                    break
                try:
                    value, pos = decoder.raw_decode(text, pos)
                except _BAD_JSON:
                    break
                values.append(value)
        else:
            with contextlib.suppress(*_BAD_JSON):
                values.append(decoder.raw_decode(text)[0])
        calls = _calls_from_json(values) or []
        new = calls[self.emitted :]
        self.emitted = len(calls)
        return new

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        """Process a chunk of streamed text."""
        self.buffer += text
        if self.plan.forced:
            return "", self._forced_calls(final=False)
        if not self.holding:
            stripped = self.buffer.lstrip()
            bare = not self.shown and stripped[:1] in ("{", "[")  # a bare JSON call is the whole reply or content
            if TOOL_OPEN in self.buffer or _MISTRAL in self.buffer or bare:
                self.holding = True
            else:
                keep = _partial_suffix(self.buffer, (TOOL_OPEN, _MISTRAL))
                if not stripped:  # only whitespace so far: a call may still start
                    return "", []
                out, self.buffer = self.buffer[: len(self.buffer) - keep], self.buffer[len(self.buffer) - keep :]
                self.shown = self.shown or bool(out)
                return out, []
        if TOOL_OPEN in self.buffer:  # release text before the first tag
            head, sep, rest = self.buffer.partition(TOOL_OPEN)
            if head.strip():
                self.buffer = sep + rest
                self.shown = True
                return head, []
        return "", []

    def finish(self) -> tuple[str, list[ToolCall]]:
        """At the end: parse what was held back."""
        if self.plan.forced:
            calls = self._forced_calls(final=True)
            return "", calls
        text, self.buffer = self.buffer, ""
        if not self.holding:
            return text, []
        content, calls = parse_tool_calls(text, self.known)
        if calls and content and self.shown:  # the parse strips the held text; after content shown, its leading
            content = text[: len(text) - len(text.lstrip())] + content  # space is inside the reply ("ab" + "\nc")
        if not self.plan.parallel:
            calls = calls[:1]  # parallel_tool_calls: false allows one call per turn
        return content, calls


def _partial_suffix(text: str, markers: tuple[str, ...]) -> int:
    best = 0
    for marker in markers:
        for length in range(min(len(marker) - 1, len(text)), best, -1):
            if text.endswith(marker[:length]):
                best = length
                break
    return best
