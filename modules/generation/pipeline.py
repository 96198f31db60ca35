"""generate_reply(): prompt -> backend token stream -> text deltas, with stop strings, UTF-8 and stats."""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import uuid
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from modules import extensions, shared
from modules.errors import ContextOverflow, InvalidRequest, ModelNotLoaded
from modules.generation.params import GenerationParams
from modules.generation.stopping import StopMatcher, Utf8Stream
from modules.loaders.base import Backend, TokenEvent, TokenSink, pump

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
    draft_tokens: int = 0  # speculative decoding: tokens drafted for this reply, and how many the model confirmed
    accepted_tokens: int = 0

    def summary(self) -> str:
        """One line for the log and the UI."""
        drafts = f", drafts {self.accepted_tokens}/{self.draft_tokens} accepted" if self.draft_tokens else ""
        return (
            f"{self.new_tokens} tokens in {self.total_time:.2f} s ({self.tokens_per_second:.1f} tokens/s, "
            f"first token {self.time_to_first_token * 1000:.0f} ms, prompt {self.prompt_tokens} tokens{drafts}, "
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


# A prompt longer than its token limit times the most characters one token can stand for cannot fit, whatever the
# tokenizer makes of it: it is refused from its length alone, before tokenizing megabytes. One token stands for at
# most as many characters as its bytes (UTF-8), so the bound is the vocabulary's longest token where the backend
# says how big its vocabulary is, never below MIN_CHARS_PER_TOKEN (special tokens written out), and
# FALLBACK_CHARS_PER_TOKEN where it does not (e.g. a remote engine's tokenizer).
MIN_CHARS_PER_TOKEN = 32
FALLBACK_CHARS_PER_TOKEN = 256
_token_chars: weakref.WeakKeyDictionary[Backend, int] = weakref.WeakKeyDictionary()


def max_token_chars(backend: Backend) -> int:
    """The most characters one of ``backend``'s tokens can stand for (computed once per model, on first need)."""
    known = _token_chars.get(backend)
    if known is not None:
        return known
    bound = FALLBACK_CHARS_PER_TOKEN
    n_vocab = backend.metadata.extra.get("n_vocab")
    if isinstance(n_vocab, int) and 0 < n_vocab <= 2_000_000:
        try:
            bound = max(MIN_CHARS_PER_TOKEN, max(len(backend.token_piece(t)) for t in range(n_vocab)))
        except Exception:  # a backend that cannot list its pieces keeps the generous bound
            log.debug("could not measure the longest token of %s", backend.loader_name, exc_info=True)
    _token_chars[backend] = bound
    return bound


def surely_too_long(backend: Backend, text: str, limit: int) -> bool:
    """True when ``text`` cannot tokenize to ``limit`` tokens or fewer, judged from its length alone (no tokenizing).

    False means only "maybe fits": tokenize to know. Cheap: the vocabulary is measured only for texts longer than
    ``limit * MIN_CHARS_PER_TOKEN`` characters.
    """
    if len(text) <= limit * MIN_CHARS_PER_TOKEN:
        return False
    return len(text) > limit * max_token_chars(backend)


def check_prompt_length(backend: Backend, text: str, param: str = "prompt") -> None:
    """Refuse, without tokenizing it, a prompt far too long for the context (InvalidRequest, context_length_exceeded)."""
    limit = backend.context_length
    if surely_too_long(backend, text, limit):
        raise InvalidRequest(
            f"This model's context holds {limit} tokens; the prompt has {len(text)} characters, more than "
            f"{limit} tokens can hold. Shorten the prompt or raise --n-ctx.",
            param=param,
            code="context_length_exceeded",
        )


def check_params(backend: Backend, params: GenerationParams, strict: bool) -> None:
    """Refuse (strict) or log parameters the backend would ignore."""
    ignored = backend.unsupported_params(params)
    if not ignored:
        return
    message = f"the {backend.loader_name} backend does not support {', '.join(ignored)}"
    if strict:
        raise InvalidRequest(message, param=ignored[0])
    log.info("%s; ignored for this generation", message)


@dataclass
class Prepared:
    """A checked generation: its token ids and the parameters it runs with (seed resolved, length capped).

    ``custom`` holds an extension's ``custom_generate_reply`` iterator (cumulative text) when one took over.
    """

    prompt_ids: list[int]
    params: GenerationParams
    started: float
    custom: Iterator[str] | None = None
    state: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)  # prompt_text, model_inputs (images)
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex[:8])  # names it in the log, start to end


