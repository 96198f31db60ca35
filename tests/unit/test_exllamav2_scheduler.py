"""The ExLlamaV2 scheduler without a GPU: a stand-in dynamic generator that fails when two threads use it.

exllamav2's dynamic generator is not thread-safe, so the backend must enqueue, cancel and iterate jobs from its
scheduler thread only, whatever thread the requests come from.
"""

from __future__ import annotations

import sys
import threading
import time
import types
from typing import Any

import pytest
import torch

from modules.errors import InvalidRequest
from modules.generation.params import GenerationParams
from modules.loaders.exllamav2 import ExLlamaV2Backend

PIECES = ["<s>", "</s>", "a", "b.", "c\n", "d"]


class Settings:
    def __init__(self) -> None:
        self.token_bias: Any = None

    def disallow_tokens(self, tokenizer: Any, tokens: list[int]) -> None:
        if self.token_bias is None:
            self.token_bias = torch.zeros(32)
        self.token_bias[tokens] = float("-inf")


class Job:
    def __init__(self, **kwargs: Any) -> None:
        self.kwargs = kwargs
        self.left = int(kwargs["max_new_tokens"])


class Generator:
    """Answers one token per job per iteration; records which threads called it and whether two overlapped."""

    def __init__(self) -> None:
        self.jobs: list[Job] = []
        self.threads: set[str] = set()
        self.cancelled: list[Job] = []
        self._inside = threading.Lock()

    def _enter(self) -> None:
        self.threads.add(threading.current_thread().name)
        if not self._inside.acquire(blocking=False):
            raise AssertionError("two threads are using the generator at once")

    def enqueue(self, job: Job) -> None:
        self._enter()
        try:
            time.sleep(0.002)
            self.jobs.append(job)
        finally:
            self._inside.release()

    def cancel(self, job: Job) -> None:
        self._enter()
        try:
            self.jobs.remove(job)
            self.cancelled.append(job)
        finally:
            self._inside.release()

    def iterate(self) -> list[dict[str, Any]]:
        self._enter()
        try:
            time.sleep(0.002)
            results = []
            for job in list(self.jobs):
                job.left -= 1
                result = {"job": job, "stage": "streaming", "token_ids": torch.tensor([[2]]), "eos": job.left == 0}
                if job.left == 0:
                    result["eos_reason"] = "max_new_tokens"
                    self.jobs.remove(job)
                results.append(result)
            return results
        finally:
            self._inside.release()


@pytest.fixture
def backend(monkeypatch: pytest.MonkeyPatch) -> Any:
    module = types.ModuleType("exllamav2.generator")
    module.ExLlamaV2DynamicJob = Job  # type: ignore[attr-defined]
    module.ExLlamaV2Sampler = types.SimpleNamespace(Settings=Settings)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "exllamav2", types.ModuleType("exllamav2"))
    monkeypatch.setitem(sys.modules, "exllamav2.generator", module)
    tokenizer = types.SimpleNamespace(
        eos_token_id=1,
        config=types.SimpleNamespace(vocab_size=len(PIECES)),
        get_id_to_piece_list=lambda special=False: PIECES,
    )
    b = ExLlamaV2Backend()
    b.generator, b.tokenizer, b.max_parallel = Generator(), tokenizer, 2
    b._running = True
    b._thread = threading.Thread(target=b._loop, name="exllamav2-scheduler", daemon=True)
    b._thread.start()
    yield b
    b.unload()


def test_requests_from_many_threads_only_reach_the_generator_through_the_scheduler(backend: Any) -> None:
    results: dict[int, list[str | None]] = {}

    def run(i: int) -> None:
        events = backend.generate([0, 2], GenerationParams(max_new_tokens=20), threading.Event())
        results[i] = [e.finish_reason for e in events]

    threads = [threading.Thread(target=run, args=(i,), name=f"request-{i}") for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert all(results[i] == [None] * 20 + ["length"] for i in range(6))  # 20 tokens, then the end
    assert backend.generator.threads == {"exllamav2-scheduler"}
    cancel = threading.Event()
    stream = backend.generate([0, 2], GenerationParams(max_new_tokens=10_000), cancel)
    assert next(stream).token_id == 2
    cancel.set()
    assert [e.finish_reason for e in stream][-1] == "cancelled"
    assert len(backend.generator.cancelled) == 1 and backend.generator.threads == {"exllamav2-scheduler"}
    assert backend.stats()["busy_slots"] == 0


def test_settings_pass_what_exllamav2_reads_and_refuse_mirostat_1(backend: Any) -> None:
    with pytest.raises(InvalidRequest, match="Mirostat 2"):
        backend.generate([0, 2], GenerationParams(mirostat_mode=1), threading.Event())
    settings = backend._settings(
        GenerationParams(
            dry_multiplier=0.8, dry_sequence_breakers=[".", "\n"], logit_bias={3: 2.0, 4: -100}, ban_eos=True
        )
    )
    assert settings.dry_sequence_breakers == {3, 4}  # the tokens whose text holds a breaker
    assert settings.token_bias.shape == (32,)  # padded like exllamav2's own disallow_tokens()
    assert settings.token_bias[3] == 2.0 and settings.token_bias[4] == float("-inf")
    assert settings.token_bias[1] == float("-inf")  # ban_eos adds to the same bias
