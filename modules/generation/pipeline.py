"""generate_reply(): prompt -> backend token stream -> text deltas, with stop strings, UTF-8 and stats."""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from modules import shared
from modules.errors import ContextOverflow, InvalidRequest, ModelNotLoaded
from modules.generation.params import GenerationParams
from modules.generation.stopping import StopMatcher, Utf8Stream
from modules.loaders.base import Backend, TokenEvent

log = logging.getLogger(__name__)


@dataclass
class GenerationStats:
    """The final record of a generation."""

    prompt_tokens: int = 0
    new_tokens: int = 0
    time_to_first_token: float = 0.0  # seconds from the call to the first token
    total_time: float = 0.0
    tokens_per_second: float = 0.0  # decode speed after the first token
    finish_reason: str = "stop"  # "stop" (EOS or a stop string), "length", "cancelled", "context"
    stop_string: str | None = None
    seed: int = -1

    def summary(self) -> str:
        """One line for the log and the UI."""
        return (
            f"{self.new_tokens} tokens in {self.total_time:.2f} s ({self.tokens_per_second:.1f} tokens/s, "
            f"first token {self.time_to_first_token * 1000:.0f} ms, prompt {self.prompt_tokens} tokens, "
            f"seed {self.seed}, finish: {self.finish_reason})"
        )


@dataclass
class Delta:
    """New text since the last delta, the tokens behind it, and on the last one the stats."""

    text: str
    tokens: list[TokenEvent] = field(default_factory=list)
    stats: GenerationStats | None = None  # set on the final delta only


def current_model() -> Backend:
    """The loaded backend, or ModelNotLoaded (with a 'loading' hint while one loads)."""
    backend = shared.model
    if backend is None:
        if shared.loading_model:
            raise ModelNotLoaded(f"The model {shared.loading_model} is still loading; try again in a moment.")
        raise ModelNotLoaded()
    return backend


def encode_prompt(backend: Backend, prompt: str) -> list[int]:
    """Tokenize a rendered prompt, adding BOS unless the text already starts with it."""
    bos = backend.metadata.bos_token
    add_special = backend.metadata.add_bos_token and not (bos and prompt.startswith(bos))
    return backend.encode(prompt, add_special=add_special)


def check_params(backend: Backend, params: GenerationParams, strict: bool) -> None:
    """Refuse (strict) or log parameters the backend would ignore."""
    ignored = backend.unsupported_params(params)
    if not ignored:
        return
    message = f"the {backend.loader_name} backend does not support {', '.join(ignored)}"
    if strict:
        raise InvalidRequest(message, param=ignored[0])
    log.info("%s; ignored for this generation", message)


def start_reply(
    prompt: str | list[int],
    params: GenerationParams,
    *,
    cancel: threading.Event | None = None,
    key: str | None = None,
    strict: bool = False,
    backend: Backend | None = None,
) -> Iterator[Delta]:
    """Check and submit a generation now; return the iterator of its deltas (the last one carries the stats).

    Raises before returning when the request cannot run: ModelNotLoaded, InvalidRequest (a parameter the
    backend does not support, with ``strict``), ContextOverflow, QueueFull. ``cancel`` (or
    :func:`shared.stop_generation` with ``key``) ends the generation within one step.
    """
    backend = backend or current_model()
    check_params(backend, params, strict)
    started = time.perf_counter()
    prompt_ids = encode_prompt(backend, prompt) if isinstance(prompt, str) else list(prompt)
    limit = backend.context_length
    if len(prompt_ids) >= limit:
        raise ContextOverflow(len(prompt_ids), limit)
    seed = params.resolved_seed()
    run_params = params.replace(seed=seed, max_new_tokens=min(params.max_new_tokens, limit - len(prompt_ids)))
    if shared.settings.verbose and isinstance(prompt, str):
        log.debug("Prompt (%d tokens):\n%s", len(prompt_ids), prompt)
    cancel = cancel or threading.Event()
    events = backend.generate(prompt_ids, run_params, cancel)
    key = key or uuid.uuid4().hex
    shared.register_generation(key, cancel)
    stats = GenerationStats(prompt_tokens=len(prompt_ids), seed=seed)
    return _deltas(events, run_params, stats, cancel, key, started)


def _deltas(
    events: Iterator[TokenEvent],
    run_params: GenerationParams,
    stats: GenerationStats,
    cancel: threading.Event,
    key: str,
    started: float,
) -> Iterator[Delta]:
    utf8, stopper = Utf8Stream(), StopMatcher(run_params.stop)
    pending: list[tuple[TokenEvent, int, int]] = []  # token, start and end offsets in the decoded text
    decoded = released = 0
    first_token_at: float | None = None
    finish = "stop"  # "stop" also covers a matched stop string
    try:
        for event in events:
            if first_token_at is None:
                first_token_at = time.perf_counter()
            if event.token_id >= 0:
                stats.new_tokens += 1
                text = utf8.feed(event.piece)
                pending.append((event, decoded, decoded + len(text)))
                decoded += len(text)
                out, stopped = stopper.feed(text)
                released += len(out)
                if stopped:
                    stats.stop_string = stopper.matched
                    yield Delta(out, [t for t, start, _ in pending if start < released])
                    pending.clear()
                    break
                if out:
                    done = [t for t, _, end in pending if end <= released]
                    pending = [p for p in pending if p[2] > released]
                    yield Delta(out, done)
            if event.finish_reason:
                finish = event.finish_reason
                break
        else:
            finish = "cancelled" if cancel.is_set() else "stop"
        tail = "" if stopper.stopped else stopper.flush() + utf8.flush()
        if tail and stopper.stops:  # the flushed UTF-8 remainder can still complete a stop string
            tail, _ = StopMatcher(stopper.stops).feed(tail)
        now = time.perf_counter()
        stats.total_time = now - started
        stats.time_to_first_token = (first_token_at or now) - started
        if first_token_at is not None and stats.new_tokens > 1 and now > first_token_at:
            stats.tokens_per_second = (stats.new_tokens - 1) / (now - first_token_at)
        stats.finish_reason = finish
        log.info("Generated %s", stats.summary())
        yield Delta(tail, [t for t, _, _ in pending], stats)
    finally:
        cancel.set()  # a consumer that stops iterating (client gone) frees the slot
        close = getattr(events, "close", None)
        if close is not None:
            close()
        shared.unregister_generation(key)


def generate_reply(prompt: str | list[int], params: GenerationParams, **kwargs: Any) -> Iterator[Delta]:
    """Lazy form of :func:`start_reply`: nothing happens until the first delta is asked for."""
    yield from start_reply(prompt, params, **kwargs)


def generate_text(prompt: str | list[int], params: GenerationParams, **kwargs: object) -> tuple[str, GenerationStats]:
    """Run a whole generation and return the text and the stats."""
    parts: list[str] = []
    stats = GenerationStats()
    for delta in generate_reply(prompt, params, **kwargs):  # type: ignore[arg-type]
        parts.append(delta.text)
        if delta.stats is not None:
            stats = delta.stats
    return "".join(parts), stats