def make_state(params: GenerationParams, **context: Any) -> dict[str, Any]:
    """The ``state`` dict extension hooks receive: every generation parameter plus the chat context."""
    return {**dataclasses.asdict(params), **context}


def params_from_state(state: dict[str, Any], params: GenerationParams) -> GenerationParams:
    """Generation parameters as an extension's ``state_modifier`` left them."""
    changed = {k: state[k] for k in GenerationParams.field_names() if k in state and state[k] != getattr(params, k)}
    return params.replace(**changed) if changed else params


def apply_state_modifier(state: dict[str, Any], params: GenerationParams) -> GenerationParams:
    """Run the extensions' ``state_modifier`` on ``state`` (changed in place); returns the parameters it left."""
    if not extensions.implementers("state_modifier"):
        return params
    modified = extensions.apply_modifier("state_modifier", state)
    if isinstance(modified, dict) and modified is not state:
        state.clear()
        state.update(modified)
    return params_from_state(state, params)


def prepare(
    prompt: str | list[int],
    params: GenerationParams,
    backend: Backend,
    *,
    strict: bool = False,
    state: dict[str, Any] | None = None,
    state_modified: bool = False,
    is_chat: bool = False,
    images: list[Any] | None = None,
) -> Prepared:
    """Apply the extensions' input hooks, tokenize and check; raises before anything runs.

    Hooks, in order: ``state_modifier`` (unless the caller ran it already: ``state_modified``); ``input_modifier`` (raw prompts; chat input is modified earlier, when
    the prompt is built); ``custom_generate_reply``; ``tokenizer_modifier``. Raises InvalidRequest (a parameter
    the backend does not support, with ``strict``) or ContextOverflow.
    """
    started = time.perf_counter()
    if state is None:
        state = make_state(params)
    else:  # the caller's dict sees what the hooks change
        for key, value in make_state(params).items():
            state.setdefault(key, value)
    if not state_modified:
        params = apply_state_modifier(state, params)
    check_params(backend, params, strict)
    original = prompt
    if isinstance(prompt, str) and not is_chat:
        prompt = extensions.apply_modifier("input_modifier", prompt, state=state, is_chat=False)
    custom = None
    if isinstance(prompt, str) and extensions.implementers("custom_generate_reply"):
        custom = extensions.first_result(
            "custom_generate_reply",
            question=prompt,
            original_question=original,
            state=state,
            stopping_strings=list(params.stop),
            is_chat=is_chat,
        )
    extra: dict[str, Any] = {"prompt_text": prompt} if isinstance(prompt, str) else {}
    if isinstance(prompt, str) and not extensions.implementers("tokenizer_modifier"):
        check_prompt_length(backend, prompt, "messages" if is_chat else "prompt")  # before tokenizing megabytes
    if images:
        if not backend.supports_vision:
            raise InvalidRequest(f"the loaded model ({backend.loader_name}) cannot see images", param="messages")
        if not isinstance(prompt, str):
            raise InvalidRequest("images need a text prompt", param="prompt")
        prompt_ids, extra["model_inputs"] = backend.encode_multimodal(prompt, images)
    else:
        prompt_ids = encode_prompt(backend, prompt) if isinstance(prompt, str) else list(prompt)
    if extensions.implementers("tokenizer_modifier"):
        text = prompt if isinstance(prompt, str) else backend.decode(prompt_ids)
        _, prompt_ids = extensions.apply_tokenizer(state, text, prompt_ids)
    if extensions.implementers("logits_processor_modifier"):
        if backend.supports_logits_processors:
            extra["logits_processors"] = extensions.logits_processors(prompt_ids)
        else:
            log.debug("logits processors from extensions need a torch backend; %s ignores them", backend.loader_name)
    limit = backend.context_length
    if len(prompt_ids) >= limit:
        raise ContextOverflow(len(prompt_ids), limit)
    run_params = params.replace(
        seed=params.resolved_seed(), max_new_tokens=min(params.max_new_tokens, limit - len(prompt_ids))
    )
    if shared.settings.verbose and isinstance(prompt, str):
        log.debug("Prompt (%d tokens):\n%s", len(prompt_ids), prompt)
    return Prepared(prompt_ids, run_params, started, custom, state, extra)


