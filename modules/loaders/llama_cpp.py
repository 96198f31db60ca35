"""llama.cpp backend: in-process llama-cpp-python with parallel slots, continuous batching and a prompt cache.

One llama.cpp context holds ``--parallel`` sequences. A scheduler thread, at every step, decodes one token
for every generating sequence and feeds waiting prompts in chunks alongside them, all in a single batch, so
a long prompt never freezes the other streams. Each slot keeps its KV cache after a request ends; a new
request goes to the free slot sharing the longest token prefix with its prompt and re-reads only the rest.
"""

from __future__ import annotations

import collections
import ctypes
import logging
import queue
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import llama_cpp
import llama_cpp._logger
from llama_cpp._internals import LlamaBatch, LlamaContext, LlamaModel

from modules.errors import ContextOverflow, InvalidRequest, ModelLoadError, QueueFull
from modules.generation.params import GenerationParams
from modules.loaders import OPTIONS, llama_cpp_check, llama_cpp_spec, precheck
from modules.loaders.base import Backend, TokenEvent, TokenSink, deliver, drain
from modules.loaders.llama_cpp_meta import read_metadata
from modules.loaders.llama_cpp_sampling import (
    SUPPORTED,
    NothingToSample,
    RequestSampler,
    schema_to_grammar,
    top_logprobs,
)
from modules.loaders.llama_cpp_side import SideContext, SideOps, Task, default_threads
from modules.loaders.llama_cpp_spec import NgramIndex, SpecState, Speculator, Work, common_prefix, start_speculation

log = logging.getLogger(__name__)

PREFILL_CHUNK_WHILE_DECODING = 128  # prompt tokens per step while other sequences are generating
_backend_ready = False
_backend_lock = threading.Lock()


def _init_backend(verbose: bool) -> None:
    global _backend_ready
    with _backend_lock:
        llama_cpp._logger.set_verbose(verbose)
        if not _backend_ready:
            llama_cpp.llama_backend_init()
            _backend_ready = True


@dataclass
class _Request:
    prompt: list[int]
    params: GenerationParams
    cancel: threading.Event
    sampler: RequestSampler
    out: queue.SimpleQueue[TokenEvent | BaseException] = field(default_factory=queue.SimpleQueue)
    sink: TokenSink | None = None  # asyncio consumers get events through this instead of ``out``
    n_fed: int = 0  # prompt tokens now in the KV cache
    generated: int = 0
    next_token: int | None = None  # sampled, to be fed at the next step
    batch_index: int = -1  # where this request's logits are in the current batch (then its draft's rows)
    done: bool = False
    spec: SpecState | None = None  # speculative decoding state, when it is on


@dataclass
class _Slot:
    seq_id: int
    tokens: list[int] = field(default_factory=list)  # what the KV cache holds for this sequence
    request: _Request | None = None
    last_used: float = 0.0


def _best_slot(free: list[_Slot], prompt: list[int]) -> _Slot:
    """The free slot whose cache serves the prompt best: tokens reused, less half of the cached tokens thrown away
    (then the least recently used), so a prompt that shares only a system prompt or a template's first tokens
    takes an empty slot instead of evicting a long cached conversation."""

    def value(slot: _Slot) -> tuple[float, float]:
        reused = common_prefix(slot.tokens, prompt)
        return reused - (len(slot.tokens) - reused) / 2, -slot.last_used

    return max(free, key=value)


