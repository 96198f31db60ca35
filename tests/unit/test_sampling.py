"""The torch logits processors, each checked on hand-made logits."""

from __future__ import annotations

import math

import pytest
import torch

from modules.generation import sampling
from modules.generation.params import GenerationParams

INF = float("-inf")


def logits(*values: float) -> torch.Tensor:
    return torch.tensor([list(values)], dtype=torch.float32)


def probs_of(*ps: float) -> torch.Tensor:
    return torch.log(torch.tensor([list(ps)], dtype=torch.float32))


def kept(scores: torch.Tensor) -> list[int]:
    return [i for i, v in enumerate(scores[0].tolist()) if math.isfinite(v)]


IDS = torch.tensor([[0, 1, 1, 2]])


def test_logit_bias_and_ban() -> None:
    out = sampling.LogitBias({1: 2.0, 2: -100.0, 99: 5.0}, vocab=3)(IDS, logits(0.0, 0.0, 0.0))
    assert out[0].tolist() == [0.0, 2.0, INF]


def test_eos_ban_until_min_tokens() -> None:
    ban = sampling.EosBan([2], prompt_length=3, min_tokens=2, always=False)
    assert ban(torch.tensor([[5, 5, 5, 1]]), logits(0, 0, 1))[0, 2] == INF  # 1 generated < 2
    assert ban(torch.tensor([[5, 5, 5, 1, 1]]), logits(0, 0, 1))[0, 2] == 1  # 2 generated: allowed
    assert sampling.EosBan([2], 0, 0, always=True)(IDS, logits(0, 0, 1))[0, 2] == INF


def test_repetition_penalty_divides_positive_and_multiplies_negative() -> None:
    out = sampling.RepetitionPenalty(2.0, window=0)(IDS, logits(4.0, -1.0, 3.0, 5.0))
    assert out[0].tolist() == [2.0, -2.0, 1.5, 5.0]  # 0, 1 and 2 were seen; 3 was not
    windowed = sampling.RepetitionPenalty(2.0, window=1)(IDS, logits(4.0, -1.0, 3.0, 5.0))
    assert windowed[0].tolist() == [4.0, -1.0, 1.5, 5.0]  # only the last token counts


def test_presence_and_frequency_penalties() -> None:
    out = sampling.PresenceFrequencyPenalty(0.5, 1.0, window=0)(IDS, logits(0.0, 0.0, 0.0, 0.0))
    assert out[0].tolist() == [-1.5, -2.5, -1.5, 0.0]  # token 1 appears twice


def test_no_repeat_ngram() -> None:
    ids = torch.tensor([[7, 8, 9, 7, 8]])
    out = sampling.NoRepeatNGram(3)(ids, logits(*[0.0] * 10))
    assert out[0, 9] == INF and math.isfinite(float(out[0, 3]))


def test_dry_penalises_the_token_that_extends_a_repeat() -> None:
    ids = torch.tensor([[1, 2, 3, 4, 9, 1, 2, 3]])  # "1 2 3" repeats; next "4" would extend it
    out = sampling.DRY(multiplier=1.0, base=2.0, allowed_length=2, breakers=set(), window=0)(ids, logits(*[0.0] * 10))
    assert out[0, 4] == pytest.approx(-2.0)  # length 3: 1.0 * 2 ** (3 - 2)
    assert out[0, 5] == 0.0
    broken = sampling.DRY(1.0, 2.0, 2, breakers={2}, window=0)(ids, logits(*[0.0] * 10))
    assert broken[0, 4] == 0.0  # the breaker stops the repeat at length 1, under the allowed length


