"""ExLlamaV2 backend: EXL2 models on CUDA through exllamav2's dynamic generator, so concurrent requests batch.

A scheduler thread owns the generator: request threads only queue jobs in a pending list, and the scheduler
enqueues, cancels and iterates them (the dynamic generator is not thread-safe). Each job's results are handed
to its stream.
Without CUDA it refuses with a clear message and the server keeps running.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from modules.errors import BackendUnavailable, InvalidRequest, ModelLoadError, QueueFull
from modules.generation.params import GenerationParams
from modules.loaders import OPTIONS
from modules.loaders.base import Backend, ModelMetadata, TokenEvent, TopLogprob

log = logging.getLogger(__name__)
SUPPORTED = frozenset(
    {
        "seed", "ban_eos", "min_tokens", "temperature", "temperature_last", "dynatemp_range", "dynatemp_exponent",
        "top_k", "top_p", "min_p", "typical_p", "top_a", "tfs", "xtc_threshold", "xtc_probability",
        "repetition_penalty", "repetition_penalty_range", "presence_penalty", "frequency_penalty",
        "dry_multiplier", "dry_base", "dry_allowed_length", "dry_sequence_breakers", "mirostat_mode", "mirostat_tau",
        "mirostat_eta", "logit_bias", "logprobs", "top_logprobs",
    }
)  # fmt: skip


def require_cuda() -> Any:
    """torch, if CUDA is usable; else BackendUnavailable saying so."""
    import torch

    if not torch.cuda.is_available():
        raise BackendUnavailable(
            "ExLlamaV2 needs a CUDA GPU, and this machine has none; use llama.cpp (GGUF) or transformers"
        )
    return torch


@dataclass
class _Job:
    job: Any
    out: queue.SimpleQueue[TokenEvent | BaseException] = field(default_factory=queue.SimpleQueue)
    cancel: threading.Event = field(default_factory=threading.Event)
    generated: int = 0
    enqueued: bool = False  # handed to the generator (by the scheduler thread)


class ExLlamaV2Backend(Backend):
    """EXL2-quantized models on one or several CUDA GPUs."""

    loader_name = "exllamav2"
    supports_logprobs = True
    option_names = OPTIONS["exllamav2"]
    supported_params = SUPPORTED

    def __init__(self) -> None:
        super().__init__()
        self.model: Any = None
        self.cache: Any = None
        self.tokenizer: Any = None
        self.generator: Any = None
        self._jobs: dict[Any, _Job] = {}  # every job not yet finished, pending or enqueued
        self._pending: list[_Job] = []  # jobs the scheduler has yet to enqueue
        self._breakers: dict[tuple[str, ...], set[int]] = {}
        self._cv = threading.Condition()
        self._running = False
        self._thread: threading.Thread | None = None
        self._context = 4096
        self._max_queue = 64

    @classmethod
    def load(cls, path: Path, options: dict[str, Any]) -> ExLlamaV2Backend:
        """Load an EXL2 folder: config, model (auto-split or --gpu-split), cache (FP16, 8-bit or Q4), tokenizer."""
        require_cuda()
        try:
            from exllamav2 import (
                ExLlamaV2,
                ExLlamaV2Cache,
                ExLlamaV2Cache_8bit,
                ExLlamaV2Cache_Q4,
                ExLlamaV2Config,
                ExLlamaV2Tokenizer,
            )
            from exllamav2.generator import ExLlamaV2DynamicGenerator
        except ImportError as exc:
            raise BackendUnavailable(
                f"the exllamav2 package is missing or broken ({exc}): pip install exllamav2"
            ) from exc

        self = cls()
        self.path = path
        try:
            config = ExLlamaV2Config(str(path))
            config.prepare()
            if options.get("max_seq_len"):
                config.max_seq_len = int(options["max_seq_len"])
            self._context = int(config.max_seq_len)
            self.model = ExLlamaV2(config)
            cache_cls = (
                ExLlamaV2Cache_Q4
                if options.get("cache_q4")
                else ExLlamaV2Cache_8bit
                if options.get("cache_8bit")
                else ExLlamaV2Cache
            )
            if options.get("gpu_split"):
                split = [float(x) for x in str(options["gpu_split"]).split(",") if x.strip()]
                self.model.load(split)
                self.cache = cache_cls(self.model, max_seq_len=self._context)
            else:
                self.cache = cache_cls(self.model, max_seq_len=self._context, lazy=True)
                self.model.load_autosplit(self.cache)
            self.tokenizer = ExLlamaV2Tokenizer(config)
            self.generator = ExLlamaV2DynamicGenerator(
                model=self.model,
                cache=self.cache,
                tokenizer=self.tokenizer,
                max_batch_size=int(options.get("parallel") or 4),
            )
        except (ValueError, OSError, RuntimeError) as exc:
            raise ModelLoadError(f"ExLlamaV2 could not load {path.name}: {exc}") from exc
        self.max_parallel = int(options.get("parallel") or 4)
        max_queue = options.get("max_queue")
        self._max_queue = 64 if max_queue is None else int(max_queue)
        tok = self.tokenizer
        self.metadata = ModelMetadata(
            name=path.name,
            architecture="exl2",
            context_length=self._context,
            bos_token=tok.bos_token or "",
            eos_token=tok.eos_token or "",
            bos_token_id=tok.bos_token_id,
            eos_token_ids=[tok.eos_token_id] if tok.eos_token_id is not None else [],
            extra={"n_vocab": tok.get_vocab_size()},
        )
        self._running = True
        self._thread = threading.Thread(target=self._loop, name="exllamav2-scheduler", daemon=True)
        self._thread.start()
        return self

    def unload(self) -> None:
        """Stop the scheduler and free the GPU memory."""
        with self._cv:
            self._running = False
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=30)
        for job in self._jobs.values():
            job.out.put(TokenEvent(-1, b"", finish_reason="cancelled"))
        self._jobs.clear()
        self._pending.clear()
        if self.model is not None:
            self.model.unload()
        self.model = self.cache = self.generator = None
        import torch

        torch.cuda.empty_cache()

    @property
    def context_length(self) -> int:
        return self._context

    def encode(self, text: str, add_special: bool = True) -> list[int]:
        ids = self.tokenizer.encode(text, add_bos=add_special, encode_special_tokens=True)
        return [int(t) for t in ids[0].tolist()]

    def decode(self, ids: list[int]) -> str:
        import torch

        return str(self.tokenizer.decode(torch.tensor([ids]), decode_special_tokens=True)[0])

    def token_piece(self, token_id: int, special: bool = False) -> bytes:
        pieces = self.tokenizer.get_id_to_piece_list(special)
        return str(pieces[token_id]).encode("utf-8") if 0 <= token_id < len(pieces) else b""

    def _settings(self, params: GenerationParams) -> Any:
        from exllamav2.generator import ExLlamaV2Sampler

        s = ExLlamaV2Sampler.Settings()
        s.temperature = params.temperature if not params.greedy else 1.0
        s.top_k = 1 if params.greedy else params.top_k
        s.top_p, s.min_p, s.typical, s.top_a, s.tfs = (
            params.top_p,
            params.min_p,
            params.typical_p,
            params.top_a,
            params.tfs,
        )
        s.token_repetition_penalty = params.repetition_penalty
        s.token_repetition_range = params.repetition_penalty_range or -1
        s.token_presence_penalty, s.token_frequency_penalty = params.presence_penalty, params.frequency_penalty
        s.temperature_last = params.temperature_last
        if params.dynatemp_range > 0:
            s.min_temp, s.max_temp = (
                max(0.0, params.temperature - params.dynatemp_range),
                params.temperature + params.dynatemp_range,
            )
            s.temp_exponent = params.dynatemp_exponent
        if params.mirostat_mode == 1:  # exllamav2's mirostat truncates by surprise against mu: that is v2
            raise InvalidRequest(
                "ExLlamaV2 implements Mirostat 2 only: use mirostat_mode 2, or llama.cpp or transformers for mode 1",
                param="mirostat_mode",
            )
        s.mirostat, s.mirostat_tau, s.mirostat_eta = params.mirostat_mode > 0, params.mirostat_tau, params.mirostat_eta
        s.xtc_probability, s.xtc_threshold = params.xtc_probability, params.xtc_threshold
        s.dry_multiplier, s.dry_base, s.dry_allowed_length = (
            params.dry_multiplier,
            params.dry_base,
            params.dry_allowed_length,
        )
        if params.dry_multiplier > 0:
            s.dry_sequence_breakers = self._breaker_ids(params.dry_sequence_breakers)
        if params.logit_bias:  # exllamav2 reads token_bias, sized like its own disallow_tokens() makes it
            import torch

            vocab = int(self.tokenizer.config.vocab_size)
            bias = torch.zeros((vocab + (-vocab % 32),), dtype=torch.float)
            for token, value in params.logit_bias.items():
                if 0 <= token < vocab:
                    bias[token] = float("-inf") if value <= -100 else value
            s.token_bias = bias
        if params.ban_eos:
            s.disallow_tokens(self.tokenizer, [self.tokenizer.eos_token_id])
        return s

    def _breaker_ids(self, breakers: list[str]) -> set[int]:
        """Token ids whose text contains a DRY sequence breaker (exllamav2 takes ids, not strings)."""
        key = tuple(breakers)
        if key not in self._breakers:
            pieces = self.tokenizer.get_id_to_piece_list(True)
            self._breakers[key] = {i for i, piece in enumerate(pieces) if any(b and b in piece for b in breakers)}
        return self._breakers[key]

    def generate(
        self,
        prompt_ids: list[int],
        params: GenerationParams,
        cancel: threading.Event,
        extra: dict[str, Any] | None = None,
    ) -> Iterator[TokenEvent]:
        """Enqueue a dynamic-generator job; its results stream as token events."""
        import torch
        from exllamav2.generator import ExLlamaV2DynamicJob

        if self.generator is None:
            raise ModelLoadError("the model has been unloaded")
        if not prompt_ids:
            raise InvalidRequest("the prompt is empty", param="prompt")
        job = ExLlamaV2DynamicJob(
            input_ids=torch.tensor([prompt_ids]),
            max_new_tokens=params.max_new_tokens,
            min_new_tokens=params.min_tokens,
            gen_settings=self._settings(params),
            stop_conditions=[] if params.ban_eos else [self.tokenizer.eos_token_id],
            seed=params.resolved_seed(),
            return_top_tokens=params.top_logprobs,
            return_probs=params.logprobs or params.top_logprobs > 0,
        )
        entry = _Job(job=job, cancel=cancel)
        with self._cv:
            if not self._running:
                raise ModelLoadError("the model has been unloaded")
            if len(self._jobs) >= self.max_parallel + self._max_queue:
                raise QueueFull()
            self._jobs[job] = entry
            self._pending.append(entry)  # the scheduler enqueues it: the generator is not thread-safe
            self._cv.notify_all()
        return self._stream(entry)

    def _stream(self, entry: _Job) -> Iterator[TokenEvent]:
        try:
            while True:
                item = entry.out.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finish_reason:
                    return
        finally:
            entry.cancel.set()

    def _loop(self) -> None:
        while True:
            with self._cv:
                while self._running and not self._jobs:
                    self._cv.wait()
                if not self._running:
                    return
                # only this thread touches the generator: new jobs go in, cancelled ones out, between iterations
                for entry in [e for e in self._jobs.values() if e.cancel.is_set()]:
                    if entry.enqueued:
                        self.generator.cancel(entry.job)
                    self._jobs.pop(entry.job, None)
                    entry.out.put(TokenEvent(-1, b"", finish_reason="cancelled"))
                pending, self._pending = self._pending, []
                for entry in pending:
                    if entry.job not in self._jobs:
                        continue
                    try:
                        self.generator.enqueue(entry.job)
                        entry.enqueued = True
                    except Exception as exc:  # e.g. a job the cache cannot hold: fail that one only
                        self._jobs.pop(entry.job, None)
                        entry.out.put(RuntimeError(f"ExLlamaV2 refused the job: {exc}"))
                if not self._jobs:
                    continue
            try:
                results = self.generator.iterate()
            except Exception as exc:  # fail the jobs in flight, keep serving
                log.exception("ExLlamaV2 step failed")
                with self._cv:
                    for entry in self._jobs.values():
                        if entry.enqueued:
                            with contextlib.suppress(Exception):
                                self.generator.cancel(entry.job)
                        entry.out.put(RuntimeError(f"generation failed: {exc}"))
                    self._jobs.clear()
                    self._pending.clear()
                continue
            for result in results:
                self._deliver(result)

    def _deliver(self, result: dict[str, Any]) -> None:
        entry = self._jobs.get(result.get("job"))
        if entry is None or result.get("stage") != "streaming":
            return
        ids = result.get("token_ids")
        tokens = [int(t) for t in ids[0].tolist()] if ids is not None else []
        probs = result.get("token_probs")
        for i, token in enumerate(tokens):
            logprob = None
            if probs is not None:
                import math

                logprob = math.log(max(float(probs[0, i]), 1e-30))
            entry.generated += 1
            top = None
            if result.get("top_k_tokens") is not None:
                import math

                top = [
                    TopLogprob(int(t), self.token_piece(int(t), True), math.log(max(float(p), 1e-30)))
                    for t, p in zip(
                        result["top_k_tokens"][0, i].tolist(), result["top_k_probs"][0, i].tolist(), strict=True
                    )
                ]
            entry.out.put(TokenEvent(token, self.token_piece(token), logprob=logprob, top_logprobs=top))
        if result.get("eos"):
            reason = "length" if result.get("eos_reason") == "max_new_tokens" else "stop"
            with self._cv:
                self._jobs.pop(entry.job, None)
            entry.out.put(TokenEvent(-1, b"", finish_reason=reason))

    def stats(self) -> dict[str, Any]:
        with self._cv:
            busy = min(len(self._jobs), self.max_parallel)
            return {"slots": self.max_parallel, "busy_slots": busy, "queue_depth": len(self._jobs) - busy}
