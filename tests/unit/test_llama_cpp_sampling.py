"""llama.cpp's samplers on hand-made candidates: what the chain leaves is read from where llama.cpp left it."""

from __future__ import annotations

import ctypes
import math

import llama_cpp
import numpy as np
import pytest

from modules.generation.params import GenerationParams
from modules.loaders.llama_cpp_sampling import _TOKEN_DATA, NothingToSample, PlainSampler, RequestSampler, _surviving


def candidates(probs: list[float]) -> tuple[np.ndarray, llama_cpp.llama_token_data_array]:
    cand = np.empty(len(probs), dtype=_TOKEN_DATA)
    cand["id"] = np.arange(len(probs), dtype=np.intc)
    cand["logit"] = np.log(np.asarray(probs, dtype=np.float64))
    cand["p"] = 0.0
    array = llama_cpp.llama_token_data_array(
        data=cand.ctypes.data_as(llama_cpp.llama_token_data_p), size=len(probs), selected=-1, sorted=False
    )
    return cand, array


def test_xtc_survivors_are_read_past_the_moved_start() -> None:
    # XTC drops every token above the threshold but the least likely of them by moving the array's start
    probs = [0.05, 0.4, 0.1, 0.3, 0.15]
    cand, array = candidates(probs)
    xtc = llama_cpp.llama_sampler_init_xtc(1.0, 0.12, 1, 7)
    try:
        llama_cpp.llama_sampler_apply(xtc, ctypes.byref(array))
    finally:
        llama_cpp.llama_sampler_free(xtc)
    kept = _surviving(cand, array.data, int(array.size))
    assert sorted(kept["id"].tolist()) == [0, 2, 4]  # 0.4 and 0.3 dropped; 0.15 (the last above 0.12) kept
    assert math.isclose(float(kept["p"][kept["id"] == 4][0]), 0.15, rel_tol=1e-5)


def test_survivors_from_the_array_start_when_nothing_moved() -> None:
    cand, array = candidates([0.5, 0.2, 0.3])
    top_k = llama_cpp.llama_sampler_init_top_k(2)
    try:
        llama_cpp.llama_sampler_apply(top_k, ctypes.byref(array))
    finally:
        llama_cpp.llama_sampler_free(top_k)
    assert sorted(_surviving(cand, array.data, int(array.size))["id"].tolist()) == [0, 2]


# --- the numpy sampler (PlainSampler) against llama.cpp's own chain -------------------------------------------------

PLAIN_SETTINGS = [
    {"temperature": 0.8},
    {"temperature": 1.3, "logit_bias": {"3": 5.0, "7": -100}},
    {"temperature": 0.7, "top_k": 40},
    {"temperature": 0.7, "top_p": 0.9},
    {"temperature": 1.0, "top_p": 0.5, "top_k": 100},
    {"temperature": 0.9, "min_p": 0.05},
    {"temperature": 1.5, "min_p": 0.1, "temperature_last": True},
    {"temperature": 2.0, "top_p": 0.8, "min_p": 0.02, "top_k": 500, "temperature_last": True},
    {"temperature": 0.8, "min_tokens": 5},
    {"temperature": 0.8, "ban_eos": True, "top_p": 0.95},
]
VOCAB = 4096
EOG = [2, 11]


def rows() -> list[np.ndarray]:
    """Logits as a model gives them: a few likely tokens over a long tail, one flat row, the EOG token on top."""
    rng = np.random.default_rng(0)
    out = []
    for scale, peak in ((2.0, 8.0), (3.0, 4.0), (0.3, 0.0), (2.0, 12.0)):
        row = rng.standard_normal(VOCAB).astype(np.float32) * scale
        row[rng.choice(VOCAB, 5, replace=False)] += peak
        out.append(row)
    out[-1][EOG[0]] = out[-1].max() + 3.0
    return out


