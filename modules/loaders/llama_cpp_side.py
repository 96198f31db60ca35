"""One-sequence llama.cpp contexts beside the scheduler's (mean-pooled embeddings and prompt scoring), and the
backend's methods that use them or change its LoRA adapters.

Every ``llama_decode`` of a model runs on its scheduler thread, side contexts' too (``SideOps._on_scheduler``):
llama.cpp computes with an OpenMP team per calling thread, and once a second long-lived thread owns a team, libgomp
counts more threads than cores and stops spinning at barriers for every team, so generation ran at a third of its
speed for the rest of the process (measured: 105 -> 32 tokens/s after one embeddings call from a worker thread).
"""

from __future__ import annotations

import ctypes
import functools
import math
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar, cast

import llama_cpp
import numpy as np
from llama_cpp._internals import LlamaBatch, LlamaContext, LlamaModel

from modules.errors import InvalidRequest, ModelLoadError
from modules.loaders import llama_cpp_lora

if TYPE_CHECKING:
    from modules.loaders.llama_cpp import LlamaCppBackend

T = TypeVar("T")
Run = Callable[[Callable[[], Any]], Any]  # runs a function on the scheduler thread and returns its result


@dataclass
class Task:
    """A function the scheduler thread runs between steps, with its outcome for the waiting caller."""

    run: Callable[[], Any]
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None
    result: Any = None


def default_threads() -> int:
    """Physical cores (llama.cpp gains nothing from hyper-threads)."""
    try:
        import psutil

        return max(1, psutil.cpu_count(logical=False) or os.cpu_count() or 1)
    except ImportError:
        return max(1, os.cpu_count() or 1)


