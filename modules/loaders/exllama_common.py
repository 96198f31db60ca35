"""What the ExLlamaV2 and ExLlamaV3 backends share: the scheduler thread around a dynamic generator, cache sizing,
cache-type options and the reading of the generator's results into token events.

Both libraries' generators (``exllamav2/generator/dynamic.py`` and ``exllamav3/generator/generator.py``) have the
same shape: jobs are enqueued, ``iterate()`` advances every active job one step and returns a list of result dicts
(``stage`` "started" / "prefill" / "streaming", and in ExLlamaV3 also "error"), and ``cancel(job)`` drops one.
Neither is thread-safe, so only the scheduler thread here touches the generator: request threads queue jobs in a
pending list and read their results from a queue.

A streaming result carries ``token_ids`` and ``text``: the library holds tokens back while their text ends in an
incomplete UTF-8 character and releases them together with the whole character (``receive_sample`` in both
``job`` implementations), so the text of a result goes on its last token and the others carry no bytes. At a stop
token the library does not release what it held; it returns it under ``held``, the stop token last.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import math
import queue
import threading
from abc import abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from modules.errors import BackendUnavailable, InvalidRequest, ModelLoadError, QueueFull
from modules.generation.params import GenerationParams
from modules.loaders import precheck
from modules.loaders.base import Backend, TokenEvent, TopLogprob, drain

log = logging.getLogger(__name__)

PAGE_SIZE = 256  # both libraries page the cache in 256-token pages (PAGED_PAGE_SIZE, constants.PAGE_SIZE)
DEFAULT_CONTEXT_CAP = 4096  # as --n-ctx for the other loaders: the model's own length, capped
# Exceptions a library raises while loading: its checks are plain asserts, and a CUDA out-of-memory is a RuntimeError
LOAD_ERRORS = (AssertionError, ValueError, TypeError, KeyError, OSError, RuntimeError, ImportError, IndexError)


def require_cuda(library: str) -> Any:
    """torch, if CUDA is usable; else BackendUnavailable saying so."""
    import torch

    if not torch.cuda.is_available():
        raise BackendUnavailable(
            f"{library} needs a CUDA GPU, and this machine has none; use llama.cpp (GGUF) or transformers"
        )
    return torch


def context_tokens(model_max: int, asked: int | None) -> int:
    """Tokens one sequence may hold: ``asked`` (--max-seq-len) or the model's own, capped at 4096, in whole pages.

    The cache is paged, and exllamav2's generator asserts ``cache.max_seq_len % 256 == 0``, so the length is
    rounded down to a multiple of 256 (never below one page, never above the model's trained length).
    """
    limit = max(PAGE_SIZE, int(model_max) // PAGE_SIZE * PAGE_SIZE)
    wanted = int(asked) if asked else min(int(model_max), DEFAULT_CONTEXT_CAP)
    return max(PAGE_SIZE, min(wanted, limit) // PAGE_SIZE * PAGE_SIZE)


def cache_tokens(context: int, parallel: int, asked: int | None) -> int:
    """Tokens the one shared cache holds: ``asked`` (--cache-size) or a full context for every parallel slot.

    Every job reserves cache pages for its prompt plus ``max_new_tokens`` when it starts (``prepare_for_queue`` in
    both libraries), and the pipeline caps that at one context; so with ``context * parallel`` tokens, ``parallel``
    generations of any length run at once. A smaller --cache-size saves memory: longer jobs then wait for pages.
    """
    total = int(asked) if asked else context * max(1, parallel)
    return max(context, -(-total // PAGE_SIZE) * PAGE_SIZE)


def cache_choice(options: dict[str, Any]) -> str:
    """The KV cache type asked for: --cache-type, else --cache-q4 / --cache-8bit, else fp16 (lower case)."""
    asked = str(options.get("cache_type") or "").strip().lower().replace(" ", "")
    if asked:
        return asked
    if options.get("cache_q4"):
        return "q4"
    if options.get("cache_8bit"):
        return "q8"  # the dynamic generators refuse exllamav2's FP8 cache; Q8 is the 8-bit cache they take
    return "fp16"


def eos_ids_from_files(folder: Path) -> list[int]:
    """Every end-of-sequence id that config.json and generation_config.json list (either may hold a list)."""
    found: list[int] = []
    for name in ("config.json", "generation_config.json"):
        try:
            data = json.loads((folder / name).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if not isinstance(data, dict):
            continue
        for source in (data, data.get("text_config") or {}):
            value = source.get("eos_token_id") if isinstance(source, dict) else None
            for item in value if isinstance(value, list) else [value]:
                if isinstance(item, int) and item not in found:
                    found.append(item)
    return found


@dataclass
class JobEntry:
    """One generation: the library's job, where its events go, and what the reader needs to know about it."""

    key: int
    job: Any
    max_new_tokens: int
    asked_tokens: int  # what the caller asked for; more than max_new_tokens when the context capped it
    special: bool  # decode special tokens into the text
    greedy: bool
    out: queue.SimpleQueue[TokenEvent | BaseException] = field(default_factory=queue.SimpleQueue)
    cancel: threading.Event = field(default_factory=threading.Event)
    generated: int = 0
    enqueued: bool = False  # handed to the generator (by the scheduler thread)


class ExllamaBackend(Backend):
    """A backend over an ExLlama-style dynamic generator; subclasses load the model and build jobs."""

    library = "ExLlama"
    supports_logprobs = True

    def __init__(self) -> None:
        super().__init__()
        self.model: Any = None
        self.cache: Any = None
        self.tokenizer: Any = None
        self.generator: Any = None
        self.stop_ids: list[int] = []
        self._jobs: dict[int, JobEntry] = {}  # every job not yet finished, pending or enqueued
        self._pending: list[JobEntry] = []  # jobs the scheduler has yet to enqueue
        self._keys = itertools.count(1)
        self._cv = threading.Condition()
        self._running = False
        self._thread: threading.Thread | None = None
        self._context = DEFAULT_CONTEXT_CAP
        self._max_queue = 64

    @classmethod
    def check(cls, path: Path, options: dict[str, Any]) -> None:
        """The library installed, a CUDA GPU, a model folder with complete weights, and a cache type it has."""
        super().check(path, options)
        require_cuda(cls.library)
        precheck.hf_folder(path)
        cls._check_cache(cache_choice(options))

    @classmethod
    def _check_cache(cls, kind: str) -> None:
        """Raise ModelLoadError when the library has no ``kind`` cache."""

    # ---------------------------------------------------------------- subclass hooks
    @abstractmethod
    def _new_job(self, prompt_ids: list[int], params: GenerationParams, max_new_tokens: int, key: int) -> Any:
        """The library's job for one generation (``identifier=key``), built in the request thread."""

    @abstractmethod
    def _decode_ids(self, ids: list[int], special: bool) -> str:
        """Text of some generated tokens, decoded together."""

    @abstractmethod
    def _release(self) -> None:
        """Free the generator, cache and model (called once the scheduler has stopped, and on a failed load)."""

    # ---------------------------------------------------------------- lifecycle
    def _start(self, options: dict[str, Any]) -> None:
        max_queue = options.get("max_queue")
        self._max_queue = 64 if max_queue is None else int(max_queue)
        self._running = True
        self._thread = threading.Thread(target=self._loop, name=f"{self.loader_name}-scheduler", daemon=True)
        self._thread.start()

    def unload(self) -> None:
        """Stop the scheduler, end every stream and free the GPU memory."""
        with self._cv:
            self._running = False
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=30)
        with self._cv:
            for entry in self._jobs.values():
                entry.out.put(TokenEvent(-1, b"", finish_reason="cancelled"))
            self._jobs.clear()
            self._pending.clear()
        self._release()
        self.model = self.cache = self.generator = None
        with contextlib.suppress(ImportError, RuntimeError):
            import torch

            if torch.cuda.is_available():
                torch.cuda.empty_cache()

    @property
    def context_length(self) -> int:
        return self._context

    # ---------------------------------------------------------------- generation
    def generate(
        self,
        prompt_ids: list[int],
        params: GenerationParams,
        cancel: threading.Event,
        extra: dict[str, Any] | None = None,
    ) -> Iterator[TokenEvent]:
        """Queue a job for the dynamic generator; its results stream as token events."""
        if self.generator is None:
            raise ModelLoadError("the model has been unloaded")
        if not prompt_ids:
            raise InvalidRequest("the prompt is empty", param="prompt")
        room = self._context - len(prompt_ids)
        if room < 1:
            raise InvalidRequest(
                f"the prompt has {len(prompt_ids)} tokens and this model's context holds {self._context}",
                param="prompt",
            )
        # a job reserves pages for prompt + max_new_tokens; more than one context can never be used
        max_new = max(1, min(params.max_new_tokens, room))
        key = next(self._keys)
        entry = JobEntry(
            key=key,
            job=self._new_job(prompt_ids, params, max_new, key),
            max_new_tokens=max_new,
            asked_tokens=params.max_new_tokens,
            special=not params.skip_special_tokens,
            greedy=params.greedy,
            cancel=cancel,
        )
        with self._cv:
            if not self._running:
                raise ModelLoadError("the model has been unloaded")
            if len(self._jobs) >= self.max_parallel + self._max_queue:
                raise QueueFull()
            self._jobs[key] = entry
            self._pending.append(entry)  # the scheduler enqueues it: the generator is not thread-safe
            self._cv.notify_all()
        return self._stream(entry)

    def _stream(self, entry: JobEntry) -> Iterator[TokenEvent]:
        return drain(entry.out, entry.cancel, self._cv)

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
                    self._jobs.pop(entry.key, None)
                    entry.out.put(TokenEvent(-1, b"", finish_reason="cancelled"))
                pending, self._pending = self._pending, []
                for entry in pending:
                    if entry.key not in self._jobs:
                        continue
                    try:
                        self.generator.enqueue(entry.job)
                        entry.enqueued = True
                    except Exception as exc:  # e.g. a job the cache cannot hold: fail that one only
                        self._jobs.pop(entry.key, None)
                        entry.out.put(InvalidRequest(f"{self.library} refused the job: {exc}"))
                if not self._jobs:
                    continue
            try:
                results = self.generator.iterate()
            except Exception as exc:  # fail the jobs in flight, keep serving
                log.exception("%s step failed", self.library)
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
        """Turn one result dict into token events for its job."""
        key = result.get("identifier")
        if key is None:  # ExLlamaV3's error results carry the job but not its identifier (reap_failed_job)
            key = next((e.key for e in list(self._jobs.values()) if e.job is result.get("job")), None)
        entry = self._jobs.get(key) if isinstance(key, int) else None
        if entry is None:
            return
        stage = result.get("stage")
        if stage == "error":  # ExLlamaV3 reaps a failed job and reports it (Generator.reap_failed_job)
            self._finish(entry, RuntimeError(f"generation failed: {result.get('error')}"))
            return
        if stage != "streaming":
            return
        self._emit(entry, result, self._ids(result.get("token_ids")), str(result.get("text") or ""))
        if not result.get("eos"):
            return
        reason = result.get("eos_reason")
        if reason == "stop_token":
            # tokens held back (the start of a character the stop token cut off) come under "held", the stop
            # token last; they were generated, so they are delivered, not dropped
            held = result.get("held") or {}
            ids = self._ids(held.get("token_ids"))
            if ids and ids[-1] == result.get("eos_triggering_token_id", ids[-1]):
                ids = ids[:-1]
            if ids:
                self._emit(entry, held, ids, self._decode_ids(ids, entry.special))
            self._finish(entry, TokenEvent(-1, b"", finish_reason="stop"))
        elif reason == "max_new_tokens":
            capped = entry.generated >= entry.max_new_tokens and entry.asked_tokens > entry.max_new_tokens
            self._finish(entry, TokenEvent(-1, b"", finish_reason="context" if capped else "length"))
        else:
            self._finish(entry, TokenEvent(-1, b"", finish_reason="stop"))

    def _finish(self, entry: JobEntry, last: TokenEvent | BaseException) -> None:
        with self._cv:
            self._jobs.pop(entry.key, None)
        entry.out.put(last)

    @staticmethod
    def _ids(tensor: Any) -> list[int]:
        return [int(t) for t in tensor[0].tolist()] if tensor is not None else []

    def _emit(self, entry: JobEntry, result: dict[str, Any], ids: list[int], text: str) -> None:
        """One event per token; the result's text goes on its last token (the others completed no character)."""
        for i, token in enumerate(ids):
            logprob, top = self._logprobs(entry, result, i)
            piece = text.encode("utf-8") if i == len(ids) - 1 else b""
            entry.generated += 1
            entry.out.put(TokenEvent(token, piece, logprob=logprob, top_logprobs=top))

    def _logprobs(
        self, entry: JobEntry, result: dict[str, Any], i: int
    ) -> tuple[float | None, list[TopLogprob] | None]:
        """The ``i``-th token's log probability and alternatives from the result's sampling probabilities.

        Candidates the sampler truncated away come back with probability 0 (exllamav2 fills ``top_k_probs`` up
        with such fakes, ext_sampling.cpp): they are left out rather than reported as log(0).
        """
        probs = result.get("token_probs")
        logprob = _log(float(probs[0, i])) if probs is not None else None
        top = None
        if result.get("top_k_tokens") is not None:
            pairs = zip(result["top_k_tokens"][0, i].tolist(), result["top_k_probs"][0, i].tolist(), strict=True)
            top = [TopLogprob(int(t), self.token_piece(int(t), True), _log(p)) for t, p in pairs if p > 0]
        return logprob, top

    def token_piece(self, token_id: int, special: bool = False) -> bytes:
        """The text of one token decoded alone (a partial character becomes U+FFFD: for display only)."""
        pieces = self.tokenizer.get_id_to_piece_list(special)
        return str(pieces[token_id]).encode("utf-8") if 0 <= token_id < len(pieces) else b""

    def stats(self) -> dict[str, Any]:
        with self._cv:
            busy = min(len(self._jobs), self.max_parallel)
            return {"slots": self.max_parallel, "busy_slots": busy, "queue_depth": len(self._jobs) - busy}


def _log(p: float) -> float:
    return math.log(p) if p > 0 else float("-inf")
