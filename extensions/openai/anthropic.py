"""POST /v1/messages: the Anthropic Messages API (used by several coding clients) on the chat pipeline.

Errors on this endpoint use Anthropic's shape: ``{"type": "error", "error": {"type", "message"}}``. A final
assistant message is a prefill: the reply continues it.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import anyio
from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import Field, ValidationError

from extensions.openai import core
from extensions.openai.errors import APIError, from_exception
from extensions.openai.protocol import ChatCompletionRequest, TextgenExtras
from modules.errors import InvalidRequest

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    503: "overloaded_error",
}


class MessagesRequest(TextgenExtras):
    """The request body of POST /v1/messages."""

    model: str
    max_tokens: int = Field(ge=1)
    messages: list[dict[str, Any]] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, ge=0, le=1)
    top_k: int | None = Field(None, ge=0)
    stream: bool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None


def anthropic_error(exc: BaseException) -> JSONResponse:
    """An error in Anthropic's shape."""
    err = from_exception(exc)
    kind = _ERROR_TYPES.get(err.status, "api_error")
    return JSONResponse(
        {"type": "error", "error": {"type": kind, "message": err.message}}, status_code=err.status, headers=err.headers
    )


def _invalid(exc: ValidationError) -> JSONResponse:
    """A request body that does not validate, as a 400 naming the first bad field."""
    first = exc.errors()[0]
    where = ".".join(str(p) for p in first["loc"])
    return anthropic_error(InvalidRequest(f"{where}: {first['msg']}", param=where))


def _blocks_text(
    content: Any, where: str
) -> tuple[str | list[dict[str, Any]], list[dict[str, Any]], list[tuple[str, str]]]:
    """(text, or OpenAI content parts when there are images; tool_use blocks; tool results) of a message."""
    if isinstance(content, str):
        return content, [], []
    if not isinstance(content, list):
        raise InvalidRequest("content must be a string or a list of blocks", param=where)
    texts: list[str] = []
    uses: list[dict[str, Any]] = []
    results: list[tuple[str, str]] = []
    parts: list[dict[str, Any]] = []
    for block in content:
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            texts.append(str(block.get("text", "")))
            parts.append({"type": "text", "text": str(block.get("text", ""))})
        elif kind == "tool_use":
            uses.append(block)
        elif kind == "tool_result":
            inner = block.get("content", "")
            if isinstance(inner, list):
                inner = "\n".join(str(b.get("text", "")) for b in inner if isinstance(b, dict))
            results.append((str(block.get("tool_use_id", "")), str(inner)))
        elif kind == "image":
            source = block.get("source") or {}
            if source.get("type") == "base64":
                url = f"data:{source.get('media_type', 'image/png')};base64,{source.get('data', '')}"
            elif source.get("type") == "url":
                url = str(source.get("url", ""))
            else:
                raise InvalidRequest("an image block needs a base64 or url source", param=where)
            parts.append({"type": "image_url", "image_url": {"url": url}})
        else:
            raise InvalidRequest(f"unsupported content block {kind!r}", param=where)
    if any(p["type"] == "image_url" for p in parts):
        return parts, uses, results
    return "\n".join(texts), uses, results


def to_chat(req: MessagesRequest) -> ChatCompletionRequest:
    """The equivalent chat completion request."""
    messages: list[dict[str, Any]] = []
    if req.system:
        system = req.system if isinstance(req.system, str) else "\n".join(str(b.get("text", "")) for b in req.system)
        messages.append({"role": "system", "content": system})
    for i, message in enumerate(req.messages):
        role = message.get("role")
        if role not in ("user", "assistant"):
            raise InvalidRequest("role must be 'user' or 'assistant'", param=f"messages.{i}.role")
        text, uses, results = _blocks_text(message.get("content", ""), f"messages.{i}.content")
        for tool_use_id, output in results:
            messages.append({"role": "tool", "tool_call_id": tool_use_id, "content": output})
        if uses:
            text = text if isinstance(text, str) else ""
            calls = [
                {
                    "id": u.get("id"),
                    "type": "function",
                    "function": {"name": u.get("name"), "arguments": json.dumps(u.get("input", {}))},
                }
                for u in uses
            ]
            messages.append({"role": "assistant", "content": text or None, "tool_calls": calls})
        elif text or not results:
            messages.append({"role": role, "content": text})
    tools = [
        {
            "type": "function",
            "function": {
                "name": t.get("name"),
                "description": t.get("description"),
                "parameters": t.get("input_schema") or {"type": "object"},
            },
        }
        for t in req.tools or []
    ]
    choice: Any = None
    if req.tool_choice:
        kind = req.tool_choice.get("type")
        choice = {"auto": "auto", "any": "required", "none": "none"}.get(str(kind))
        if kind == "tool":
            choice = {"type": "function", "function": {"name": req.tool_choice.get("name")}}
        if choice is None:
            raise InvalidRequest(f"unknown tool_choice type {kind!r}", param="tool_choice")
    body: dict[str, Any] = {
        **{k: v for k, v in req.model_dump(exclude_none=True).items() if k in TextgenExtras.model_fields},
        "model": req.model,
        "messages": messages,
        "max_completion_tokens": req.max_tokens,
        "stop": req.stop_sequences,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "tools": tools or None,
        "tool_choice": choice,
        "parallel_tool_calls": not bool((req.tool_choice or {}).get("disable_parallel_tool_use")),
        "continue_final_message": True,
    }
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in body.items() if v is not None})
    except ValidationError as exc:
        raise InvalidRequest(f"invalid request: {exc.errors()[0]['msg']}", param="messages") from exc