def test_temperature_and_dynamic_temperature() -> None:
    assert sampling.Temperature(2.0)(IDS, logits(2.0, 4.0))[0].tolist() == [1.0, 2.0]
    flat = sampling.DynamicTemperature(1.0, 0.5, 1.0)(IDS, logits(2.0, 2.0))  # maximal entropy: t + range = 1.5
    assert flat[0].tolist() == pytest.approx([2.0 / 1.5, 2.0 / 1.5])
    # low entropy: temperature 0.5 + 1.0 * (entropy / ln 3), a little above t - range
    p_top = math.exp(10) / (math.exp(10) + 2)
    p_low = 1 / (math.exp(10) + 2)
    entropy = -(p_top * math.log(p_top) + 2 * p_low * math.log(p_low))
    temperature = 0.5 + 1.0 * entropy / math.log(3)
    peaked = sampling.DynamicTemperature(1.0, 0.5, 1.0)(IDS, logits(10.0, 0.0, 0.0))
    assert peaked[0].tolist() == pytest.approx([10.0 / temperature, 0.0, 0.0], rel=1e-5)
    assert 0.5 < temperature < 0.51


def test_top_k_top_p_min_p() -> None:
    assert kept(sampling.TopK(2)(IDS, logits(1.0, 3.0, 2.0, 0.0))) == [1, 2]
    p = probs_of(0.5, 0.3, 0.15, 0.05)
    assert kept(sampling.TopP(0.7)(IDS, p.clone())) == [0, 1]
    assert kept(sampling.TopP(0.5)(IDS, p.clone())) == [0]
    assert kept(sampling.MinP(0.5)(IDS, p.clone())) == [0, 1]  # 0.3 >= 0.25, 0.15 < 0.25
    assert kept(sampling.MinP(0.99)(IDS, p.clone())) == [0]


def test_typical_p_keeps_tokens_near_the_entropy() -> None:
    p = probs_of(0.4, 0.3, 0.2, 0.1)
    out = sampling.TypicalP(0.45)(IDS, p.clone())
    # entropy 1.28 nats; surprises 0.92, 1.20, 1.61, 2.30: token 1 is the most typical (mass 0.3 < 0.45), then token 2
    assert kept(out) == [1, 2]


def test_top_a_tfs_epsilon_eta() -> None:
    p = probs_of(0.6, 0.3, 0.08, 0.02)
    assert kept(sampling.TopA(0.5)(IDS, p.clone())) == [0, 1]  # cutoff 0.5 * 0.6 ** 2 = 0.18
    assert kept(sampling.TopA(1.0)(IDS, p.clone())) == [0]  # cutoff 0.36
    assert kept(sampling.EpsilonCutoff(500)(IDS, p.clone())) == [0, 1, 2]  # cutoff 0.05
    assert kept(sampling.EtaCutoff(2000)(IDS, p.clone())) == [0, 1]  # min(0.2, sqrt(0.2) e^-H)
    # Tail-free, by hand: sorted 0.4, 0.3, 0.15, 0.1, 0.05 (ids 1, 3, 4, 0, 2); first differences -0.1, -0.15,
    # -0.05, -0.05; |second differences| 0.05, 0.1, 0 -> normalised 1/3, 2/3, 0 -> cumulative 1/3, 1, 1. The top
    # token always stays, the next sorted token i + 1 stays while cumulative[i] <= z, the last one never does.
    shuffled = probs_of(0.1, 0.4, 0.05, 0.3, 0.15)
    assert kept(sampling.TailFree(0.5)(IDS, shuffled.clone())) == [1, 3]
    assert kept(sampling.TailFree(0.2)(IDS, shuffled.clone())) == [1]
    assert kept(sampling.TailFree(0.9)(IDS, shuffled.clone())) == [1, 3]
    tail = sampling.TailFree(0.5)(IDS, shuffled.clone())
    assert tail[0, [1, 3]].tolist() == shuffled[0, [1, 3]].tolist()  # what it keeps it leaves untouched


def test_xtc_removes_all_top_choices_but_the_least_likely() -> None:
    always = sampling.XTC(threshold=0.1, probability=1.0, generator=torch.Generator().manual_seed(0))
    assert kept(always(IDS, probs_of(0.5, 0.3, 0.15, 0.05))) == [2, 3]
    never = sampling.XTC(threshold=0.1, probability=0.0, generator=torch.Generator().manual_seed(0))
    assert kept(never(IDS, probs_of(0.5, 0.3, 0.15, 0.05))) == [0, 1, 2, 3]