class SideContext:
    """A lazily created context; its work runs through ``run`` (on the scheduler thread), one decode per call, so
    generation steps go on between them. LoRA adapters follow the main context's."""

    def __init__(
        self,
        model: LlamaModel,
        n_ctx: int,
        n_batch: int,
        threads: int,
        embeddings: bool,
        flash_attn: int = -1,
        run: Run = lambda fn: fn(),
        budget: Callable[[], int] | None = None,
    ) -> None:
        self.model, self.n_ctx, self.n_batch, self.threads, self.embeddings = (
            model,
            n_ctx,
            min(n_batch, n_ctx),
            threads,
            embeddings,
        )
        self.flash_attn = flash_attn  # as the main context's, so scores match what generation samples from
        self.run = run
        # tokens one decode of this context may take, asked on the scheduler thread before each: fewer while
        # generation goes on (as a prompt's prefill), so other streams keep their pace
        self.budget = budget or (lambda: self.n_batch)
        self.lock = threading.Lock()  # one scoring call at a time (its chunks share the context's cache)
        self.version = 0  # bumped when the adapters change, so a scoring call that spans a change starts again
        self._ctx: LlamaContext | None = None
        self._batch: LlamaBatch | None = None
        self._adapters: list[tuple[Any, float]] = []
        self.causal = True  # until the context says otherwise (embeddings: chunked, averaged here)

    def context(self) -> tuple[LlamaContext, LlamaBatch]:
        """The context and its batch (created on first use, on the scheduler thread).

        Embeddings of a causal model (what llama.cpp's context says) are read per token, ``n_batch`` tokens per
        decode, and averaged here: each chunk is a scheduler task of its own, so a long input does not hold up
        generation. A model with bidirectional attention (BERT-like) needs the whole input in one ubatch, where
        llama.cpp pools it."""
        if self._ctx is None:
            self._ctx = self._new_context(one_ubatch=False)
            if self.embeddings and not llama_cpp.llama_get_causal_attn(self._ctx.ctx):
                self._ctx.close()
                self._ctx = self._new_context(one_ubatch=True)
                self.causal = False
            self._set_adapters()
        if self._batch is None:
            size = self.n_batch if self.causal else self.n_ctx
            self._batch = LlamaBatch(n_tokens=size, embd=0, n_seq_max=1, verbose=False)
        return self._ctx, self._batch

    def _new_context(self, one_ubatch: bool) -> LlamaContext:
        params = llama_cpp.llama_context_default_params()
        params.n_ctx, params.n_seq_max = self.n_ctx, 1
        params.n_batch = params.n_ubatch = self.n_ctx if one_ubatch else self.n_batch
        params.n_threads = params.n_threads_batch = self.threads
        params.no_perf = True
        params.flash_attn_type = self.flash_attn
        if self.embeddings:
            params.embeddings = True
            params.pooling_type = llama_cpp.LLAMA_POOLING_TYPE_MEAN if one_ubatch else llama_cpp.LLAMA_POOLING_TYPE_NONE
        return LlamaContext(model=self.model, params=params, verbose=False)

    def _set_adapters(self) -> None:
        if self._ctx is None:
            return
        items = self._adapters
        adapters = (llama_cpp.llama_adapter_lora_p_ctypes * len(items))(*[a for a, _ in items]) if items else None
        scales = (ctypes.c_float * len(items))(*[s for _, s in items]) if items else None
        llama_cpp.llama_set_adapters_lora(self._ctx.ctx, adapters, len(items), scales)

    def set_adapters(self, adapters: list[tuple[Any, float]]) -> None:
        """Use these LoRA adapters (with scales) from now on (scheduler thread, or before the context exists)."""
        self._adapters = list(adapters)
        self.version += 1
        self._set_adapters()

    def close(self) -> None:
        """Free the context (once the scheduler has stopped)."""
        for obj in (self._batch, self._ctx):
            if obj is not None:
                obj.close()
        self._batch = self._ctx = None

    def embed(self, token_lists: list[list[int]]) -> list[list[float]]:
        """One mean-pooled, L2-normalised vector per token list."""
        for i, tokens in enumerate(token_lists):
            if len(tokens) > self.n_ctx:  # never cut silently
                raise InvalidRequest(f"input[{i}] has {len(tokens)} tokens; at most {self.n_ctx} fit", param="input")
        with self.lock:  # one call at a time: a causal input's chunks share the context's cache
            self.run(self.context)
            return [self._embed(tokens) for tokens in token_lists]

    def _embed(self, tokens: list[int]) -> list[float]:
        if not self.causal:
            vector = cast("np.ndarray", self.run(functools.partial(self._embed_pooled, tokens)))
        else:
            while True:  # adapters changed between chunks: start again, so one set made the whole vector
                version = self.version
                vector = np.zeros(self.model.n_embd(), dtype=np.float64)
                start = 0
                while start < len(tokens):
                    part, fed = self.run(functools.partial(self._embed_chunk, start, tokens))
                    vector += part
                    start += fed
                if version == self.version:
                    break
            vector /= len(tokens)  # the mean over the tokens, as llama.cpp's MEAN pooling
        return cast("list[float]", (vector / (float(np.linalg.norm(vector)) or 1.0)).tolist())

    def _embed_chunk(self, start: int, tokens: list[int]) -> tuple[np.ndarray, int]:
        """Decode the next chunk of ``tokens`` from ``start`` (after the ones before it): the sum of its tokens'
        embeddings, and how many it took."""
        ctx, chunk = self._decode_chunk(start, tokens, lambda _: True, "embedding")
        rows = np.ctypeslib.as_array(llama_cpp.llama_get_embeddings(ctx.ctx), shape=(len(chunk), self.model.n_embd()))
        return rows.sum(axis=0, dtype=np.float64), len(chunk)

    def _embed_pooled(self, tokens: list[int]) -> np.ndarray:
        """The whole input in one ubatch, pooled by llama.cpp (bidirectional attention)."""
        ctx, batch = self.context()
        ctx.kv_cache_clear()
        batch.reset()
        batch.add_sequence(tokens, 0, logits_all=True)
        if llama_cpp.llama_decode(ctx.ctx, batch.batch) != 0:
            raise RuntimeError("llama_decode failed while embedding")
        pointer = llama_cpp.llama_get_embeddings_seq(ctx.ctx, 0)
        return np.ctypeslib.as_array(pointer, shape=(self.model.n_embd(),)).astype(np.float64)

    def log_softmax_rows(self, prompt_ids: list[int], rows: set[int], n_vocab: int) -> dict[int, np.ndarray]:
        """Log-probability rows (the next-token distribution) at some positions of the prompt."""
        with self.lock:
            while True:
                version = self.version
                out: dict[int, np.ndarray] = {}
                start = 0
                while start < len(prompt_ids):
                    part, fed = self.run(functools.partial(self._score_chunk, start, prompt_ids, rows, n_vocab))
                    out.update(part)
                    start += fed
                if version == self.version:
                    return out

    def _decode_chunk(
        self, start: int, tokens: list[int], output: Callable[[int], bool], what: str
    ) -> tuple[LlamaContext, list[int]]:
        """Decode the next chunk of ``tokens`` from ``start`` (as many as the budget allows now; the cache is
        emptied at the first), with outputs where ``output(position)``; the context and the chunk."""
        ctx, holder = self.context()
        if start == 0:
            ctx.kv_cache_clear()
        chunk = tokens[start : start + max(1, min(self.n_batch, self.budget()))]
        batch = holder.batch
        for j, token in enumerate(chunk):
            batch.token[j], batch.pos[j], batch.n_seq_id[j] = token, start + j, 1
            batch.seq_id[j][0], batch.logits[j] = 0, output(start + j)
        batch.n_tokens = len(chunk)
        if llama_cpp.llama_decode(ctx.ctx, batch) != 0:
            raise RuntimeError(f"llama_decode failed while {what}")
        return ctx, chunk

    def _score_chunk(
        self, start: int, tokens: list[int], rows: set[int], n_vocab: int
    ) -> tuple[dict[int, np.ndarray], int]:
        ctx, chunk = self._decode_chunk(start, tokens, rows.__contains__, "scoring")
        out: dict[int, np.ndarray] = {}
        for j in range(len(chunk)):
            if start + j in rows:
                row = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx.ctx, j), shape=(n_vocab,))
                row = row.astype(np.float64)
                top = float(row.max())
                out[start + j] = row - (top + math.log(float(np.exp(row - top).sum())))
        return out, len(chunk)


