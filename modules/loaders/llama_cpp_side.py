"""One-sequence llama.cpp contexts beside the scheduler's: mean-pooled embeddings and prompt scoring."""

from __future__ import annotations

import ctypes
import math
import threading
from typing import Any

import llama_cpp
import numpy as np
from llama_cpp._internals import LlamaBatch, LlamaContext, LlamaModel

from modules.errors import InvalidRequest


class SideContext:
    """A lazily created context with its own lock; LoRA adapters follow the main context's."""

    def __init__(self, model: LlamaModel, n_ctx: int, n_batch: int, threads: int, embeddings: bool) -> None:
        self.model, self.n_ctx, self.n_batch, self.threads, self.embeddings = (
            model,
            n_ctx,
            min(n_batch, n_ctx),
            threads,
            embeddings,
        )
        self.lock = threading.Lock()
        self._ctx: LlamaContext | None = None
        self._adapters: list[tuple[Any, float]] = []

    def context(self) -> LlamaContext:
        """The context (created on first use)."""
        if self._ctx is None:
            params = llama_cpp.llama_context_default_params()
            params.n_ctx, params.n_seq_max = self.n_ctx, 1
            params.n_batch = params.n_ubatch = self.n_ctx if self.embeddings else self.n_batch
            params.n_threads = params.n_threads_batch = self.threads
            params.no_perf = True
            if self.embeddings:
                params.embeddings = True
                params.pooling_type = llama_cpp.LLAMA_POOLING_TYPE_MEAN
            self._ctx = LlamaContext(model=self.model, params=params, verbose=False)
            self._set_adapters()
        return self._ctx

    def _set_adapters(self) -> None:
        if self._ctx is None:
            return
        items = self._adapters
        adapters = (llama_cpp.llama_adapter_lora_p_ctypes * len(items))(*[a for a, _ in items]) if items else None
        scales = (ctypes.c_float * len(items))(*[s for _, s in items]) if items else None
        llama_cpp.llama_set_adapters_lora(self._ctx.ctx, adapters, len(items), scales)

    def set_adapters(self, adapters: list[tuple[Any, float]]) -> None:
        """Use these LoRA adapters (with scales) from now on."""
        with self.lock:
            self._adapters = list(adapters)
            self._set_adapters()

    def close(self) -> None:
        """Free the context."""
        with self.lock:
            if self._ctx is not None:
                self._ctx.close()
                self._ctx = None

    def embed(self, token_lists: list[list[int]]) -> list[list[float]]:
        """One mean-pooled, L2-normalised vector per token list."""
        with self.lock:
            ctx = self.context()
            batch = LlamaBatch(n_tokens=self.n_ctx, embd=0, n_seq_max=1, verbose=False)
            vectors = []
            try:
                for i, tokens in enumerate(token_lists):
                    if len(tokens) > self.n_ctx:  # never cut silently
                        raise InvalidRequest(
                            f"input[{i}] has {len(tokens)} tokens; at most {self.n_ctx} fit", param="input"
                        )
                    ctx.kv_cache_clear()
                    batch.reset()
                    batch.add_sequence(tokens, 0, logits_all=True)
                    if llama_cpp.llama_decode(ctx.ctx, batch.batch) != 0:
                        raise RuntimeError("llama_decode failed while embedding")
                    pointer = llama_cpp.llama_get_embeddings_seq(ctx.ctx, 0)
                    vector = np.ctypeslib.as_array(pointer, shape=(self.model.n_embd(),)).astype(np.float64)
                    vectors.append((vector / (float(np.linalg.norm(vector)) or 1.0)).tolist())
            finally:
                batch.close()
            return vectors

    def log_softmax_rows(self, prompt_ids: list[int], rows: set[int], n_vocab: int) -> dict[int, np.ndarray]:
        """Log-probability rows (the next-token distribution) at some positions of the prompt."""
        out: dict[int, np.ndarray] = {}
        with self.lock:
            ctx = self.context()
            ctx.kv_cache_clear()
            holder = LlamaBatch(n_tokens=self.n_batch, embd=0, n_seq_max=1, verbose=False)
            try:
                batch = holder.batch
                for start in range(0, len(prompt_ids), self.n_batch):
                    chunk = prompt_ids[start : start + self.n_batch]
                    for j, token in enumerate(chunk):
                        batch.token[j], batch.pos[j], batch.n_seq_id[j] = token, start + j, 1
                        batch.seq_id[j][0], batch.logits[j] = 0, (start + j) in rows
                    batch.n_tokens = len(chunk)
                    if llama_cpp.llama_decode(ctx.ctx, batch) != 0:
                        raise RuntimeError("llama_decode failed while scoring")
                    for j in range(len(chunk)):
                        if start + j in rows:
                            logits = llama_cpp.llama_get_logits_ith(ctx.ctx, j)
                            row = np.ctypeslib.as_array(logits, shape=(n_vocab,)).astype(np.float64)
                            top = float(row.max())
                            out[start + j] = row - (top + math.log(float(np.exp(row - top).sum())))
            finally:
                holder.close()
        return out
