"""POST /v1/chat/completions: plain, streamed (choices interleaved by index), with tools and logprobs."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from extensions.openai import core
from extensions.openai import tools as tooling
from extensions.openai.errors import from_exception
from extensions.openai.protocol import ChatCompletionRequest
from modules.generation.pipeline import GenerationStats
from modules.loaders.base import TokenEvent

FINGERPRINT = "textgen"


def sse(data: dict[str, Any] | str) -> str:
    """One server-sent event."""
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"


def token_logprobs(tokens: list[TokenEvent], top: int) -> list[dict[str, Any]]:
    """Chat-shaped logprob entries (with bytes) for some tokens."""
    entries = []
    for event in tokens:
        if event.logprob is None:
            continue
        entries.append(
            {
                "token": core.piece_text(event.piece),
                "logprob": event.logprob,
                "bytes": list(event.piece),
                "top_logprobs": [
                    {"token": core.piece_text(t.piece), "logprob": t.logprob, "bytes": list(t.piece)}
                    for t in (event.top_logprobs or [])[:top]
                ],
            }
        )
    return entries


class _Choice:
    """The accumulated state of one choice."""

    def __init__(self, plan: tooling.ToolPlan) -> None:
        self.text = ""
        self.logprobs: list[dict[str, Any]] = []
        self.calls: list[tooling.ToolCall] = []
        self.tools = tooling.ToolStream(plan) if plan.active else None
        self.stats: GenerationStats | None = None

    def feed(self, text: str) -> tuple[str, list[tooling.ToolCall]]:
        if self.tools is None:
            return text, []
        return self.tools.feed(text)

    def finish(self) -> tuple[str, list[tooling.ToolCall]]:
        if self.tools is None:
            return "", []
        return self.tools.finish()


async def create(req: ChatCompletionRequest, request: Request) -> Any:
    """Handle a chat completion request."""
    started = time.perf_counter()
    job, running = await core.start_chat(req, request, req.model)
    meta = {
        "id": "chatcmpl-" + uuid.uuid4().hex,
        "created": int(time.time()),
        "model": job.served_name,
        "system_fingerprint": FINGERPRINT,
    }
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return StreamingResponse(
            _stream(job, running, meta, include_usage, started),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    choices = [_Choice(job.plan) for _ in range(job.n)]
    async for item in core.merge(running, request):
        if item.error is not None:
            raise item.error
        choice = choices[item.index]
        assert item.delta is not None
        content, calls = choice.feed(item.delta.text)
        choice.text += content
        choice.calls += calls
        if job.params.logprobs:
            choice.logprobs += token_logprobs(item.delta.tokens, job.params.top_logprobs)
        if item.delta.stats is not None:
            choice.stats = item.delta.stats
            content, calls = choice.finish()
            choice.text += content
            choice.calls += calls
    stats = [c.stats for c in choices if c.stats is not None]
    core.record("chat.completions", stats, started)
    return JSONResponse(
        {
            **meta,
            "object": "chat.completion",
            "choices": [
                {
                    "index": i,
                    "message": {
                        "role": "assistant",
                        "content": c.text if (c.text or not c.calls) else None,
                        **({"tool_calls": [call.to_openai() for call in c.calls]} if c.calls else {}),
                        "refusal": None,
                    },
                    "logprobs": {"content": c.logprobs, "refusal": None} if job.params.logprobs else None,
                    "finish_reason": core.finish_reason(c.stats, bool(c.calls) and job.plan.mode != "named"),
                }
                for i, c in enumerate(choices)
            ],
            "usage": core.usage(stats),
        }
    )


async def _stream(
    job: core.ChatJob, running: core.Running, meta: dict[str, Any], include_usage: bool, started: float
) -> AsyncIterator[str]:
    extra = {"usage": None} if include_usage else {}

    def chunk(index: int, delta: dict[str, Any], finish: str | None = None, logprobs: Any = None) -> str:
        if logprobs is None and job.params.logprobs and finish is None:
            logprobs = {"content": [], "refusal": None}  # as OpenAI: every chunk before the last has a list
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        return sse({**meta, "object": "chat.completion.chunk", "choices": [choice], **extra})

    choices = [_Choice(job.plan) for _ in range(job.n)]
    for i in range(job.n):
        yield chunk(i, {"role": "assistant", "content": ""})
    try:
        async for item in core.merge(running):
            if item.error is not None:
                yield sse(from_exception(item.error).body())
                break
            choice = choices[item.index]
            assert item.delta is not None
            content, calls = choice.feed(item.delta.text)
            logprobs = None
            if job.params.logprobs and item.delta.tokens:
                logprobs = {"content": token_logprobs(item.delta.tokens, job.params.top_logprobs), "refusal": None}
            if content or logprobs:
                yield chunk(item.index, {"content": content}, logprobs=logprobs)
            if item.delta.stats is not None:
                choice.stats = item.delta.stats
                tail, more = choice.finish()
                calls += more
                if tail:
                    yield chunk(item.index, {"content": tail})
            for call in calls:
                for piece in _call_deltas(call, len(choice.calls)):
                    yield chunk(item.index, {"tool_calls": [piece]})
                choice.calls.append(call)
            if item.delta.stats is not None:
                yield chunk(
                    item.index, {}, core.finish_reason(choice.stats, bool(choice.calls) and job.plan.mode != "named")
                )
        stats = [c.stats for c in choices if c.stats is not None]
        core.record("chat.completions", stats, started)
        if include_usage:
            yield sse({**meta, "object": "chat.completion.chunk", "choices": [], "usage": core.usage(stats)})
        yield sse("[DONE]")
    finally:
        running.cancel()


def _call_deltas(call: tooling.ToolCall, index: int) -> list[dict[str, Any]]:
    """A tool call as stream deltas: the name first, then the arguments (a JSON string) in pieces."""
    first = {"index": index, "id": call.id, "type": "function", "function": {"name": call.name, "arguments": ""}}
    pieces = [call.arguments[i : i + 32] for i in range(0, len(call.arguments), 32)] or [""]
    return [first] + [{"index": index, "function": {"arguments": p}} for p in pieces]
