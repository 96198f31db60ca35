"""POST /v1/responses (stateless): OpenAI's Responses API on top of the chat pipeline.

Nothing is stored: ``previous_response_id`` is refused, ``store`` is accepted but no response is kept.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import Field

from extensions.openai import core
from extensions.openai.errors import APIError, from_exception
from extensions.openai.protocol import ChatCompletionRequest, TextgenExtras
from modules.errors import InvalidRequest


class ResponsesRequest(TextgenExtras):
    """The request body of POST /v1/responses."""

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, ge=0, le=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    stream: bool = False
    previous_response_id: str | None = None
    store: bool | None = None
    metadata: dict[str, Any] | None = None
    user: str | None = None
    seed: int | None = None
    truncation: Literal["auto", "disabled"] | None = None


def _content_text(content: Any, where: str) -> str | list[dict[str, Any]]:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequest("content must be a string or a list of parts", param=where)
    parts: list[dict[str, Any]] = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text"):
            parts.append({"type": "text", "text": str(part.get("text", ""))})
        elif kind in ("input_image", "image_url"):
            parts.append({"type": "image_url", "image_url": part.get("image_url") or {"url": part.get("url")}})
        else:
            raise InvalidRequest(f"unsupported content part {kind!r}", param=where)
    return parts


def to_chat(req: ResponsesRequest) -> ChatCompletionRequest:
    """The equivalent chat completion request."""
    if req.previous_response_id:
        raise InvalidRequest(
            "this server is stateless: previous_response_id is not supported; send the whole input",
            param="previous_response_id",
        )
    messages: list[dict[str, Any]] = []
    if req.instructions:
        messages.append({"role": "system", "content": req.instructions})
    items = [{"role": "user", "content": req.input}] if isinstance(req.input, str) else req.input
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        where = f"input[{i}]"
        if kind == "message":
            role = item.get("role", "user")
            if role not in ("user", "assistant", "system", "developer"):
                raise InvalidRequest(f"unknown role {role!r}", param=where)
            messages.append({"role": role, "content": _content_text(item.get("content", ""), where + ".content")})
        elif kind == "function_call":
            call = {
                "id": item.get("call_id"),
                "type": "function",
                "function": {"name": item.get("name"), "arguments": item.get("arguments", "{}")},
            }
            if messages and messages[-1]["role"] == "assistant" and messages[-1].get("tool_calls") is not None:
                messages[-1]["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output", "")
            messages.append(
                {
                    "role": "tool",
                    "tool_call_id": item.get("call_id"),
                    "content": output if isinstance(output, str) else json.dumps(output),
                }
            )
        else:
            raise InvalidRequest(f"unsupported input item type {kind!r}", param=where)
    tools = []
    for i, tool in enumerate(req.tools or []):
        if tool.get("type") != "function":
            raise InvalidRequest(f"only function tools are supported, got {tool.get('type')!r}", param=f"tools[{i}]")
        tools.append(
            {
                "type": "function",
                "function": {k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool},
            }
        )
    choice: Any = req.tool_choice
    if isinstance(choice, dict) and choice.get("type") == "function":
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    body: dict[str, Any] = {
        **{k: v for k, v in req.model_dump(exclude_none=True).items() if k in TextgenExtras.model_fields},
        "model": req.model,
        "messages": messages,
        "max_completion_tokens": req.max_output_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "seed": req.seed,
        "tools": tools or None,
        "tool_choice": choice,
        "parallel_tool_calls": req.parallel_tool_calls,
        "user": req.user,
    }
    fmt = (req.text or {}).get("format")
    if isinstance(fmt, dict) and fmt.get("type") in ("json_object", "json_schema"):
        if fmt["type"] == "json_schema":
            body["response_format"] = {
                "type": "json_schema",
                "json_schema": {
                    "name": fmt.get("name", "response"),
                    "schema": fmt.get("schema"),
                    "strict": fmt.get("strict"),
                },
            }
        else:
            body["response_format"] = {"type": "json_object"}
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in body.items() if v is not None})
    except ValueError as exc:
        raise InvalidRequest(f"invalid input: {exc}", param="input") from exc


def _message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {
        "type": "message",
        "id": item_id,
        "status": status,
        "role": "assistant",
        "content": [{"type": "output_text", "text": text, "annotations": []}],
    }


def _call_item(call: Any) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": "fc_" + call.id[5:],
        "call_id": call.id,
        "name": call.name,
        "arguments": call.arguments,
        "status": "completed",
    }


def _response(base: dict[str, Any], output: list[dict[str, Any]], stats: Any, status: str) -> dict[str, Any]:
    usage = None
    if stats is not None:
        usage = {
            "input_tokens": stats.prompt_tokens,
            "output_tokens": stats.new_tokens,
            "total_tokens": stats.prompt_tokens + stats.new_tokens,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens_details": {"reasoning_tokens": 0},
        }
    incomplete = (
        {"reason": "max_output_tokens"} if stats is not None and stats.finish_reason in ("length", "context") else None
    )
    return {
        **base,
        "status": "incomplete" if incomplete else status,
        "incomplete_details": incomplete,
        "output": output,
        "usage": usage,
    }


async def create(req: ResponsesRequest, request: Request) -> Any:
    """Handle a Responses API request."""
    started = time.perf_counter()
    req.log_unknown_fields("responses")
    chat_req = to_chat(req)
    job, running = await core.start_chat(chat_req, request, req.model)
    base = {
        "id": "resp_" + uuid.uuid4().hex, "object": "response", "created_at": int(time.time()), "model": job.served_name,
        "instructions": req.instructions, "max_output_tokens": req.max_output_tokens, "temperature": req.temperature,
        "top_p": req.top_p, "tools": req.tools or [], "tool_choice": req.tool_choice or "auto",
        "parallel_tool_calls": req.parallel_tool_calls is not False, "previous_response_id": None, "error": None,
        "text": req.text or {"format": {"type": "text"}}, "metadata": req.metadata or {}, "store": False, "user": req.user,
    }  # fmt: skip
    if req.stream:
        return StreamingResponse(_stream(job, running, base, started), media_type="text/event-stream")
    text, calls, stats = "", [], None
    async for event in core.chat_events(job, running, request):
        if event.kind == "error":
            assert event.error is not None
            raise event.error
        text += event.text
        if event.call:
            calls.append(event.call)
        stats = event.stats or stats
    core.record("responses", [stats] if stats else [], started)
    output = ([_message_item("msg_" + uuid.uuid4().hex, text)] if text or not calls else []) + [
        _call_item(c) for c in calls
    ]
    return JSONResponse(_response(base, output, stats, "completed"))


async def _stream(job: core.ChatJob, running: core.Running, base: dict[str, Any], started: float) -> AsyncIterator[str]:
    sequence = 0

    def event(kind: str, **data: Any) -> str:
        nonlocal sequence
        sequence += 1
        return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': sequence, **data}, ensure_ascii=False)}\n\n"

    msg_id = "msg_" + uuid.uuid4().hex
    text, stats, opened = "", None, False
    output: list[dict[str, Any]] = []
    yield event("response.created", response=_response(base, [], None, "in_progress"))
    yield event("response.in_progress", response=_response(base, [], None, "in_progress"))
    try:
        async for ev in core.chat_events(job, running):
            if ev.kind == "error":
                assert ev.error is not None
                err = from_exception(ev.error)
                yield event("error", code=err.code, message=err.message, param=err.param)
                return
            if ev.kind == "text":
                if not opened:
                    opened = True
                    yield event(
                        "response.output_item.added", output_index=0, item=_message_item(msg_id, "", "in_progress")
                    )
                    yield event(
                        "response.content_part.added",
                        item_id=msg_id,
                        output_index=0,
                        content_index=0,
                        part={"type": "output_text", "text": "", "annotations": []},
                    )
                text += ev.text
                yield event(
                    "response.output_text.delta", item_id=msg_id, output_index=0, content_index=0, delta=ev.text
                )
            elif ev.kind == "call" and ev.call is not None:
                index = len(output) + (1 if opened else 0)
                item = _call_item(ev.call)
                yield event(
                    "response.output_item.added",
                    output_index=index,
                    item={**item, "arguments": "", "status": "in_progress"},
                )
                yield event(
                    "response.function_call_arguments.delta",
                    item_id=item["id"],
                    output_index=index,
                    delta=item["arguments"],
                )
                yield event(
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    output_index=index,
                    arguments=item["arguments"],
                )
                yield event("response.output_item.done", output_index=index, item=item)
                output.append(item)
            elif ev.kind == "done":
                stats = ev.stats
        if opened:
            yield event("response.output_text.done", item_id=msg_id, output_index=0, content_index=0, text=text)
            yield event(
                "response.content_part.done",
                item_id=msg_id,
                output_index=0,
                content_index=0,
                part={"type": "output_text", "text": text, "annotations": []},
            )
            yield event("response.output_item.done", output_index=0, item=_message_item(msg_id, text))
            output.insert(0, _message_item(msg_id, text))
        core.record("responses", [stats] if stats else [], started)
        final = _response(base, output, stats, "completed")
        yield event("response.completed" if final["status"] == "completed" else "response.incomplete", response=final)
    finally:
        running.cancel()


def not_found(response_id: str) -> None:
    """GET /v1/responses/{id}: nothing is stored."""
    raise APIError(
        404, f"response {response_id!r} not found: this server does not store responses", param="response_id"
    )