class LlamaCppBackend(SideOps, Backend):
    """GGUF models through llama-cpp-python's low-level API."""

    loader_name = "llama.cpp"
    supports_lora = True
    supports_grammar = True
    supports_logprobs = True
    supports_embeddings = True
    option_names = OPTIONS["llama.cpp"]
    supported_params = SUPPORTED
    required_packages = ("llama_cpp",)

    def __init__(self) -> None:
        super().__init__()
        self._model: LlamaModel | None = None
        self._ctx: LlamaContext | None = None
        self._batch: LlamaBatch | None = None
        self._n_ctx = 0
        self._n_batch = 512
        self._max_queue = 64
        self._prompt_cache = True
        self._slots: list[_Slot] = []
        self._waiting: collections.deque[_Request] = collections.deque()
        self._cv = threading.Condition()
        self._running = False
        self._thread: threading.Thread | None = None
        self._eog: list[int] = []
        self._eog_set: frozenset[int] = frozenset()
        self._n_vocab = 0
        self._options: dict[str, Any] = {}
        self._sides: dict[str, SideContext] = {}  # "embed" and "score" contexts, created on first use
        self._loras: dict[str, tuple[Any, float]] = {}
        self._tasks: list[Task] = []  # work the scheduler thread runs between steps (LoRA changes, side contexts)
        self._outbox: list[tuple[TokenSink, TokenEvent | BaseException]] = []  # sink events of this step
        self.extra_buffers = True  # llama.cpp's use_extra_bufts for this model (off: no AMX, no repacking)
        self._spec: Speculator | None = None
        self._flash_attn = -1  # llama.cpp's flash_attn_type for this model's contexts
        self._stats = {"requests": 0, "prompt_tokens": 0, "cache_hit_tokens": 0, "cache_hits": 0, "steps": 0}

    # ---------------------------------------------------------------- loading
    @classmethod
    def check(cls, path: Path, options: dict[str, Any]) -> None:
        """A .gguf file whose header reads and whose size covers the tensor data it declares (every shard)."""
        super().check(path, options)
        precheck.gguf_file(path)
        if options.get("draft_model") and options.get("speculative", True) is not False:
            try:
                precheck.gguf_file(llama_cpp_spec.draft_path(options["draft_model"]))
            except ModelLoadError as exc:
                raise ModelLoadError(f"the draft model cannot be used: {exc}") from exc

    @classmethod
    def load(cls, path: Path, options: dict[str, Any]) -> LlamaCppBackend:
        """Load a GGUF file and start the scheduler."""
        self = cls()
        self.path = path
        self._options = dict(options)
        _init_backend(bool(options.get("verbose")))
        model_params = llama_cpp.llama_model_default_params()
        model_params.n_gpu_layers = int(options.get("n_gpu_layers") or 0)
        if model_params.n_gpu_layers < 0:
            model_params.n_gpu_layers = 0x7FFFFFFF
        model_params.use_extra_bufts = self.extra_buffers = llama_cpp_check.extra_buffers_allowed(
            bool(options.get("amx"))
        )
        try:
            self._model = LlamaModel(path_model=str(path), params=model_params, verbose=bool(options.get("verbose")))
        except (ValueError, OSError) as exc:
            raise ModelLoadError(
                f"llama.cpp could not load {path.name}: {exc} (the server log says why: most often an architecture "
                "this llama.cpp build does not know, or not enough memory for the weights)"
            ) from exc
        parallel = int(options.get("parallel") or 1)
        trained = self._model.n_ctx_train()
        self._n_ctx = int(options.get("n_ctx") or min(trained, 4096))
        threads = int(options.get("threads") or default_threads())
        ctx_params = llama_cpp.llama_context_default_params()
        ctx_params.n_ctx = self._n_ctx * parallel
        ctx_params.n_seq_max = parallel
        self._n_batch = int(options.get("n_batch") or 512)
        ctx_params.n_batch = self._n_batch
        ctx_params.n_ubatch = self._n_batch
        ctx_params.n_threads = threads
        ctx_params.n_threads_batch = int(options.get("threads_batch") or threads)
        ctx_params.no_perf = True
        flash = options.get("flash_attn")
        if flash is None:  # llama.cpp's own choice on a GPU; on the CPU its flash attention is the slower path
            flash = None if model_params.n_gpu_layers > 0 else False
        ctx_params.flash_attn_type = self._flash_attn = -1 if flash is None else int(bool(flash))
        try:
            self._ctx = LlamaContext(model=self._model, params=ctx_params, verbose=bool(options.get("verbose")))
        except ValueError as exc:
            self._model.close()
            raise ModelLoadError(
                f"llama.cpp could not create a context for {path.name} (out of memory?): {exc}"
            ) from exc
        self._batch = LlamaBatch(n_tokens=self._n_batch + parallel, embd=0, n_seq_max=1, verbose=False)
        self._n_vocab = self._model.n_vocab()
        vocab = self._model.vocab
        self._eog = [t for t in range(self._n_vocab) if llama_cpp.llama_vocab_is_eog(vocab, t)]
        self._eog_set = frozenset(self._eog)
        max_queue = options.get("max_queue")
        self._max_queue = 64 if max_queue is None else int(max_queue)
        self._prompt_cache = options.get("prompt_cache", True) is not False
        self._slots = [_Slot(seq_id=i) for i in range(parallel)]
        self.max_parallel = parallel
        if options.get("speculative", True) is not False:
            try:
                self._spec = start_speculation(
                    self._model, options, self._n_ctx, parallel, threads, ctx_params.flash_attn_type, model_params
                )
            except ModelLoadError:
                self.unload()
                raise
        self.metadata = read_metadata(self._model, path, self._eog)
        self._running = True
        self._thread = threading.Thread(target=self._loop, name="llama.cpp-scheduler", daemon=True)
        self._thread.start()
        return self

    def unload(self) -> None:
        """Stop the scheduler, fail pending requests, free the context and the model."""
        with self._cv:
            self._running = False
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=30)
        for task in self._tasks:
            task.error = ModelLoadError("the model has been unloaded")
            task.done.set()
        self._tasks.clear()
        for req in [s.request for s in self._slots if s.request] + list(self._waiting):
            if req is not None:
                self._finish(req, "cancelled")
        self._waiting.clear()
        self._flush()
        for side in self._sides.values():
            side.close()
        self._sides.clear()
        if self._spec is not None:
            self._spec.close()
        for obj in (self._batch, self._ctx):
            if obj is not None:
                obj.close()
        for adapter, _ in self._loras.values():  # after every context using them is gone
            llama_cpp.llama_adapter_lora_free(adapter)
        self._loras.clear()
        if self._model is not None:
            self._model.close()
        self._batch = self._ctx = self._model = None

    # ---------------------------------------------------------------- tokens
    @property
    def context_length(self) -> int:
        return self._n_ctx

    def _require_model(self) -> LlamaModel:
        if self._model is None:
            raise ModelLoadError("the model has been unloaded")
        return self._model

    def encode(self, text: str, add_special: bool = True) -> list[int]:
        return list(self._require_model().tokenize(text.encode("utf-8"), add_bos=add_special, special=True))

    def decode(self, ids: list[int]) -> str:
        bad = [t for t in ids if not 0 <= t < self._n_vocab]
        if bad:
            raise InvalidRequest(
                f"token id {bad[0]} is outside the vocabulary (0..{self._n_vocab - 1})", param="tokens"
            )
        return b"".join(self.token_piece(t, special=True) for t in ids).decode("utf-8", errors="replace")

    def token_piece(self, token_id: int, special: bool = False) -> bytes:
        model = self._require_model()
        buf = ctypes.create_string_buffer(256)
        n = llama_cpp.llama_token_to_piece(model.vocab, token_id, buf, len(buf), 0, special)
        return bytes(buf.raw[: max(n, 0)])

    # ---------------------------------------------------------------- generation
    def generate(
        self,
        prompt_ids: list[int],
        params: GenerationParams,
        cancel: threading.Event,
        extra: dict[str, Any] | None = None,
    ) -> Iterator[TokenEvent]:
        """Queue the request (QueueFull when slots and queue are full) and return its token stream."""
        return self._stream(self._enqueue(prompt_ids, params, cancel, None))

    def submit(
        self,
        prompt_ids: list[int],
        params: GenerationParams,
        cancel: threading.Event,
        sink: TokenSink,
        extra: dict[str, Any] | None = None,
    ) -> None:
        """Queue the request; the scheduler hands its events to ``sink``, all of a step's at once."""
        self._enqueue(prompt_ids, params, cancel, sink)

    def _enqueue(
        self, prompt_ids: list[int], params: GenerationParams, cancel: threading.Event, sink: TokenSink | None
    ) -> _Request:
        model = self._require_model()
        if not prompt_ids:
            raise InvalidRequest("the prompt is empty", param="prompt")
        if len(prompt_ids) >= self._n_ctx:  # the pipeline refuses this first; callers of the backend may not
            raise ContextOverflow(len(prompt_ids), self._n_ctx)
        bad = [t for t in prompt_ids if not 0 <= t < self._n_vocab]
        if bad:
            raise InvalidRequest(
                f"token id {bad[0]} is outside the vocabulary (0..{self._n_vocab - 1})", param="prompt"
            )
        grammar = params.grammar or (schema_to_grammar(params.json_schema) if params.json_schema is not None else None)
        sampler = RequestSampler(model.vocab, self._n_vocab, params, self._eog, self._n_ctx, grammar)
        sampler.accept_prompt(prompt_ids)
        req = _Request(prompt=list(prompt_ids), params=params, cancel=cancel, sampler=sampler, sink=sink)
        with self._cv:
            if not self._running:
                sampler.close()
                raise ModelLoadError("the model has been unloaded")
            if self._live_busy() + self._live_waiting() >= len(self._slots) + self._max_queue:
                sampler.close()
                raise QueueFull()
            self._waiting.append(req)
            self._cv.notify_all()
        return req

    def _stream(self, req: _Request) -> Iterator[TokenEvent]:
        alive = lambda: self._thread is not None and self._thread.is_alive()  # noqa: E731
        return drain(req.out, req.cancel, self._cv, alive, "the llama.cpp scheduler")

    def _live_busy(self) -> int:
        """Slots held by requests that are not cancelled (a cancelled one frees its slot at the next step)."""
        return sum(1 for s in self._slots if s.request is not None and not s.request.cancel.is_set())

    def _live_waiting(self) -> int:
        """Waiting requests that are not cancelled; cancelled ones hold no place in the queue."""
        return sum(1 for r in self._waiting if not r.cancel.is_set())

    def stats(self) -> dict[str, Any]:
        with self._cv:
            busy = sum(1 for s in self._slots if s.request is not None)
            spec = {}
            if self._spec:
                cost = self._spec.cost  # the planner's fit: what it believes a step of n tokens costs
                spec = {
                    "draft_tokens": self._spec.drafted,
                    "accepted_tokens": self._spec.accepted,
                    "step_seconds": {str(n): round(cost.time(n), 6) for n in (1, 2, 4, 8)},
                    "step_switch_seconds": round(cost.switch, 6),
                }
            return {
                **self._stats,
                **spec,
                "slots": len(self._slots),
                "busy_slots": busy,
                "queue_depth": self._live_waiting(),
            }

    # ---------------------------------------------------------------- scheduler
    def _send(self, req: _Request, item: TokenEvent | BaseException) -> None:
        if req.sink is None:
            req.out.put(item)
        else:
            self._outbox.append((req.sink, item))

    def _flush(self) -> None:
        if self._outbox:
            batch, self._outbox = self._outbox, []
            deliver(batch)

    def _finish(
        self, req: _Request, reason: str, slot: _Slot | None = None, token: int = -1, piece: bytes = b"", **extra: Any
    ) -> None:
        """End a request: free its slot first, then send the final event."""
        if slot is not None:
            slot.request = None
            slot.last_used = time.monotonic()
        if req.done:
            return
        req.done = True
        req.sampler.close()
        if req.spec is not None:
            extra["speculation"] = (req.spec.drafted, req.spec.accepted)
        self._send(req, TokenEvent(token_id=token, piece=piece, finish_reason=reason, **extra))

    def _admit(self) -> None:
        """Move waiting requests into free slots (the one whose cache serves the prompt best, see _best_slot)."""
        self._drop_cancelled_waiters()
        while self._waiting:
            req = self._waiting[0]
            free = [s for s in self._slots if s.request is None]
            if not free:
                return
            self._waiting.popleft()
            best = _best_slot(free, req.prompt)
            reuse = min(common_prefix(best.tokens, req.prompt), len(req.prompt) - 1) if self._prompt_cache else 0
            assert self._ctx is not None
            if reuse < len(best.tokens):
                if not self._ctx.kv_cache_seq_rm(best.seq_id, reuse, -1):
                    self._ctx.kv_cache_seq_rm(best.seq_id, 0, -1)
                    reuse = 0
                del best.tokens[reuse:]
            req.n_fed = reuse
            best.request = req
            if self._spec is not None:
                req.spec = SpecState(index=None if self._spec.draft_model else NgramIndex(req.prompt))
            self._stats["requests"] += 1
            self._stats["prompt_tokens"] += len(req.prompt)
            if reuse:
                self._stats["cache_hits"] += 1
                self._stats["cache_hit_tokens"] += reuse

    def _drop_cancelled_waiters(self) -> None:
        """End every cancelled request still in the queue, wherever it is (caller holds ``_cv``)."""
        if any(r.cancel.is_set() for r in self._waiting):
            live = collections.deque(r for r in self._waiting if not r.cancel.is_set())
            for req in self._waiting:
                if req.cancel.is_set():
                    self._finish(req, "cancelled")
            self._waiting = live

    def _loop(self) -> None:
        while True:
            with self._cv:
                while (
                    self._running and not self._tasks and not self._waiting and not any(s.request for s in self._slots)
                ):
                    self._cv.wait()
                if not self._running:
                    return
                tasks, self._tasks = self._tasks, []
            for task in tasks:  # between steps: nothing is decoding or sampling now
                try:
                    task.result = task.run()
                except BaseException as exc:  # handed to the caller waiting on the task
                    task.error = exc
                finally:
                    task.done.set()
            with self._cv:
                self._admit()
            try:
                self._step()
            except Exception as exc:  # keep the scheduler alive; fail only the requests in flight
                log.exception("llama.cpp step failed")
                for slot in self._slots:
                    self._abort(slot, RuntimeError(f"generation failed: {exc}"))
            finally:
                self._flush()

    def _side_budget(self) -> int:
        """Tokens an embedding or scoring decode may take now (scheduler thread): a prompt chunk's while requests
        are generating or waiting, so they keep their pace; the whole batch when the model is idle."""
        busy = bool(self._waiting) or any(s.request is not None for s in self._slots)
        return PREFILL_CHUNK_WHILE_DECODING if busy else self._n_batch

    def _abort(self, slot: _Slot, error: Exception) -> None:
        """End the slot's request with ``error`` and empty its cache (what it holds may be half a step)."""
        req = slot.request
        if req is not None:
            self._send(req, error)
            req.done = True
            req.sampler.close()
            slot.request = None
        if self._ctx is not None:
            self._ctx.kv_cache_seq_rm(slot.seq_id, 0, -1)
        slot.tokens.clear()

    def _step(self) -> None:
        assert self._ctx is not None and self._batch is not None
        batch = self._batch.batch
        n = 0
        active: list[_Slot] = []
        for slot in self._slots:
            req = slot.request
            if req is None:
                continue
            if req.cancel.is_set():
                self._finish(req, "cancelled", slot)
                continue
            req.batch_index = -1
        decoding = [s for s in self._slots if s.request is not None and s.request.next_token is not None]
        if self._spec is not None and decoding:
            self._plan_drafts(decoding)
        for slot in decoding:  # decoding: the sampled token, and the draft after it when there is one
            req = slot.request
            assert req is not None and req.next_token is not None
            req.batch_index = n
            for token in [req.next_token, *(req.spec.draft if req.spec is not None else ())]:
                batch.token[n], batch.pos[n], batch.n_seq_id[n] = token, len(slot.tokens), 1
                batch.seq_id[n][0], batch.logits[n] = slot.seq_id, True
                slot.tokens.append(token)
                n += 1
            req.next_token = None
            active.append(slot)
        # Prefill in chunks with what is left of the batch; while other streams decode, a smaller chunk per step
        # keeps their tokens flowing (a long prompt never freezes them for more than a short step).
        decoded = n
        budget = self._n_batch if n == 0 else min(self._n_batch, PREFILL_CHUNK_WHILE_DECODING + n)
        for slot in self._slots:
            req = slot.request
            if req is None or req.batch_index >= 0 or req.n_fed >= len(req.prompt):
                continue
            room = budget - n
            if room <= 0:
                break
            chunk = req.prompt[req.n_fed : req.n_fed + room]
            for j, token in enumerate(chunk):
                batch.token[n], batch.pos[n], batch.n_seq_id[n] = token, len(slot.tokens) + j, 1
                batch.seq_id[n][0], batch.logits[n] = slot.seq_id, False
                n += 1
            slot.tokens.extend(chunk)
            req.n_fed += len(chunk)
            if req.n_fed == len(req.prompt):
                batch.logits[n - 1] = True
                req.batch_index = n - 1
            active.append(slot)
        if n == 0:
            return
        batch.n_tokens = n
        started = time.perf_counter()
        code = llama_cpp.llama_decode(self._ctx.ctx, batch)
        if self._spec is not None and code == 0:
            self._spec.cost.step(n, time.perf_counter() - started, pure=n == decoded)  # pure: fed no prompt
        self._stats["steps"] += 1
        if code != 0:
            raise RuntimeError(f"llama_decode returned {code}")
        for slot in active:
            req = slot.request
            if req is None or req.batch_index < 0:
                continue
            try:
                self._emit(slot, req)
            except NothingToSample as exc:  # this request's own settings: it alone ends
                self._abort(slot, exc)

    def _plan_drafts(self, decoding: list[_Slot]) -> None:
        assert self._spec is not None
        work = []
        for slot in decoding:
            req = slot.request
            assert req is not None and req.spec is not None and req.next_token is not None
            limit = min(req.params.max_new_tokens - req.generated - 1, self._n_ctx - len(slot.tokens) - 2)
            tokens = [*slot.tokens, req.next_token] if self._spec.draft_model is not None else []
            work.append(Work(slot.seq_id, req.spec, tokens, limit))
        waiting = any(s.request is not None and s.request.n_fed < len(s.request.prompt) for s in self._slots)
        room = self._n_batch - len(decoding) - (PREFILL_CHUNK_WHILE_DECODING if waiting else 0)  # prompts go on
        self._spec.plan(work, room, alone=not waiting)

    def _emit(self, slot: _Slot, req: _Request) -> None:
        """Sample the request's rows of this step in turn: the pending token's, then one per draft token while
        the sample confirms the draft. The KV cache keeps what was confirmed; the rest of the draft is removed."""
        assert self._ctx is not None
        spec = req.spec
        draft = spec.draft if spec is not None else []
        held = len(slot.tokens) - len(draft)  # the KV cache's tokens up to the one fed this step
        first, j = -1, 0
        for j in range(len(draft) + 1):
            token, logprob, alternatives = req.sampler.sample(self._ctx.ctx, req.batch_index + j, req.generated)
            if j == 0:
                first = token
            confirmed = j < len(draft) and token == draft[j]
            if self._take(slot, req, token, logprob, alternatives, held + j) or not confirmed:
                break
            assert self._spec is not None and spec is not None
            self._spec.confirmed(spec)
        if len(slot.tokens) > held + j:
            self._ctx.kv_cache_seq_rm(slot.seq_id, held + j, -1)
            del slot.tokens[held + j :]
        if spec is not None:
            spec.record(first, j)

    def _take(
        self,
        slot: _Slot,
        req: _Request,
        token: int,
        logprob: float | None,
        alternatives: list[tuple[int, float]] | None,
        held: int,
    ) -> bool:
        """Send one sampled token (``held``: tokens the sequence's cache holds before it); True when it ends the
        request."""
        tops = top_logprobs(alternatives, lambda t: self.token_piece(t, special=True))
        if token in self._eog_set:
            self._finish(req, "stop", slot, logprob=logprob, top_logprobs=tops)
            return True
        req.generated += 1
        if req.spec is not None and req.spec.index is not None:
            req.spec.index.append(token)
        piece = self.token_piece(token, special=not req.params.skip_special_tokens)
        # stop when prompt + reply fill the context (as OpenAI counts); the pipeline caps max_new_tokens to the
        # same room, so "context" only shows when a caller asks the backend itself for more than fits
        full = held + 1 >= self._n_ctx
        if req.generated >= req.params.max_new_tokens or full:
            reason = "length" if req.generated >= req.params.max_new_tokens else "context"
            self._finish(req, reason, slot, token=token, piece=piece, logprob=logprob, top_logprobs=tops)
            return True
        self._send(req, TokenEvent(token_id=token, piece=piece, logprob=logprob, top_logprobs=tops))
        req.next_token = token
        return False