class SideOps:
    """The llama.cpp backend's embeddings, scoring and LoRA methods (mixed into LlamaCppBackend)."""

    _n_ctx: int
    _n_batch: int
    _n_vocab: int
    _flash_attn: int
    _ctx: Any
    _cv: threading.Condition
    _running: bool
    _thread: threading.Thread | None
    _tasks: list[Task]
    _options: dict[str, Any]
    _sides: dict[str, SideContext]
    _loras: dict[str, tuple[Any, float]]

    if TYPE_CHECKING:

        def encode(self, text: str, add_special: bool = True) -> list[int]: ...

        def _require_model(self) -> LlamaModel: ...

        def _side_budget(self) -> int: ...

    def embed(self, texts: list[str]) -> list[list[float]]:
        """Mean-pooled, L2-normalised embeddings from a second context in embeddings mode."""
        token_lists = [self.encode(t) for t in texts]
        for i, tokens in enumerate(token_lists):
            if not tokens:
                raise InvalidRequest(f"input[{i}] is empty; cannot embed an empty string", param="input")
            if len(tokens) > self._n_ctx:
                raise InvalidRequest(
                    f"input[{i}] has {len(tokens)} tokens; this model embeds at most {self._n_ctx} "
                    "(its context). Shorten or split the input.",
                    param="input",
                    code="context_length_exceeded",
                )
        return self._side(embeddings=True).embed(token_lists)

    def _side(self, embeddings: bool) -> SideContext:
        model = self._require_model()
        with self._cv:
            key = "embed" if embeddings else "score"
            if key not in self._sides:
                threads = int(self._options.get("threads") or default_threads())
                side = SideContext(
                    model,
                    self._n_ctx,
                    self._n_batch,
                    threads,
                    embeddings,
                    self._flash_attn,
                    self._on_scheduler,
                    self._side_budget,
                )
                side.set_adapters(list(self._loras.values()))
                self._sides[key] = side
            return self._sides[key]

    def _on_scheduler(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the scheduler thread between two steps, wait for it, and return its result (or raise what
        it raised). On the scheduler thread itself, just call it."""
        if threading.current_thread() is self._thread:
            return fn()
        task = Task(fn)
        with self._cv:
            if not self._running or self._thread is None or not self._thread.is_alive():
                raise ModelLoadError("the model has been unloaded")
            self._tasks.append(task)
            self._cv.notify_all()
        while not task.done.wait(0.5):
            if self._thread is None or not self._thread.is_alive():
                if task.done.is_set():
                    break
                if not self._running:
                    raise ModelLoadError("the model has been unloaded")
                raise RuntimeError("the llama.cpp scheduler stopped")
        if task.error is not None:
            raise task.error
        return cast(T, task.result)

    def fim_tokens(self) -> tuple[int, int, int] | None:
        vocab = self._require_model().vocab
        ids = (
            llama_cpp.llama_vocab_fim_pre(vocab),
            llama_cpp.llama_vocab_fim_suf(vocab),
            llama_cpp.llama_vocab_fim_mid(vocab),
        )
        return None if any(t < 0 for t in ids) else ids

    def _log_softmax_rows(self, prompt_ids: list[int], rows: set[int]) -> dict[int, np.ndarray]:
        if len(prompt_ids) > self._n_ctx:
            raise InvalidRequest(
                f"the prompt has {len(prompt_ids)} tokens; the context holds {self._n_ctx}", param="prompt"
            )
        return self._side(embeddings=False).log_softmax_rows(prompt_ids, rows, self._n_vocab)

    def score(self, prompt_ids: list[int], top: int = 0) -> list[tuple[float | None, list[tuple[int, float]]]]:
        rows = self._log_softmax_rows(prompt_ids, set(range(len(prompt_ids) - 1)))
        result: list[tuple[float | None, list[tuple[int, float]]]] = [(None, [])]
        for pos in range(len(prompt_ids) - 1):
            row = rows[pos]
            alternatives = [(int(t), float(row[t])) for t in np.argsort(-row)[:top]] if top else []
            result.append((float(row[prompt_ids[pos + 1]]), alternatives))
        return result

    def next_token_logprobs(self, prompt_ids: list[int], top: int) -> list[tuple[int, float]]:
        if not prompt_ids:
            raise InvalidRequest("the prompt is empty", param="prompt")
        last = len(prompt_ids) - 1
        row = self._log_softmax_rows(prompt_ids, {last})[last]
        return [(int(t), float(row[t])) for t in np.argsort(-row)[:top]]

    def set_loras(self, adapters: list[tuple[Path, float]]) -> None:
        """Replace every adapter with these at once; refused while generations run, and then nothing changes."""
        llama_cpp_lora.set_adapters(cast("LlamaCppBackend", self), adapters)

    def load_lora(self, path: Path, scale: float = 1.0) -> None:
        """Apply a GGUF LoRA adapter on top of the ones applied (refused while generations run)."""
        path = llama_cpp_lora.adapter_file(path, scale)
        kept = [(Path(k), s) for k, (_, s) in self._loras.items() if Path(k) != path]
        self.set_loras([*kept, (path, scale)])

    def unload_lora(self, path: Path | None = None) -> None:
        """Remove one adapter (or all); refused while generations run."""
        if self._ctx is None:
            return
        kept = [
            (Path(k), s)
            for k, (_, s) in self._loras.items()
            if path is not None and path not in (Path(k), Path(k).parent)
        ]
        if len(kept) != len(self._loras):
            self.set_loras(kept)