def custom_events(texts: Iterator[str], cancel: threading.Event) -> Iterator[TokenEvent]:
    """An extension's cumulative replies as token events (one per new piece of text)."""
    shown = ""
    try:
        for text in texts:
            if cancel.is_set():
                yield TokenEvent(-1, b"", finish_reason="cancelled")
                return
            if text.startswith(shown) and len(text) > len(shown):
                yield TokenEvent(0, text[len(shown) :].encode("utf-8"))
                shown = text
    finally:
        close = getattr(texts, "close", None)
        if close is not None:
            close()
    yield TokenEvent(-1, b"", finish_reason="stop")


def log_start(prepared: Prepared, backend: Backend) -> None:
    """One line per generation as it starts, so that a crash's log says which model and request were running."""
    name = shared.model_name if backend is shared.model else getattr(backend.path, "name", "?")
    log.info(
        "Request %s: %s on %s, %d prompt tokens, up to %d new",
        prepared.request_id,
        "extension reply" if prepared.custom is not None else "generating",
        f"{name} ({backend.loader_name})",
        len(prepared.prompt_ids),
        prepared.params.max_new_tokens,
    )


def launch(prepared: Prepared, backend: Backend, cancel: threading.Event) -> Iterator[TokenEvent]:
    """Start a prepared generation and return its token events."""
    log_start(prepared, backend)
    if prepared.custom is not None:
        return custom_events(prepared.custom, cancel)
    return backend.generate(prepared.prompt_ids, prepared.params, cancel, prepared.extra)


def launch_to(prepared: Prepared, backend: Backend, cancel: threading.Event, sink: TokenSink) -> None:
    """Start a prepared generation whose events go to an asyncio ``sink``."""
    log_start(prepared, backend)
    if prepared.custom is None:
        backend.submit(prepared.prompt_ids, prepared.params, cancel, sink, prepared.extra)
        return
    pump(custom_events(prepared.custom, cancel), sink, "custom-reply")


