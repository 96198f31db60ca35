"""ExLlamaV2 without a GPU: the backend loads and generates through strict stand-ins of exllamav2 0.3.2.

The stand-ins (tests/fixtures/exllama_standins.py) keep the library's assertions and attribute names, so each
mistake found by reading exllamav2's source against the backend fails here: an 8-bit cache the dynamic generator
refuses, a paged generator without flash-attn, characters split across tokens, end tokens other than the first,
a cache too small for parallel jobs, stacked dynamic temperature, post-truncation log probabilities, held tokens
dropped at a stop token, a config prepared twice, and a loader reported available without the library.
"""

from __future__ import annotations

import importlib.util
import math
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from modules import loaders
from modules.errors import InvalidRequest, ModelLoadError
from modules.generation.params import GenerationParams
from modules.loaders.base import TokenEvent
from modules.loaders.exllamav2 import SUPPORTED, ExLlamaV2Backend
from tests.fixtures import exllama_standins as core
from tests.fixtures import exllamav2_standin as v2

Loader = Callable[..., ExLlamaV2Backend]


@pytest.fixture
def load(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Loader]:
    """Load a stand-in EXL2 model folder (config.json as given) with the backend's real load()."""
    core.install(monkeypatch, v2.v2_modules())
    monkeypatch.setattr(v2.V2_ATTN, "has_flash_attn_with_paged", True)
    monkeypatch.setattr(v2.V2Config, "prepare_calls", 0)
    monkeypatch.setattr(v2.V2Model, "unloaded", [])
    made: list[ExLlamaV2Backend] = []

    def make(options: dict[str, Any] | None = None, **config: Any) -> ExLlamaV2Backend:
        folder = core.write_model(tmp_path / f"model-{len(made)}", "exl2", **config)
        backend = ExLlamaV2Backend.load(folder, {"parallel": 2, **(options or {})})
        made.append(backend)
        return backend

    yield make
    for backend in made:
        backend.unload()


def run(backend: ExLlamaV2Backend, prompt: list[int], **params: Any) -> list[TokenEvent]:
    return list(backend.generate(prompt, GenerationParams(**params), threading.Event()))


def text(events: list[TokenEvent]) -> str:
    return b"".join(e.piece for e in events).decode("utf-8")


def test_cache_8bit_gives_the_q8_cache_the_dynamic_generator_takes(load: Loader) -> None:
    backend = load({"cache_8bit": True})  # ExLlamaV2Cache_8bit would fail the generator's assertion
    assert type(backend.cache) is v2.V2CacheQ8
    assert text(run(backend, [0, 12])) == " café!😀!"
    assert type(load({"cache_q4": True}).cache) is v2.V2CacheQ4
    assert type(load({"cache_type": "q6"}).cache) is v2.V2CacheQ6
    assert type(load().cache) is v2.V2Cache
    with pytest.raises(ModelLoadError, match="fp16, q8, q6, q4"):
        load({"cache_type": "fp8"})