async def count_tokens(body: dict[str, Any], request: Request) -> Any:
    """POST /v1/messages/count_tokens: ``{"input_tokens": N}``, the prompt /v1/messages would be given.

    The body is a Messages request without ``max_tokens``; the prompt is rendered and tokenized by the same code
    as for /v1/messages, so the count equals the ``input_tokens`` its reply reports.
    """
    try:
        req = MessagesRequest.model_validate({"max_tokens": 1, **body})
    except ValidationError as exc:
        return _invalid(exc)
    try:
        req.log_unknown_fields("messages.count_tokens")
        chat_req = to_chat(req)
        backend = await core.serving_backend(request, req.model)
        tokens = await anyio.to_thread.run_sync(core.count_chat_tokens, chat_req, backend)
    except Exception as exc:
        return anthropic_error(exc)
    return {"input_tokens": tokens}


def _stop_reason(stats: Any, calls: bool) -> tuple[str, str | None]:
    if calls:
        return "tool_use", None
    if stats is not None and stats.stop_string:
        return "stop_sequence", stats.stop_string
    if stats is not None and stats.finish_reason in ("length", "context"):
        return "max_tokens", None
    return "end_turn", None


async def create(body: dict[str, Any], request: Request) -> Any:
    """Handle a Messages API request (errors in Anthropic's shape)."""
    try:
        req = MessagesRequest.model_validate(body)
    except ValidationError as exc:
        return _invalid(exc)
    try:
        started = time.perf_counter()
        req.log_unknown_fields("messages")
        chat_req = to_chat(req)
        job, running = await core.start_chat(chat_req, request, req.model)
    except (APIError, Exception) as exc:
        return anthropic_error(exc)
    message_id = "msg_" + uuid.uuid4().hex
    if req.stream:
        return StreamingResponse(_stream(job, running, message_id, req.model, started), media_type="text/event-stream")
    content: list[dict[str, Any]] = []
    text, stats, calls = "", None, []
    try:
        async for event in core.chat_events(job, running, request):
            if event.kind == "error":
                assert event.error is not None
                return anthropic_error(event.error)
            text += event.text
            if event.call is not None:
                calls.append(event.call)
            stats = event.stats or stats
    finally:
        running.cancel()
    if text:
        content.append({"type": "text", "text": text})
    content += [
        {"type": "tool_use", "id": "toolu_" + c.id[5:], "name": c.name, "input": json.loads(c.arguments)} for c in calls
    ]
    reason, sequence = _stop_reason(stats, bool(calls))
    core.record("messages", [stats] if stats else [], started)
    return {
        "id": message_id, "type": "message", "role": "assistant", "model": req.model, "content": content,
        "stop_reason": reason, "stop_sequence": sequence,
        "usage": {"input_tokens": stats.prompt_tokens if stats else 0, "output_tokens": stats.new_tokens if stats else 0},
    }  # fmt: skip


async def _stream(
    job: core.ChatJob, running: core.Running, message_id: str, model: str, started: float
) -> AsyncIterator[str]:
    def event(kind: str, **data: Any) -> str:
        return f"event: {kind}\ndata: {json.dumps({'type': kind, **data}, ensure_ascii=False)}\n\n"

    message: dict[str, Any] = {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": {"input_tokens": 0, "output_tokens": 0},
    }
    yield event("message_start", message=message)
    index, text_open, calls, stats = 0, False, False, None
    try:
        async for ev in core.chat_events(job, running):
            if ev.kind == "error":
                assert ev.error is not None
                err = from_exception(ev.error)
                yield event("error", error={"type": _ERROR_TYPES.get(err.status, "api_error"), "message": err.message})
                return
            if ev.kind == "text":
                if not text_open:
                    yield event("content_block_start", index=index, content_block={"type": "text", "text": ""})
                    text_open = True
                yield event("content_block_delta", index=index, delta={"type": "text_delta", "text": ev.text})
            elif ev.kind == "call" and ev.call is not None:
                if text_open:
                    yield event("content_block_stop", index=index)
                    index, text_open = index + 1, False
                block = {"type": "tool_use", "id": "toolu_" + ev.call.id[5:], "name": ev.call.name, "input": {}}
                yield event("content_block_start", index=index, content_block=block)
                yield event(
                    "content_block_delta",
                    index=index,
                    delta={"type": "input_json_delta", "partial_json": ev.call.arguments},
                )
                yield event("content_block_stop", index=index)
                index, calls = index + 1, True
            elif ev.kind == "done":
                stats = ev.stats
        if text_open:
            yield event("content_block_stop", index=index)
        reason, sequence = _stop_reason(stats, calls)
        core.record("messages", [stats] if stats else [], started)
        usage = {"output_tokens": stats.new_tokens if stats else 0}
        yield event("message_delta", delta={"stop_reason": reason, "stop_sequence": sequence}, usage=usage)
        yield event("message_stop")
    finally:
        running.cancel()