class DeltaBuilder:
    """Turns a backend's token events into text deltas: UTF-8 assembly, stop strings, logprob alignment, stats."""

    def __init__(self, prepared: Prepared) -> None:
        self.stats = GenerationStats(prompt_tokens=len(prepared.prompt_ids), seed=prepared.params.seed)
        self.request_id = prepared.request_id
        self.started = prepared.started
        self.utf8, self.stopper = Utf8Stream(), StopMatcher(prepared.params.stop)
        self.pending: list[tuple[TokenEvent, int, int]] = []  # token, start and end offsets in the decoded text
        self.decoded = self.released = 0
        self.first_token_at: float | None = None
        self.done = False

    def feed(self, event: TokenEvent) -> list[Delta]:
        """Deltas made by one event; the last one carries the stats once the generation is over."""
        if self.done:
            return []
        if self.first_token_at is None:
            self.first_token_at = time.perf_counter()
        out: list[Delta] = []
        if event.token_id >= 0:
            self.stats.new_tokens += 1
            text = self.utf8.feed(event.piece)
            self.pending.append((event, self.decoded, self.decoded + len(text)))
            self.decoded += len(text)
            shown, stopped = self.stopper.feed(text)
            self.released += len(shown)
            if stopped:
                self.stats.stop_string = self.stopper.matched
                out.append(Delta(shown, [t for t, start, _ in self.pending if start < self.released]))
                self.pending.clear()
                return [*out, self.finish("stop")]
            if shown:
                done = [t for t, _, end in self.pending if end <= self.released]
                self.pending = [p for p in self.pending if p[2] > self.released]
                out.append(Delta(shown, done))
        if event.speculation:
            self.stats.draft_tokens, self.stats.accepted_tokens = event.speculation
        if event.finish_reason:
            out.append(self.finish(event.finish_reason))
        return out

    def finish(self, reason: str) -> Delta:
        """The final delta: text still held back, remaining tokens, and the stats."""
        self.done = True
        # the flushed UTF-8 remainder can still complete a stop string; held-back text that never did is shown
        tail = "" if self.stopper.stopped else self.stopper.finish(self.utf8.flush())
        self.stats.stop_string = self.stopper.matched
        stats = self.stats
        now = time.perf_counter()
        stats.total_time = now - self.started
        stats.time_to_first_token = (self.first_token_at or now) - self.started
        if self.first_token_at is not None and stats.new_tokens > 1 and now > self.first_token_at:
            stats.tokens_per_second = (stats.new_tokens - 1) / (now - self.first_token_at)
        stats.finish_reason = reason
        log.info("Request %s: generated %s", self.request_id, stats.summary())
        tokens = [t for t, _, _ in self.pending]
        self.pending.clear()
        return Delta(tail, tokens, stats)


def start_reply(
    prompt: str | list[int],
    params: GenerationParams,
    *,
    cancel: threading.Event | None = None,
    key: str | None = None,
    strict: bool = False,
    backend: Backend | None = None,
    state: dict[str, Any] | None = None,
    state_modified: bool = False,
    is_chat: bool = False,
    images: list[Any] | None = None,
) -> Iterator[Delta]:
    """Check and submit a generation now; return the iterator of its deltas (the last one carries the stats).

    Raises before returning when the request cannot run: ModelNotLoaded, InvalidRequest (a parameter the
    backend does not support, with ``strict``), ContextOverflow, QueueFull. ``cancel`` (or
    :func:`shared.stop_generation` with ``key``) ends the generation within one step.
    """
    backend = backend or current_model()
    prepared = prepare(
        prompt,
        params,
        backend,
        strict=strict,
        state=state,
        state_modified=state_modified,
        is_chat=is_chat,
        images=images,
    )
    cancel = cancel or threading.Event()
    events = launch(prepared, backend, cancel)
    key = key or uuid.uuid4().hex
    shared.register_generation(key, cancel)
    return _deltas(events, DeltaBuilder(prepared), cancel, key)


def _deltas(events: Iterator[TokenEvent], builder: DeltaBuilder, cancel: threading.Event, key: str) -> Iterator[Delta]:
    try:
        for event in events:
            yield from builder.feed(event)
            if builder.done:
                break
        if not builder.done:
            yield builder.finish("cancelled" if cancel.is_set() else "stop")
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


def stream_text(prompt: str, params: GenerationParams, **kwargs: Any) -> Iterator[tuple[str, GenerationStats | None]]:
    """A raw completion as (cumulative text, stats on the last item); the last text went through ``output_modifier``."""
    text = ""
    state: dict[str, Any] = kwargs.pop("state", None) or {}
    for delta in generate_reply(prompt, params, state=state, is_chat=False, **kwargs):
        text += delta.text
        if delta.stats is not None:
            text = extensions.apply_modifier("output_modifier", text, state=state, is_chat=False)
        yield text, delta.stats


def count_tokens(text: str) -> int:
    """Tokens ``text`` takes with the loaded model (0 without one)."""
    backend = shared.model
    return len(encode_prompt(backend, text)) if backend is not None and text else 0
