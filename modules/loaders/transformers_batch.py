"""Continuous batching for the transformers backend: one scheduler thread per loaded model.

Every step, the running sequences each decode one token in ONE forward pass: their KV caches live in one
``DynamicCache`` with a batch dimension, left-padded to a common length, with a per-row attention mask and
position ids. A waiting request is admitted between steps: its prompt is prefilled alone, its first token
sampled, and its cache joined to the batch. A finished or cancelled row leaves the batch at once (the cache
is compacted and padding no row needs any more is cut off). Each row keeps its own sampler chain, seeded
generator, grammar matcher and logprobs, so a request's tokens do not depend on what runs beside it (up to
the float noise of batched matmuls).

Requests with images (``model_inputs``) run alone: nothing is admitted beside them. So does everything on a
model whose cache is not made of plain full-attention layers (checked on the first prompt).
"""

from __future__ import annotations

import atexit
import collections
import logging
import queue
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from modules.errors import ModelLoadError, QueueFull
from modules.generation import sampling
from modules.generation.params import GenerationParams
from modules.loaders.base import QueuePlace, TokenEvent, TokenSink, TopLogprob, deliver, drain

log = logging.getLogger(__name__)
_schedulers: weakref.WeakSet[Scheduler] = weakref.WeakSet()


@atexit.register
def _stop_all() -> None:
    """Stop every scheduler thread before the interpreter tears torch down (a daemon thread inside it can abort)."""
    for scheduler in list(_schedulers):
        scheduler.stop()


@dataclass(eq=False)
class Request:
    """One generation: its samplers and where its events go."""

    prompt: list[int]
    params: GenerationParams
    cancel: threading.Event
    chain: list[Any]
    generator: Any
    matcher: Any
    model_inputs: dict[str, Any]
    out: queue.SimpleQueue[TokenEvent | BaseException] = field(default_factory=queue.SimpleQueue)
    sink: TokenSink | None = None
    history: Any = None  # (1, n) token ids: prompt and reply so far, as the processors see them
    next_token: int = -1  # sampled, fed at the next step
    length: int = 0  # real tokens in this row's KV cache (its next position)
    generated: int = 0
    alone: bool = False  # nothing may run beside it
    done: bool = False

    @property
    def exclusive(self) -> bool:
        """Vision inputs: run alone, on the plain one-sequence path."""
        return bool(self.model_inputs)


class Batch:
    """The running rows' KV caches as one left-padded ``DynamicCache`` and its (rows, length) attention mask."""

    def __init__(self, torch: Any) -> None:
        self.torch = torch
        self.cache: Any = None
        self.mask: Any = None  # long (rows, cache length): 1 real token, 0 padding

    def padded(self) -> bool:
        return self.mask is not None and bool((self.mask == 0).any())

    def join(self, cache: Any, length: int) -> None:
        """Add one prefilled row (its cache of ``length`` tokens) as the last row."""
        torch = self.torch
        ones = torch.ones((1, length), dtype=torch.long)
        if self.cache is None:
            self.cache, self.mask = cache, ones
            return
        width = self.mask.shape[1]
        full = max(width, length)
        for mine, theirs in zip(self.cache.layers, cache.layers, strict=True):
            mine.keys = torch.cat(
                [_left_pad(torch, mine.keys, full - width), _left_pad(torch, theirs.keys, full - length)]
            )
            mine.values = torch.cat(
                [_left_pad(torch, mine.values, full - width), _left_pad(torch, theirs.values, full - length)]
            )
        self.mask = torch.cat(
            [_left_pad_mask(torch, self.mask, full - width), _left_pad_mask(torch, ones, full - length)]
        )

    def keep(self, rows: list[int]) -> None:
        """Keep only these rows, and cut the leading columns that are padding in every row left."""
        torch = self.torch
        if not rows:
            self.cache = self.mask = None
            return
        index = torch.tensor(rows, dtype=torch.long)
        self.mask = self.mask[index]
        start = int(self.mask.any(dim=0).nonzero()[0])
        self.mask = self.mask[:, start:]
        for layer in self.cache.layers:
            device_index = index.to(layer.keys.device)
            layer.keys = layer.keys[device_index, :, start:]
            layer.values = layer.values[device_index, :, start:]