def chain_distribution(params: GenerationParams, row: np.ndarray, generated: int) -> dict[int, float]:
    """What llama.cpp's chain (the one RequestSampler builds when the numpy sampler is not used) would draw from."""
    sampler = RequestSampler.__new__(RequestSampler)
    sampler.n_vocab, sampler.params, sampler.grammar, sampler.eog_ban, sampler._keep = VOCAB, params, None, None, []
    sampler.plain = None
    sampler.chain = llama_cpp.llama_sampler_chain_init(llama_cpp.llama_sampler_chain_default_params())
    try:
        sampler._build(None, EOG, 4096)
        cand = np.empty(VOCAB, dtype=_TOKEN_DATA)
        cand["id"], cand["logit"], cand["p"] = np.arange(VOCAB), row, 0.0
        if generated < params.min_tokens:
            cand["logit"][EOG] = -np.inf
        array = llama_cpp.llama_token_data_array(
            data=cand.ctypes.data_as(llama_cpp.llama_token_data_p), size=VOCAB, selected=-1, sorted=False
        )
        llama_cpp.llama_sampler_apply(sampler.chain, ctypes.byref(array))
        kept = _surviving(cand, array.data, int(array.size))
        # what the chain leaves, as RequestSampler reads its logprobs: a softmax of the surviving logits
        scores = kept["logit"].astype(np.float64)
        weights = np.exp(scores - scores[np.isfinite(scores)].max())
        return {int(i): float(w) / float(weights.sum()) for i, w in zip(kept["id"], weights, strict=True) if w > 0}
    finally:
        sampler.close()


def plain_distribution(params: GenerationParams, row: np.ndarray, generated: int) -> dict[int, float]:
    ids, weights = PlainSampler(VOCAB, params, EOG).weights(row, generated)
    ids = np.arange(VOCAB) if ids is None else ids
    total = float(weights.sum(dtype=np.float64))
    return {int(i): float(w) / total for i, w in zip(ids, weights, strict=True) if w > 0}


@pytest.mark.parametrize("settings", PLAIN_SETTINGS, ids=lambda s: "+".join(s))
def test_the_numpy_sampler_draws_from_what_llama_cpps_chain_leaves(settings: dict) -> None:
    params = GenerationParams(seed=1, **settings)
    assert PlainSampler.fits(params)
    for n, row in enumerate(rows()):
        for generated in (0, 10):
            ours, theirs = plain_distribution(params, row, generated), chain_distribution(params, row, generated)
            assert ours.keys() == theirs.keys(), (n, generated, len(ours), len(theirs))
            worst = max(abs(ours[t] - theirs[t]) for t in ours)
            assert worst < 1e-5, (n, generated, worst)


def test_greedy_takes_the_first_best_after_bias_and_bans() -> None:
    row = np.zeros(VOCAB, dtype=np.float32)
    row[[5, 9]] = 3.0
    row[EOG[0]] = 4.0
    assert PlainSampler(VOCAB, GenerationParams(temperature=0), EOG).sample(row)[0] == EOG[0]
    assert PlainSampler(VOCAB, GenerationParams(temperature=0, min_tokens=1), EOG).sample(row, 0)[0] == 5
    assert PlainSampler(VOCAB, GenerationParams(temperature=0, min_tokens=1), EOG).sample(row, 1)[0] == EOG[0]
    assert PlainSampler(VOCAB, GenerationParams(temperature=0, ban_eos=True), EOG).sample(row)[0] == 5
    biased = GenerationParams(temperature=0, logit_bias={"5": -100, "700": 10.0})
    assert PlainSampler(VOCAB, biased, EOG).sample(row)[0] == 700


@pytest.mark.parametrize("settings", [{"temperature": 0.8}, {"temperature": 1.0, "top_p": 0.9}], ids=str)
def test_the_draws_follow_the_distribution(settings: dict) -> None:
    row = rows()[1]
    params = GenerationParams(seed=3, **settings)
    sampler = PlainSampler(VOCAB, params, EOG)
    expected = plain_distribution(params, row, 0)
    draws = 40000
    counts = np.bincount([sampler.sample(row)[0] for _ in range(draws)], minlength=VOCAB)
    assert set(np.flatnonzero(counts)) <= expected.keys()  # never a dropped token
    for token, p in sorted(expected.items(), key=lambda kv: -kv[1])[:20]:
        sigma = math.sqrt(p * (1 - p) / draws)
        assert abs(counts[token] / draws - p) < 5 * sigma + 1e-4, (token, p, counts[token] / draws)
    # the tail, block by block of the draw: each block's share as expected
    for start in range(0, VOCAB, PlainSampler.BLOCK):
        p = sum(q for t, q in expected.items() if start <= t < start + PlainSampler.BLOCK)
        share = counts[start : start + PlainSampler.BLOCK].sum() / draws
        assert abs(share - p) < 5 * math.sqrt(p * (1 - p) / draws) + 1e-4, (start, p, share)


