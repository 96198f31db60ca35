"""ExLlamaV3 without a GPU: the backend loads and generates through strict stand-ins of exllamav3 1.6.5.

The stand-ins keep the library's names, signatures and assertions (the cache must exist before ``model.load()``,
256-token pages, 2..8-bit quantized layers, ``max_new_tokens >= 1``, the sampler steps' checks), so a mistake in
how the backend drives the real library fails here.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from modules.errors import InvalidRequest, ModelLoadError
from modules.generation.params import GenerationParams
from modules.generation.pipeline import check_params
from modules.loaders.base import TokenEvent
from modules.loaders.exllamav3 import SUPPORTED, ExLlamaV3Backend
from tests.fixtures import exllama_standins as core
from tests.fixtures import exllamav3_standin as v3

Loader = Callable[..., ExLlamaV3Backend]


@pytest.fixture
def load(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Loader]:
    """Load a stand-in EXL3 model folder (config.json as given) with the backend's real load()."""
    core.install(monkeypatch, v3.v3_modules())
    monkeypatch.setattr(v3.V3Model, "unloaded", [])
    monkeypatch.setattr(v3.V3Generator, "closed", 0)
    made: list[ExLlamaV3Backend] = []

    def make(options: dict[str, Any] | None = None, generation_eos: Any = None, **config: Any) -> ExLlamaV3Backend:
        folder = core.write_model(tmp_path / f"model-{len(made)}", "exl3", **config)
        if generation_eos is not None:
            (folder / "generation_config.json").write_text(f'{{"eos_token_id": {generation_eos}}}')
        backend = ExLlamaV3Backend.load(folder, {"parallel": 2, **(options or {})})
        made.append(backend)
        return backend

    yield make
    for backend in made:
        backend.unload()


def run(backend: ExLlamaV3Backend, prompt: list[int], **params: Any) -> list[TokenEvent]:
    return list(backend.generate(prompt, GenerationParams(**params), threading.Event()))


def text(events: list[TokenEvent]) -> str:
    return b"".join(e.piece for e in events).decode("utf-8")


def test_it_generates_whole_characters_and_stops_at_the_end_token(load: Loader) -> None:
    backend = load()
    events = run(backend, [0, 12])
    assert text(events) == " café!😀!" and events[-1].finish_reason == "stop"
    assert len([e for e in events if e.token_id >= 0]) == 7
    assert backend.generator.cache.initialized  # made before model.load(), which allocated it


def test_every_end_token_stops_a_reply(load: Loader) -> None:
    backend = load(eos=core.EOS, generation_eos="[1, 2]")  # Tokenizer.from_config adds generation_config's
    events = run(backend, [0, 13], max_new_tokens=20)
    assert text(events) == "Hi there" and events[-1].finish_reason == "stop"
    assert backend.metadata.eos_token_ids == [core.EOS, core.EOT]
    banned = backend._sampler(GenerationParams(ban_eos=True)).steps[0]
    assert isinstance(banned, v3.SS_BanTokens) and banned.args == ([core.EOS, core.EOT],)
    assert text(run(backend, [0, 13], max_new_tokens=5, ban_eos=True)).startswith("Hi there")


@pytest.mark.parametrize(
    ("cache_options", "layer", "bits"),
    [
        ({}, v3.CacheLayer_fp16, None),
        ({"cache_q4": True}, v3.CacheLayer_quant, (4, 4)),
        ({"cache_8bit": True}, v3.CacheLayer_quant, (8, 8)),
        ({"cache_type": "4,6"}, v3.CacheLayer_quant, (4, 6)),
        ({"cache_type": "q6"}, v3.CacheLayer_quant, (6, 6)),
    ],
)
def test_cache_types(load: Loader, cache_options: dict[str, Any], layer: type, bits: tuple[int, int] | None) -> None:
    backend = load(cache_options)
    cache_layer = backend.generator.cache.layer
    assert type(cache_layer) is layer
    if bits:
        assert (cache_layer.k_bits, cache_layer.v_bits) == bits
    assert text(run(backend, [0, 12])) == " café!😀!"


def test_a_cache_type_it_cannot_make_is_refused_clearly(load: Loader) -> None:
    with pytest.raises(ModelLoadError, match=r"q2\.\.q8"):
        load({"cache_type": "q9"})
    with pytest.raises(ModelLoadError, match="key,value bits"):
        load({"cache_type": "fp8"})