def _left_pad(torch: Any, states: Any, n: int) -> Any:
    if n <= 0:
        return states
    shape = list(states.shape)
    shape[2] = n
    return torch.cat([states.new_zeros(shape), states], dim=2)


def _left_pad_mask(torch: Any, mask: Any, n: int) -> Any:
    return mask if n <= 0 else torch.cat([mask.new_zeros((mask.shape[0], n)), mask], dim=1)


def batchable_cache(cache: Any) -> bool:
    """True when every layer of a prefilled cache is a plain full-attention ``DynamicLayer`` (rows can be joined)."""
    from transformers.cache_utils import DynamicLayer

    layers: list[Any] = list(getattr(cache, "layers", None) or [])
    return bool(layers) and all(
        type(layer) is DynamicLayer and layer.is_initialized and layer.keys is not None for layer in layers
    )


class Scheduler:
    """Slots, a bounded queue and the step loop for one loaded transformers model."""

    def __init__(self, backend: Any, parallel: int, max_queue: int) -> None:
        import torch

        self.torch = torch
        self.backend = backend
        self.parallel = max(1, parallel)
        self.max_queue = max_queue
        self.cv = threading.Condition()
        self.forward_lock = threading.Lock()  # one forward pass at a time (steps, scoring)
        self.waiting: collections.deque[Request] = collections.deque()
        self.rows: list[Request] = []  # in the batch, in its row order
        self.pending: list[Request] = []  # admitted, prompt not yet prefilled
        self.batch = Batch(torch)
        self.batchable: bool | None = None  # unknown until the first prompt's cache is seen
        self.paused = 0  # LoRA changes waiting for the batch to empty
        self.running = True
        self.outbox: list[tuple[TokenSink, TokenEvent | BaseException]] = []
        self.stats = {"requests": 0, "steps": 0}
        self.thread = threading.Thread(target=self._loop, name="transformers-scheduler", daemon=True)
        self.thread.start()
        _schedulers.add(self)

    # ---------------------------------------------------------------- requests
    def enqueue(self, req: Request) -> None:
        with self.cv:
            if not self.running:
                raise ModelLoadError("the model has been unloaded")
            if self._live_busy() + self._live_waiting() >= self.parallel + self.max_queue:
                raise QueueFull()
            self.waiting.append(req)
            self.cv.notify_all()

    def stream(self, req: Request) -> Iterator[TokenEvent]:
        alive = lambda: self.thread.is_alive()  # noqa: E731
        events = drain(req.out, req.cancel, self.cv, alive, "the transformers scheduler")
        # a stream dropped unread gives its place back (and one that ended leaves its cancel Event alone)
        return QueuePlace(lambda: None if req.done else req.cancel.set()).guard(events)

    def _live_busy(self) -> int:
        return sum(1 for r in [*self.rows, *self.pending] if not r.cancel.is_set())

    def _live_waiting(self) -> int:
        return sum(1 for r in self.waiting if not r.cancel.is_set())

    def snapshot(self) -> dict[str, Any]:
        with self.cv:
            return {
                **self.stats,
                "slots": self.parallel,
                "busy_slots": len(self.rows) + len(self.pending),
                "queue_depth": self._live_waiting(),
            }

    def exclusive(self, work: Callable[[], Any]) -> Any:
        """Run ``work`` once no generation runs, holding new ones back meanwhile (LoRA changes)."""
        with self.cv:
            if not self.running:
                raise ModelLoadError("the model has been unloaded")
            self.paused += 1
            try:
                while (self.rows or self.pending) and self.running:
                    self.cv.wait(0.5)
                if not self.running:
                    raise ModelLoadError("the model has been unloaded")
            except BaseException:
                self.paused -= 1
                self.cv.notify_all()
                raise
        try:
            with self.forward_lock:
                return work()
        finally:
            with self.cv:
                self.paused -= 1
                self.cv.notify_all()

    def stop(self) -> None:
        """End the loop; every request still here ends "cancelled"."""
        with self.cv:
            self.running = False
            self.cv.notify_all()
        self.thread.join(timeout=30)
        with self.cv:
            for req in [*self.rows, *self.pending, *self.waiting]:
                self._finish(req, "cancelled")
            self.rows.clear()
            self.pending.clear()
            self.waiting.clear()
            self.batch = Batch(self.torch)
        self._flush()

    # ---------------------------------------------------------------- delivery
    def _send(self, req: Request, item: TokenEvent | BaseException) -> None:
        if req.sink is None:
            req.out.put(item)
        else:
            self.outbox.append((req.sink, item))

    def _flush(self) -> None:
        if self.outbox:
            batch, self.outbox = self.outbox, []
            deliver(batch)

    def _finish(self, req: Request, reason: str, **extra: Any) -> None:
        if not req.done:
            req.done = True
            self._send(req, TokenEvent(-1, b"", finish_reason=reason, **extra))

    def _fail(self, req: Request, exc: BaseException) -> None:
        if not req.done:
            req.done = True
            self._send(req, exc)

    # ---------------------------------------------------------------- the loop
    def _admit(self) -> list[Request]:
        """Take waiting requests into free slots (caller holds ``cv``); FIFO, and a lone request blocks the rest."""
        if any(r.cancel.is_set() for r in self.waiting):
            for req in [r for r in self.waiting if r.cancel.is_set()]:
                self._finish(req, "cancelled")
            self.waiting = collections.deque(r for r in self.waiting if not r.cancel.is_set())
        taken: list[Request] = []
        if self.paused or any(r.alone for r in [*self.rows, *self.pending]):
            return taken
        while self.waiting and len(self.rows) + len(self.pending) + len(taken) < self.parallel:
            req = self.waiting[0]
            if req.exclusive or self.batchable is not True or self.parallel == 1:
                if self.rows or self.pending or taken:
                    break
                req.alone = True
            self.waiting.popleft()
            taken.append(req)
            self.stats["requests"] += 1
            if req.alone:
                break
        self.pending.extend(taken)  # busy now; their cache joins the batch after prefill
        return taken

    def _loop(self) -> None:
        torch = self.torch
        while True:
            with self.cv:
                while self.running and not self.rows and not (self.waiting and not self.paused):
                    self.cv.wait(0.5)
                    if self.waiting and self.paused:
                        self._admit()  # only drops cancelled waiters while paused
                        self._flush()
                if not self.running:
                    return
                taken = self._admit()
            try:
                with torch.inference_mode():
                    for req in taken:
                        try:
                            self._prefill(req)
                        except Exception as exc:  # this prompt failed (nothing joined the batch): only it ends
                            log.exception("transformers prefill failed")
                            self._remove([(req, exc)])
                    if self.rows:
                        self._decode()
            except Exception as exc:  # keep the scheduler alive; fail only the requests in flight
                log.exception("transformers step failed")
                with self.cv:
                    for req in [*self.pending, *self.rows]:
                        self._fail(req, RuntimeError(f"generation failed: {exc}"))
                    self.pending.clear()
                    self.rows.clear()
                    self.batch = Batch(torch)
                    self.cv.notify_all()
            finally:
                self._flush()

    def _prefill(self, req: Request) -> None:
        torch = self.torch
        backend = self.backend
        if req.cancel.is_set():
            self._remove([(req, TokenEvent(-1, b"", finish_reason="cancelled"))])
            return
        from transformers import DynamicCache

        device = backend._device
        inputs: dict[str, Any] = {
            "input_ids": torch.tensor([req.prompt], dtype=torch.long, device=device),
            **{k: v.to(device) if hasattr(v, "to") else v for k, v in req.model_inputs.items()},
        }
        if not req.exclusive and backend._logits_to_keep:
            inputs["logits_to_keep"] = 1
        req.history = torch.tensor([req.prompt], dtype=torch.long)
        with self.forward_lock:
            out = backend._require()(**inputs, past_key_values=DynamicCache(), use_cache=True)
        self.stats["steps"] += 1
        req.length = len(req.prompt)
        if self.batchable is None:
            self.batchable = batchable_cache(out.past_key_values)
            log.info("transformers: %s", "continuous batching" if self.batchable else "one sequence at a time")
        if self.batchable and not req.exclusive and self.parallel > 1:
            req.alone = False
        final = self._emit(req, out.logits[:, -1, :].float().cpu()[:, : backend._n_vocab])
        if final is not None:
            self._remove([(req, final)])
            return
        with self.cv:
            self.batch.join(out.past_key_values, req.length)
            self.pending.remove(req)
            self.rows.append(req)  # rows are in the batch's order

    def _decode(self) -> None:
        torch = self.torch
        backend = self.backend
        cancelled = [(r, TokenEvent(-1, b"", finish_reason="cancelled")) for r in self.rows if r.cancel.is_set()]
        if cancelled:
            self._remove(cancelled)
        rows = list(self.rows)
        if not rows:
            return
        device = backend._device
        ids = torch.tensor([[r.next_token] for r in rows], dtype=torch.long, device=device)
        mask = torch.cat([self.batch.mask, torch.ones((len(rows), 1), dtype=torch.long)], dim=1)
        with self.forward_lock:
            model = backend._require()
            if len(rows) == 1 and not self.batch.padded():  # one sequence: exactly the plain call
                out = model(input_ids=ids, past_key_values=self.batch.cache, use_cache=True)
            else:
                positions = torch.tensor([[r.length] for r in rows], dtype=torch.long, device=device)
                out = model(
                    input_ids=ids,
                    attention_mask=mask.to(device),
                    position_ids=positions,
                    past_key_values=self.batch.cache,
                    use_cache=True,
                )
        self.stats["steps"] += 1
        self.batch.mask = mask
        self.batch.cache = out.past_key_values
        logits = out.logits[:, -1, :].float().cpu()[:, : backend._n_vocab]
        finished = []
        for i, req in enumerate(rows):
            req.length += 1
            final = self._emit(req, logits[i : i + 1].clone())
            if final is not None:
                finished.append((req, final))
        if finished:
            self._remove(finished)

    def _remove(self, ended: Sequence[tuple[Request, TokenEvent | BaseException]]) -> None:
        """Take requests out of the batch and free their slots, then send each its last event."""
        gone = {id(req) for req, _ in ended}
        with self.cv:
            keep = [i for i, r in enumerate(self.rows) if id(r) not in gone]
            if len(keep) != len(self.rows):
                self.batch.keep(keep)
                self.rows = [self.rows[i] for i in keep]
            self.pending = [r for r in self.pending if id(r) not in gone]
            for req, final in ended:
                if isinstance(final, BaseException):
                    self._fail(req, final)
                elif not req.done:
                    req.done = True
                    self._send(req, final)
            self.cv.notify_all()

    def _emit(self, req: Request, scores: Any) -> TokenEvent | BaseException | None:
        """Sample the row's next token; send it and return None, or return the request's last event."""
        backend = self.backend
        params = req.params
        try:
            if req.matcher is not None:
                req.matcher.mask(scores)
            scores = sampling.apply(req.chain, req.history, scores)
            token = sampling.sample(scores, params.greedy, req.generator)
            want = params.logprobs or params.top_logprobs > 0
            logprob, tops = sampling.top_logprobs(scores, token, params.top_logprobs) if want else (None, [])
            top_list = [TopLogprob(t, backend.token_piece(t, special=True), lp) for t, lp in tops] if want else None
            if req.matcher is not None:
                req.matcher.accept(token)
        except Exception as exc:  # an extension's processor that broke ends this request only
            return exc
        if token in backend._eos or (req.matcher is not None and req.matcher.terminated()):
            return TokenEvent(-1, b"", logprob=logprob, top_logprobs=top_list, finish_reason="stop")
        piece = backend.token_piece(token, special=not params.skip_special_tokens)
        req.generated += 1
        if req.generated >= params.max_new_tokens:
            return TokenEvent(token, piece, logprob=logprob, top_logprobs=top_list, finish_reason="length")
        self._send(req, TokenEvent(token, piece, logprob=logprob, top_logprobs=top_list))
        req.history = self.torch.cat([req.history, self.torch.tensor([[token]])], dim=1)
        req.next_token = token
        return None