def test_a_seed_gives_the_same_draws_and_another_seed_others() -> None:
    row = rows()[2]  # a flat row: every draw is a real choice

    def draws(seed: int) -> list[int]:
        sampler = PlainSampler(VOCAB, GenerationParams(temperature=1.0, seed=seed), EOG)
        return [sampler.sample(row)[0] for _ in range(50)]

    assert draws(5) == draws(5)
    assert draws(5) != draws(6)


def test_what_the_numpy_sampler_does_not_do_goes_to_the_chain() -> None:
    assert PlainSampler.fits(GenerationParams(temperature=0, logit_bias={"1": 2.0}, min_tokens=3))
    assert PlainSampler.fits(GenerationParams(temperature=0.7, top_p=0.9, logprobs=True, top_logprobs=5))
    plain = RequestSampler(None, VOCAB, GenerationParams(temperature=0.8, top_k=40), EOG, 4096)
    chain = RequestSampler(None, VOCAB, GenerationParams(temperature=0.8, repetition_penalty=1.1), EOG, 4096)
    try:
        assert plain.plain is not None and plain.chain is None
        assert chain.plain is None and chain.chain
    finally:
        plain.close()
        chain.close()
    for other in (
        {"repetition_penalty": 1.1},
        {"presence_penalty": 0.5},
        {"frequency_penalty": 0.5},
        {"dry_multiplier": 0.8},
        {"typical_p": 0.9},
        {"xtc_probability": 0.5},
        {"mirostat_mode": 2},
        {"dynatemp_range": 0.5},
    ):
        assert not PlainSampler.fits(GenerationParams(temperature=0.8, **other)), other
    assert not PlainSampler.fits(GenerationParams(temperature=0.8), grammar='root ::= "a"')


@pytest.mark.parametrize(
    "settings", [{"temperature": 0}, {"temperature": 0.8}, {"temperature": 0.7, "top_k": 40, "top_p": 0.9}], ids=str
)
def test_logprobs_are_the_chains_and_do_not_change_the_draws(settings: dict) -> None:
    plain = GenerationParams(seed=9, **settings)
    asked = GenerationParams(seed=9, logprobs=True, top_logprobs=5, **settings)
    quiet, loud = PlainSampler(VOCAB, plain, EOG), PlainSampler(VOCAB, asked, EOG)
    for row in rows() * 3:
        token, none, nothing = quiet.sample(row)
        same, logprob, tops = loud.sample(row)
        assert same == token and none is None and nothing is None  # the same draw with logprobs on
        theirs = chain_distribution(asked, row, 0)
        assert logprob == pytest.approx(math.log(theirs[token]), abs=1e-4)
        best = sorted(theirs.items(), key=lambda kv: -kv[1])[:5]
        assert tops is not None and [t for t, _ in tops] == [t for t, _ in best]
        assert [lp for _, lp in tops] == pytest.approx([math.log(p) for _, p in best], abs=1e-4)


def test_a_row_with_nothing_to_sample_is_this_requests_error() -> None:
    row = rows()[0]
    banned = GenerationParams(temperature=0.8, logit_bias={str(i): -100 for i in range(VOCAB)})
    for params in (banned, GenerationParams(temperature=0, logit_bias={str(i): -100 for i in range(VOCAB)})):
        with pytest.raises(NothingToSample):
            PlainSampler(VOCAB, params, EOG).sample(row)
    broken = row.copy()
    broken[[1, 5]] = np.nan  # a model fault: NaN logits count as banned, the rest is drawn from
    assert PlainSampler(VOCAB, GenerationParams(temperature=0), EOG).sample(broken)[0] == int(
        np.nanargmax(np.where(np.isnan(broken), -np.inf, broken))
    )
    drawn = {PlainSampler(VOCAB, GenerationParams(temperature=1.0, seed=s), EOG).sample(broken)[0] for s in range(50)}
    assert drawn and not drawn & {1, 5}


def test_a_tiny_temperature_is_greedy() -> None:
    row = rows()[1]
    for settings in ({"temperature": 1e-39}, {"temperature": 1e-39, "temperature_last": True, "top_k": 5}):
        assert PlainSampler(VOCAB, GenerationParams(seed=1, **settings), EOG).sample(row)[0] == int(row.argmax())