def test_context_is_capped_and_the_cache_holds_a_context_per_parallel_slot(load: Loader) -> None:
    backend = load({"parallel": 3}, context=131072)
    assert backend.context_length == 4096 and backend.generator.cache.max_num_tokens == 4096 * 3
    assert load({"max_seq_len": 1000}).context_length == 768


def test_samplers_become_steps_in_the_librarys_order(load: Loader) -> None:
    backend = load()
    params = GenerationParams(
        temperature=0.7, temperature_last=True, top_k=40, top_p=0.9, min_p=0.05, repetition_penalty=1.1,
        repetition_penalty_range=64, presence_penalty=0.2, dry_multiplier=0.8, dry_sequence_breakers=["."],
        xtc_probability=0.5, xtc_threshold=0.1, logit_bias={3: -100, 4: 1.5},
    )  # fmt: skip
    assert set(params.non_default()) <= SUPPORTED
    steps = backend._sampler(params).steps
    assert [type(s).__name__ for s in steps] == [
        "SS_LogitBias", "SS_RepP", "SS_PresFreqP", "SS_DRY", "SS_MinP", "SS_TopK", "SS_TopP", "SS_XTC",
        "SS_Temperature", "SS_Sample",
    ]  # fmt: skip
    assert steps[0].args == ({3: float("-inf"), 4: 1.5},)
    assert steps[1].args == (1.1, 64, 0) and steps[3].args[4] == {5}
    greedy = backend._sampler(GenerationParams(temperature=0)).steps
    assert [type(s).__name__ for s in greedy] == ["SS_Argmax"]
    assert text(run(backend, [0, 12], **params.non_default()))


@pytest.mark.parametrize(
    "name", ["typical_p", "tfs", "top_a", "mirostat_mode", "dynatemp_range", "epsilon_cutoff", "grammar"]
)
def test_samplers_it_lacks_are_refused_not_ignored(load: Loader, name: str) -> None:
    value = {"typical_p": 0.9, "tfs": 0.9, "top_a": 0.2, "mirostat_mode": 2, "dynatemp_range": 0.3}.get(name, 0.1)
    params = GenerationParams(**{name: "root ::= [a-z]+" if name == "grammar" else value})
    with pytest.raises(InvalidRequest, match=name):
        check_params(load(), params, strict=True)


def test_log_probabilities_are_the_models(load: Loader) -> None:
    events = run(load(), [0, 12], temperature=0, logprobs=True, top_logprobs=2, max_new_tokens=2)
    expected = torch.log_softmax(core.logits_for(12), dim=-1)
    assert events[0].logprob is not None and math.isclose(events[0].logprob, float(expected[12]), rel_tol=1e-5)
    assert (events[0].top_logprobs or [])[0].token_id == 12


def test_a_job_the_generator_reaps_fails_alone(load: Loader) -> None:
    backend = load()
    backend.generator.fail_next = True
    outcome: list[BaseException | list[TokenEvent]] = []

    def consume() -> None:
        try:
            outcome.append(run(backend, [0, 12]))
        except RuntimeError as exc:
            outcome.append(exc)

    worker = threading.Thread(target=consume, daemon=True)
    worker.start()
    worker.join(10)
    assert outcome and isinstance(outcome[0], RuntimeError) and "kernel fault" in str(outcome[0])  # not a hang
    assert text(run(backend, [0, 12])) == " café!😀!"  # the next one runs


def test_cancel_and_threads(load: Loader) -> None:
    backend = load({"parallel": 2})
    done: list[str | None] = []
    threads = [
        threading.Thread(target=lambda: done.append(run(backend, [0, 11], max_new_tokens=30)[-1].finish_reason))
        for _ in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert done == ["length"] * 4 and backend.generator.threads == {"exllamav3-scheduler"}
    cancel = threading.Event()
    stream = backend.generate([0, 11], GenerationParams(max_new_tokens=1000), cancel)
    next(stream)
    cancel.set()
    assert [e.finish_reason for e in stream][-1] == "cancelled" and len(backend.generator.cancelled) == 1


def test_a_failed_load_frees_the_model_and_unload_closes_the_generator(
    load: Loader, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend = load()
    backend.unload()
    assert v3.V3Generator.closed == 1 and len(v3.V3Model.unloaded) == 1

    def out_of_memory(self: Any, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError("CUDA out of memory")

    monkeypatch.setattr(v3.V3Model, "load", out_of_memory)
    with pytest.raises(ModelLoadError, match="could not load model-1: CUDA out of memory"):
        load()
    assert len(v3.V3Model.unloaded) == 2