def test_mirostat_v2_truncates_by_surprise_and_adapts_mu() -> None:
    probs = [0.5, 0.25, 0.15, 0.1]
    mirostat = sampling.Mirostat(2, tau=1.5, eta=0.5, generator=torch.Generator().manual_seed(3))
    out = mirostat(IDS, probs_of(*probs))
    # mu starts at 2 * tau = 3 bits: surprises 1, 2, 2.74 pass, 3.32 (p = 0.1) does not
    assert mirostat.k == 3 and len(kept(out)) == 1 and kept(out)[0] < 3
    chosen = probs[kept(out)[0]] / sum(probs[:3])  # the surprise observed among the kept tokens
    assert mirostat.mu == pytest.approx(3.0 - 0.5 * (-math.log2(chosen) - 1.5), rel=1e-5)


def test_mirostat_v1_estimates_the_zipf_exponent_to_pick_k() -> None:
    n, exponent = 200, 1.5
    zipf = [(i + 1) ** -exponent for i in range(n)]
    total = sum(zipf)
    mirostat = sampling.Mirostat(1, tau=3.0, eta=0.1, generator=torch.Generator().manual_seed(3))
    out = mirostat(IDS, probs_of(*[z / total for z in zipf]))
    # s_hat = 1.5 exactly for a Zipf law, so epsilon = 0.5 and k = (epsilon * 2^mu / (1 - n^-epsilon))^(1 / s_hat)
    epsilon, mu = exponent - 1, 6.0
    k = int((epsilon * 2**mu / (1 - n**-epsilon)) ** (1 / exponent))
    assert k == 10 and mirostat.k == k
    assert len(kept(out)) == 1 and kept(out)[0] < k
    chosen = zipf[kept(out)[0]] / sum(zipf[:k])
    assert mirostat.mu == pytest.approx(mu - 0.1 * (-math.log2(chosen) - 3.0), rel=1e-5)


def test_chain_order_and_greedy() -> None:
    params = GenerationParams(
        temperature=0.5, top_k=3, min_p=0.1, temperature_last=True, repetition_penalty=1.1, seed=1
    )
    chain = sampling.build_chain(
        params, vocab=10, eos_ids=[2], prompt_length=2, breaker_ids=set(), generator=torch.Generator()
    )
    names = [type(p).__name__ for p in chain]
    assert names == ["RepetitionPenalty", "TopK", "MinP", "Temperature"]
    greedy = sampling.build_chain(
        GenerationParams(temperature=0, top_k=3),
        vocab=10,
        eos_ids=[2],
        prompt_length=2,
        breaker_ids=set(),
        generator=torch.Generator(),
    )
    assert greedy == []
    assert sampling.sample(logits(0.1, 0.9, 0.3), greedy=True, generator=torch.Generator()) == 1


def test_seeded_sampling_reproduces() -> None:
    scores = probs_of(0.6, 0.3, 0.1)

    def draws(seed: int, count: int) -> list[int]:
        generator = torch.Generator().manual_seed(seed)
        return [sampling.sample(scores, False, generator) for _ in range(count)]

    a = draws(7, 4000)
    assert a == draws(7, 4000)  # the same seed: the same sequence of draws
    assert a[:50] != draws(8, 50)  # another seed: another sequence
    frequencies = [a.count(token) / len(a) for token in range(3)]
    assert frequencies == pytest.approx([0.6, 0.3, 0.1], abs=0.03)  # drawn from softmax(scores)
    chosen, tops = sampling.top_logprobs(probs_of(0.5, 0.3, 0.2), 1, 2)
    assert chosen == pytest.approx(math.log(0.3), rel=1e-4) and [t for t, _ in tops] == [0, 1]