def test_without_paged_flash_attn_it_runs_unpaged_one_generation_at_a_time(
    load: Loader, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(v2.V2_ATTN, "has_flash_attn_with_paged", False)  # no flash-attn >= 2.5.7
    backend = load({"parallel": 4})
    assert backend.generator.paged is False and backend.max_parallel == 1
    assert text(run(backend, [0, 12])) == " café!😀!"
    monkeypatch.setattr(v2.V2_ATTN, "has_flash_attn_with_paged", True)
    assert load({"parallel": 4}).generator.paged is True
    disabled = load({"parallel": 4}, textgen_test_no_flash=True)  # arch_compat_overrides turned flash-attn off
    assert disabled.generator.paged is False and disabled.max_parallel == 1


def test_an_assertion_while_loading_is_a_clear_error_and_frees_the_model(
    load: Loader, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuse(self: Any, *args: Any, **kwargs: Any) -> None:
        raise AssertionError("Paged attention required Flash Attention 2.5.7 or later")

    monkeypatch.setattr(v2.V2Generator, "__init__", refuse)
    with pytest.raises(ModelLoadError, match="could not load model-0: Paged attention required"):
        load()
    assert len(v2.V2Model.unloaded) == 1  # the weights already on the GPU were unloaded


def test_characters_split_across_tokens_arrive_whole(load: Loader) -> None:
    events = run(load(), [0, 12])
    assert text(events) == " café!😀!"  # é and 😀 each span two tokens; decoded alone they read U+FFFD
    assert [e.finish_reason for e in events][-1] == "stop"
    assert len([e for e in events if e.token_id >= 0]) == 7  # every generated token is counted, </s> is not


@pytest.mark.parametrize("where", ["config", "generation_config"])
def test_every_end_token_stops_a_reply(load: Loader, tmp_path: Path, where: str) -> None:
    if where == "config":
        backend = load(eos=[core.EOS, core.EOT])  # ExLlamaV2Config keeps only the first of the list
    else:
        backend = load(eos=core.EOS)
        (Path(backend.path or "") / "generation_config.json").write_text('{"eos_token_id": [1, 2]}')
        backend = ExLlamaV2Backend.load(Path(backend.path or ""), {"parallel": 1})
    try:
        events = run(backend, [0, 13], max_new_tokens=20)  # "Hi there<|eot_id|>..."
        assert text(events) == "Hi there" and events[-1].finish_reason == "stop"
        assert backend.metadata.eos_token_ids == [core.EOS, core.EOT]
        ban = backend._settings(GenerationParams(ban_eos=True))
        assert ban.token_bias[core.EOS] == ban.token_bias[core.EOT] == float("-inf")
    finally:
        if where == "generation_config":
            backend.unload()


def test_context_is_capped_and_the_cache_holds_a_context_per_parallel_slot(load: Loader) -> None:
    big = load(context=131072)
    assert big.context_length == 4096 and big.cache.max_seq_len == 4096 * 2  # not 128k, and per slot
    odd = load({"max_seq_len": 1000})  # the generator asserts whole 256-token pages
    assert odd.context_length == 768 and odd.cache.max_seq_len % 256 == 0
    assert load({"cache_size": 3000}).cache.max_seq_len == 3072
    small = load(context=512)
    results: list[str | None] = []
    threads = [
        threading.Thread(target=lambda: results.append(run(small, [0, 3], max_new_tokens=600)[-1].finish_reason))
        for _ in range(2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert results == ["context", "context"]  # capped at the context (510 tokens), and said so
    assert small.generator.most_active == 2  # both full-context jobs ran at once


def test_dynamic_temperature_replaces_the_temperature(load: Loader) -> None:
    s = load()._settings(GenerationParams(temperature=0.7, dynatemp_range=0.5, dynatemp_exponent=2.0))
    assert s.temperature == 1.0  # sampling.cpp would otherwise soften by 0.7 and then apply the dynamic one
    assert math.isclose(s.min_temp, 0.2) and math.isclose(s.max_temp, 1.2) and s.temp_exponent == 2.0


def test_greedy_log_probabilities_come_from_the_logits(load: Loader) -> None:
    events = run(load(), [0, 12], temperature=0, logprobs=True, top_logprobs=3, max_new_tokens=3)
    first = events[0]
    expected = torch.log_softmax(core.logits_for(12), dim=-1)
    assert first.logprob is not None and math.isclose(first.logprob, float(expected[12]), rel_tol=1e-5)
    assert first.logprob < 0  # after top_k=1 exllamav2 reports probability 1.0: log 0.0
    assert first.top_logprobs is not None and len(first.top_logprobs) == 3
    assert first.top_logprobs[0].token_id == 12 and all(t.logprob > -10 for t in first.top_logprobs)
    sampled = run(load(), [0, 12], temperature=1.0, top_k=2, logprobs=True, top_logprobs=4, max_new_tokens=2)
    assert all(len(e.top_logprobs or []) == 2 for e in sampled if e.token_id >= 0)  # no log(0) fakes


def test_tokens_held_at_a_stop_token_are_delivered(load: Loader) -> None:
    events = run(load(), [0, 15])  # "Hi", half of "é", </s>: the half is held when the stop token comes
    assert [e.token_id for e in events] == [3, 7, -1]
    assert text(events) == "Hi\ufffd" and events[-1].finish_reason == "stop"


def test_the_config_is_prepared_once(load: Loader) -> None:
    load()
    assert v2.V2Config.prepare_calls == 1  # ExLlamaV2Config(model_dir) already ran prepare()


def test_the_loader_is_available_only_with_the_library() -> None:
    assert loaders.available()["exllamav2"] is (importlib.util.find_spec("exllamav2") is not None)
    assert loaders.available()["exllamav3"] is (importlib.util.find_spec("exllamav3") is not None)


def test_every_supported_parameter_sets_a_real_settings_field(load: Loader) -> None:
    backend = load()
    params = GenerationParams(
        temperature=0.9, temperature_last=True, dynatemp_range=0.2, top_k=40, top_p=0.9, min_p=0.05, typical_p=0.9,
        top_a=0.1, tfs=0.9, xtc_threshold=0.2, xtc_probability=0.5, repetition_penalty=1.1,
        repetition_penalty_range=64, presence_penalty=0.1, frequency_penalty=0.1, dry_multiplier=0.8,
        dry_sequence_breakers=[".", "\n"], mirostat_mode=2, logit_bias={3: 2.0, 4: -100}, ban_eos=True,
    )  # fmt: skip
    assert set(params.non_default()) <= SUPPORTED
    s = backend._settings(params)  # a misspelled attribute raises on the __slots__ stand-in
    assert (s.top_k, s.typical, s.tfs, s.top_a, s.mirostat, s.token_repetition_range) == (40, 0.9, 0.9, 0.1, True, 64)
    assert s.token_repetition_penalty == 1.1  # the library's default is 1.025: every field is set
    assert s.dry_sequence_breakers == {5, 6}  # the tokens whose text holds a breaker
    assert s.token_bias.shape == (32,)  # padded like exllamav2's own disallow_tokens()
    assert s.token_bias[3] == 2.0 and s.token_bias[4] == float("-inf") and s.token_bias[core.EOS] == float("-inf")
    assert text(run(backend, [0, 12], **params.non_default(), max_new_tokens=3))
    with pytest.raises(InvalidRequest, match="Mirostat 2"):
        backend.generate([0, 2], GenerationParams(mirostat_mode=1), threading.Event())


def test_requests_from_many_threads_only_reach_the_generator_through_the_scheduler(load: Loader) -> None:
    backend = load({"parallel": 3})
    results: dict[int, list[str | None]] = {}

    def work(i: int) -> None:
        results[i] = [e.finish_reason for e in run(backend, [0, 11], max_new_tokens=20)]

    threads = [threading.Thread(target=work, args=(i,), name=f"request-{i}") for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert all(results[i] == [None] * 20 + ["length"] for i in range(6))  # 20 tokens, then the end
    assert backend.generator.threads == {"exllamav2-scheduler"}
    cancel = threading.Event()
    stream = backend.generate([0, 11], GenerationParams(max_new_tokens=1000), cancel)
    assert next(stream).token_id == 3
    cancel.set()
    assert [e.finish_reason for e in stream][-1] == "cancelled"
    assert len(backend.generator.cancelled) == 1 and backend.generator.threads == {"exllamav2-scheduler"}
    assert backend.stats()["busy_slots"] == 0
