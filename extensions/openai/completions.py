"""POST /v1/completions (legacy): raw prompts, echo, suffix (fill-in-the-middle), best_of, legacy logprobs."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import anyio
from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from extensions.openai import core
from extensions.openai.auth import caller_id
from extensions.openai.chat import FINGERPRINT, sse
from extensions.openai.errors import from_exception
from extensions.openai.protocol import CompletionRequest
from modules import extensions
from modules.errors import InvalidRequest
from modules.generation.params import GenerationParams
from modules.generation.pipeline import GenerationStats, check_prompt_length, encode_prompt
from modules.loaders.base import Backend, TokenEvent


class LegacyLogprobs:
    """Accumulates the legacy logprobs object: tokens, token_logprobs, top_logprobs, text_offset."""

    def __init__(self, top: int) -> None:
        self.top = top
        self.tokens: list[str] = []
        self.token_logprobs: list[float | None] = []
        self.top_logprobs: list[dict[str, float] | None] = []
        self.text_offset: list[int] = []
        self.offset = 0

    def add(self, text: str, logprob: float | None, tops: dict[str, float] | None) -> None:
        self.tokens.append(text)
        self.token_logprobs.append(logprob)
        self.top_logprobs.append(tops)
        self.text_offset.append(self.offset)
        self.offset += len(text)

    def add_events(self, events: list[TokenEvent]) -> None:
        for event in events:
            tops = {core.piece_text(t.piece): t.logprob for t in (event.top_logprobs or [])[: self.top]}
            self.add(core.piece_text(event.piece), event.logprob, tops)

    def body(self, start: int = 0) -> dict[str, Any]:
        return {
            "tokens": self.tokens[start:],
            "token_logprobs": self.token_logprobs[start:],
            "top_logprobs": self.top_logprobs[start:],
            "text_offset": self.text_offset[start:],
        }

    def total(self) -> float:
        return sum(lp for lp in self.token_logprobs if lp is not None)


def _prompts(req: CompletionRequest) -> list[str | list[int]]:
    prompt = req.prompt
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise InvalidRequest("prompt must not be empty", param="prompt")
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]  # type: ignore[arg-type]
    return list(prompt)  # type: ignore[arg-type]


def fim_prompt(backend: Backend, prompt: str | list[int], suffix: str) -> list[int]:
    """A fill-in-the-middle prompt: the text before the gap, the text after it, then the model writes the middle."""
    tokens = backend.fim_tokens()
    if tokens is None:
        raise InvalidRequest("suffix needs a model with fill-in-the-middle tokens; this one has none", param="suffix")
    prefix_ids = backend.encode(prompt, add_special=False) if isinstance(prompt, str) else prompt
    pre, suf, mid = tokens
    return [pre, *prefix_ids, suf, *backend.encode(suffix, add_special=False), mid]


async def create(req: CompletionRequest, request: Request) -> Any:
    """Handle a legacy completion request."""
    started = time.perf_counter()
    req.log_unknown_fields("completions")
    req.refuse_chat_fields()
    backend = await core.serving_backend(request, req.model)
    if req.stream_options is not None and not req.stream:
        raise InvalidRequest("stream_options is only allowed with stream: true", param="stream_options")
    best_of = req.best_of or req.n
    if best_of < req.n:
        raise InvalidRequest("best_of must be at least n", param="best_of")
    if req.stream and best_of > req.n:
        raise InvalidRequest("best_of cannot be used with stream", param="best_of")
    top = req.logprobs or 0
    want_logprobs = req.logprobs is not None or best_of > req.n
    if want_logprobs and not backend.supports_logprobs:
        raise InvalidRequest(f"the {backend.loader_name} backend cannot return logprobs", param="logprobs")
    generate = req.max_tokens != 0
    params = core.generation_params(req, max_tokens=req.max_tokens if generate else 1, default_max=16)
    params = params.replace(logprobs=want_logprobs, top_logprobs=top)
    prompts = _prompts(req)
    for text in (p for p in prompts if isinstance(p, str)):  # a prompt far too long is refused before tokenizing
        check_prompt_length(backend, text)
    if req.suffix:
        check_prompt_length(backend, req.suffix, "suffix")

    def tokenize() -> list[list[int]]:
        fim = [fim_prompt(backend, p, req.suffix) for p in prompts] if req.suffix else prompts
        return [encode_prompt(backend, p) if isinstance(p, str) else p for p in fim]

    ids = await anyio.to_thread.run_sync(tokenize)  # off the event loop: other requests go on meanwhile
    if req.suffix:
        prompts = list(ids)
    echo_text = [backend.decode(i) if isinstance(p, list) else p for p, i in zip(prompts, ids, strict=True)]
    meta = {
        "id": "cmpl-" + uuid.uuid4().hex,
        "created": int(time.time()),
        "model": req.model or "",
        "system_fingerprint": FINGERPRINT,
    }
    meta["model"] = meta["model"] or _loaded_name()

    echo_logprobs: list[LegacyLogprobs | None] = [None] * len(ids)
    if req.echo and req.logprobs is not None:
        scored = await anyio.to_thread.run_sync(lambda: [backend.score(i, top) for i in ids])
        echo_logprobs = [_echo_logprobs(backend, i, s, top) for i, s in zip(ids, scored, strict=True)]
    if not generate:
        if not req.echo:
            raise InvalidRequest("max_tokens must be at least 1 unless echo is true", param="max_tokens")
        return JSONResponse(_echo_only(meta, echo_text, echo_logprobs, req.n, backend, ids))

    # a text prompt goes to the generation as text when an extension works on text (input_modifier,
    # custom_generate_reply, tokenizer_modifier: the pipeline runs them, as for the notebook); else as its tokens
    hooked = not req.suffix and any(
        extensions.implementers(hook) for hook in ("input_modifier", "custom_generate_reply", "tokenizer_modifier")
    )
    all_params: list[GenerationParams] = []
    all_prompts: list[str | list[int]] = []
    for prompt, prompt_ids in zip(prompts, ids, strict=True):
        all_params += core.seeded(params, best_of)
        all_prompts += [prompt if hooked and isinstance(prompt, str) else prompt_ids] * best_of
    running = await core.start(all_prompts, all_params, backend, owner=caller_id(request))
    prompt_tokens = sum(len(i) for i in ids)  # each distinct prompt once, however many choices it has
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return StreamingResponse(
            _stream(req, running, meta, echo_text, echo_logprobs, best_of, top, include_usage, started, prompt_tokens),
            media_type="text/event-stream",
        )
    texts = [""] * len(all_prompts)
    logs = [LegacyLogprobs(top) for _ in all_prompts]
    stats: list[GenerationStats | None] = [None] * len(all_prompts)
    async for item in core.merge(running, request):
        if item.error is not None:
            raise item.error
        assert item.delta is not None
        texts[item.index] += item.delta.text
        if want_logprobs:
            logs[item.index].add_events(item.delta.tokens)
        if item.delta.stats is not None:
            stats[item.index] = item.delta.stats
    choices = []
    for p in range(len(ids)):
        group = list(range(p * best_of, (p + 1) * best_of))
        if best_of > req.n:
            group = sorted(group, key=lambda g: logs[g].total(), reverse=True)[: req.n]
        for j, g in enumerate(group):
            text = texts[g]
            lp: dict[str, Any] | None = None
            if req.logprobs is not None:
                echoed = echo_logprobs[p] if req.echo else None
                lp = _combine(echoed, logs[g]) if echoed else logs[g].body()
            choices.append(
                {
                    "text": (echo_text[p] if req.echo else "") + text,
                    "index": p * req.n + j,
                    "logprobs": lp,
                    "finish_reason": core.finish_reason(stats[g]),
                }
            )
    done = [s for s in stats if s is not None]
    core.record("completions", done, started, prompt_tokens)
    usage = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": sum(s.new_tokens for s in done),
    }
    usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
    return JSONResponse({**meta, "object": "text_completion", "choices": choices, "usage": usage})


def _loaded_name() -> str:
    from modules import shared

    return shared.model_name or ""


def _echo_logprobs(
    backend: Backend, ids: list[int], scored: list[tuple[float | None, list[tuple[int, float]]]], top: int
) -> LegacyLogprobs:
    result = LegacyLogprobs(top)
    for token, (logprob, tops) in zip(ids, scored, strict=True):
        top_map = {core.piece_text(backend.token_piece(t)): lp for t, lp in tops[:top]} if logprob is not None else None
        result.add(core.piece_text(backend.token_piece(token)), logprob, top_map)
    return result


def _combine(echo: LegacyLogprobs, generated: LegacyLogprobs) -> dict[str, Any]:
    combined = LegacyLogprobs(echo.top)
    for i, text in enumerate(echo.tokens):
        combined.add(text, echo.token_logprobs[i], echo.top_logprobs[i])
    for i, text in enumerate(generated.tokens):
        combined.add(text, generated.token_logprobs[i], generated.top_logprobs[i])
    return combined.body()


def _echo_only(
    meta: dict[str, Any],
    echo_text: list[str],
    echo_logprobs: list[LegacyLogprobs | None],
    n: int,
    backend: Backend,
    ids: list[list[int]],
) -> dict[str, Any]:
    choices = []
    for p, text in enumerate(echo_text):
        for j in range(n):
            lp = echo_logprobs[p]
            choices.append(
                {"text": text, "index": p * n + j, "logprobs": lp.body() if lp else None, "finish_reason": "length"}
            )
    prompt_tokens = sum(len(i) for i in ids)
    return {
        **meta,
        "object": "text_completion",
        "choices": choices,
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": 0, "total_tokens": prompt_tokens},
    }


async def _stream(
    req: CompletionRequest,
    running: core.Running,
    meta: dict[str, Any],
    echo_text: list[str],
    echo_logprobs: list[LegacyLogprobs | None],
    per_prompt: int,
    top: int,
    include_usage: bool,
    started: float,
    prompt_tokens: int,
) -> AsyncIterator[str]:
    extra = {"usage": None} if include_usage else {}

    def chunk(index: int, text: str, logprobs: Any = None, finish: str | None = None) -> str:
        choice = {"text": text, "index": index, "logprobs": logprobs, "finish_reason": finish}
        return sse({**meta, "object": "text_completion", "choices": [choice], **extra})

    offsets = [0] * len(running.builders)
    stats: list[GenerationStats] = []
    try:
        if req.echo:
            for i in range(len(running.builders)):
                p = i // per_prompt
                lp = echo_logprobs[p]
                yield chunk(i, echo_text[p], lp.body() if lp else None)
                offsets[i] = len(echo_text[p])
        async for item in core.merge(running):
            if item.error is not None:
                yield sse(from_exception(item.error).body())
                break
            assert item.delta is not None
            logprobs = None
            if req.logprobs is not None and item.delta.tokens:
                log = LegacyLogprobs(top)
                log.offset = offsets[item.index]
                log.add_events(item.delta.tokens)
                logprobs = log.body()
            offsets[item.index] += len(item.delta.text)
            if item.delta.text or logprobs:
                yield chunk(item.index, item.delta.text, logprobs)
            if item.delta.stats is not None:
                stats.append(item.delta.stats)
                yield chunk(item.index, "", None, core.finish_reason(item.delta.stats))
        core.record("completions", stats, started, prompt_tokens)
        if include_usage:
            completion = sum(s.new_tokens for s in stats)
            usage = {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion,
                "total_tokens": prompt_tokens + completion,
            }
            yield sse({**meta, "object": "text_completion", "choices": [], "usage": usage})
        yield sse("[DONE]")
    finally:
        running.cancel()
