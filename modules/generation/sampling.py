"""Logits processors for torch backends: every GenerationParams sampler, as ``(input_ids, scores) -> scores``.

``scores`` are logits of shape (1, vocab); a removed token gets -inf. ``build_chain`` puts them in the
text-generation-webui order: bias and bans, penalties, temperature (unless ``temperature_last``), truncation
samplers, XTC, then temperature last if asked. Mirostat replaces the truncation samplers and picks the token itself.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from modules.generation.params import GenerationParams

Processor = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
NEG_INF = float("-inf")


def _keep_at_least_one(scores: torch.Tensor, remove: torch.Tensor) -> torch.Tensor:
    """Apply a removal mask, but never remove the most likely token."""
    remove = remove.clone()
    remove[0, scores.argmax(dim=-1)] = False
    return scores.masked_fill(remove, NEG_INF)


class LogitBias:
    """Add a bias to token ids' logits; -100 or less bans the token."""

    def __init__(self, bias: dict[int, float], vocab: int) -> None:
        self.ids = torch.tensor([t for t in bias if 0 <= t < vocab], dtype=torch.long)
        self.values = torch.tensor([bias[t] for t in bias if 0 <= t < vocab], dtype=torch.float32)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.ids.numel():
            values = torch.where(self.values <= -100, torch.tensor(NEG_INF), self.values)
            scores[0, self.ids] = scores[0, self.ids] + values
        return scores


class EosBan:
    """Forbid the end-of-sequence tokens always (``ban_eos``) or until ``min_tokens`` new tokens exist."""

    def __init__(self, eos_ids: Sequence[int], prompt_length: int, min_tokens: int, always: bool) -> None:
        self.eos = torch.tensor(list(eos_ids), dtype=torch.long)
        self.prompt_length, self.min_tokens, self.always = prompt_length, min_tokens, always

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        generated = input_ids.shape[-1] - self.prompt_length
        if self.eos.numel() and (self.always or generated < self.min_tokens):
            scores[0, self.eos] = NEG_INF
        return scores


def _window(input_ids: torch.Tensor, size: int) -> torch.Tensor:
    return input_ids[0] if size <= 0 else input_ids[0, -size:]


class RepetitionPenalty:
    """Make tokens seen in the last ``range`` tokens less likely: positive logits / p, negative logits * p."""

    def __init__(self, penalty: float, window: int) -> None:
        self.penalty, self.window = penalty, window

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        seen = torch.unique(_window(input_ids, self.window))
        values = scores[0, seen]
        scores[0, seen] = torch.where(values > 0, values / self.penalty, values * self.penalty)
        return scores


class PresenceFrequencyPenalty:
    """Subtract ``presence`` from every seen token and ``frequency`` times its count (OpenAI's penalties)."""

    def __init__(self, presence: float, frequency: float, window: int) -> None:
        self.presence, self.frequency, self.window = presence, frequency, window

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        tokens, counts = torch.unique(_window(input_ids, self.window), return_counts=True)
        scores[0, tokens] = scores[0, tokens] - self.presence - self.frequency * counts.to(scores.dtype)
        return scores


class NoRepeatNGram:
    """Ban any token that would repeat an n-gram already in the text."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        ids = input_ids[0].tolist()
        if len(ids) < self.n:
            return scores
        prefix = tuple(ids[len(ids) - self.n + 1 :])
        banned = {ids[i + self.n - 1] for i in range(len(ids) - self.n + 1) if tuple(ids[i : i + self.n - 1]) == prefix}
        if banned:
            scores[0, list(banned)] = NEG_INF
        return scores


class DRY:
    """ "Don't Repeat Yourself": penalise a token that would extend a sequence that already occurred.

    If the text ends with a sequence that appeared before followed by token t, t's logit is reduced by
    ``multiplier * base ** (length - allowed_length)`` where ``length`` is the longest such repeat; sequence
    breakers (e.g. newlines) stop a repeat from growing across them.
    """

    def __init__(self, multiplier: float, base: float, allowed_length: int, breakers: set[int], window: int) -> None:
        self.multiplier, self.base, self.allowed = multiplier, base, allowed_length
        self.breakers, self.window = breakers, window

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        ids = _window(input_ids, self.window).tolist()
        if len(ids) < 2 or ids[-1] in self.breakers:
            return scores
        last = len(ids) - 1
        longest: dict[int, int] = {}
        for j in range(last - 1, -1, -1):  # earlier positions holding the same token as the end
            if ids[j] != ids[last]:
                continue
            length = 1
            while j - length >= 0 and ids[j - length] == ids[last - length] and ids[j - length] not in self.breakers:
                length += 1
                if last - length < j:
                    break
            follower = ids[j + 1]
            if follower not in self.breakers and length > longest.get(follower, 0):
                longest[follower] = length
        for token, length in longest.items():
            if length >= self.allowed:
                scores[0, token] = scores[0, token] - self.multiplier * self.base ** (length - self.allowed)
        return scores


class Temperature:
    """Divide logits by the temperature."""

    def __init__(self, temperature: float) -> None:
        self.temperature = temperature

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        return scores / self.temperature


class DynamicTemperature:
    """Temperature between ``t - range`` and ``t + range`` growing with the normalised entropy ** exponent."""

    def __init__(self, temperature: float, spread: float, exponent: float) -> None:
        self.low, self.high, self.exponent = max(0.0, temperature - spread), temperature + spread, exponent

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        finite = torch.isfinite(scores[0])
        count = int(finite.sum())
        if count <= 1:
            return scores
        probs = torch.softmax(scores[0, finite], dim=-1)
        entropy = float(-(probs * torch.log(probs.clamp_min(1e-20))).sum())
        normalised = entropy / math.log(count)
        temperature = self.low + (self.high - self.low) * normalised**self.exponent
        return scores / max(temperature, 1e-6)


class TopK:
    """Keep the k most likely tokens."""

    def __init__(self, k: int) -> None:
        self.k = k

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        k = min(self.k, scores.shape[-1])
        threshold = torch.topk(scores, k, dim=-1).values[..., -1, None]
        return scores.masked_fill(scores < threshold, NEG_INF)


class TopP:
    """Keep the smallest set of most likely tokens whose probabilities add up to p."""

    def __init__(self, p: float) -> None:
        self.p = p

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        sorted_scores, order = torch.sort(scores, descending=True)
        cumulative = torch.softmax(sorted_scores, dim=-1).cumsum(dim=-1)
        remove_sorted = cumulative - torch.softmax(sorted_scores, dim=-1) >= self.p  # mass before this token is enough
        remove = remove_sorted.scatter(1, order, remove_sorted)
        return _keep_at_least_one(scores, remove)


class MinP:
    """Drop tokens whose probability is below ``p`` times the top token's."""

    def __init__(self, p: float) -> None:
        self.p = p

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(scores, dim=-1)
        return _keep_at_least_one(scores, probs < self.p * probs.max(dim=-1, keepdim=True).values)


class TypicalP:
    """Locally typical sampling: keep the tokens whose surprise is closest to the entropy, up to mass p."""

    def __init__(self, p: float) -> None:
        self.p = p

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        log_probs = torch.log_softmax(scores, dim=-1)
        probs = log_probs.exp()
        entropy = -(torch.nan_to_num(probs * log_probs)).sum(dim=-1, keepdim=True)
        deviation = (torch.nan_to_num(-log_probs, posinf=1e9) - entropy).abs()
        _sorted_dev, order = torch.sort(deviation, dim=-1)
        cumulative = probs.gather(-1, order).cumsum(dim=-1)
        last = (cumulative < self.p).sum(dim=-1, keepdim=True)  # index of the token that reaches p
        remove_sorted = torch.arange(scores.shape[-1]).unsqueeze(0) > last  # keeps at least the most typical token
        remove = remove_sorted.scatter(1, order, remove_sorted)
        return scores.masked_fill(remove, NEG_INF)


class TopA:
    """Drop tokens below ``a`` times the square of the top probability."""

    def __init__(self, a: float) -> None:
        self.a = a

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(scores, dim=-1)
        top = probs.max(dim=-1, keepdim=True).values
        return _keep_at_least_one(scores, probs < self.a * top * top)


class TailFree:
    """Tail-free sampling: cut the tail where the second derivative of the sorted probabilities flattens."""

    def __init__(self, z: float) -> None:
        self.z = z

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        sorted_scores, order = torch.sort(scores, descending=True)
        probs = torch.softmax(sorted_scores, dim=-1)
        second = probs.diff(dim=-1).diff(dim=-1).abs()
        normalised = second / second.sum(dim=-1, keepdim=True).clamp_min(1e-20)
        cumulative = normalised.cumsum(dim=-1)
        remove_sorted = torch.cat(
            [
                torch.zeros_like(cumulative[:, :1], dtype=torch.bool),
                cumulative > self.z,
                torch.ones_like(cumulative[:, :1], dtype=torch.bool),
            ],
            dim=-1,
        )
        remove = remove_sorted.scatter(1, order, remove_sorted)
        return _keep_at_least_one(scores, remove)


class EpsilonCutoff:
    """Drop tokens with probability below epsilon (given in units of 1e-4)."""

    def __init__(self, epsilon: float) -> None:
        self.epsilon = epsilon * 1e-4

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        return _keep_at_least_one(scores, torch.softmax(scores, dim=-1) < self.epsilon)


class EtaCutoff:
    """Eta sampling: the cutoff shrinks with the entropy: min(eta, sqrt(eta) * exp(-entropy)), eta in 1e-4 units."""

    def __init__(self, eta: float) -> None:
        self.eta = eta * 1e-4

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        log_probs = torch.log_softmax(scores, dim=-1)
        probs = log_probs.exp()
        entropy = -(torch.nan_to_num(probs * log_probs)).sum(dim=-1, keepdim=True)
        cutoff = torch.minimum(torch.tensor(self.eta), math.sqrt(self.eta) * torch.exp(-entropy))
        return _keep_at_least_one(scores, probs < cutoff)


class XTC:
    """Exclude Top Choices: with some probability, drop every token above the threshold but the least likely one."""

    def __init__(self, threshold: float, probability: float, generator: torch.Generator) -> None:
        self.threshold, self.probability, self.generator = threshold, probability, generator

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if float(torch.rand(1, generator=self.generator)) >= self.probability:
            return scores
        probs = torch.softmax(scores, dim=-1)[0]
        above = (probs >= self.threshold).nonzero().flatten()
        if above.numel() < 2:
            return scores
        keep = above[probs[above].argmin()]
        remove = above[above != keep]
        scores[0, remove] = NEG_INF
        return scores


class Mirostat:
    """Mirostat v1 or v2: keep the surprise near ``tau`` by adapting the truncation; picks the token itself.

    The returned scores leave only the chosen token finite, so the sampler after it takes that token. As in
    the paper and llama.cpp, the observed surprise is that of the chosen token among the ``k`` kept ones.
    """

    def __init__(self, mode: int, tau: float, eta: float, generator: torch.Generator, m: int = 100) -> None:
        self.mode, self.tau, self.eta, self.generator, self.m = mode, tau, eta, generator, m
        self.mu = 2 * tau
        self.k = 0  # how many tokens the last step kept

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(scores[0], dim=-1)
        sorted_probs, order = torch.sort(probs, descending=True)
        if self.mode == 1:
            n = min(self.m, sorted_probs.numel() - 1)
            t = torch.log(torch.arange(2, n + 2, dtype=torch.float64) / torch.arange(1, n + 1, dtype=torch.float64))
            b = torch.log(
                sorted_probs[:n].double().clamp_min(1e-30) / sorted_probs[1 : n + 1].double().clamp_min(1e-30)
            )
            s_hat = float((t * b).sum() / (t * t).sum())
            epsilon = s_hat - 1
            k = (
                int(((epsilon * 2**self.mu) / (1 - sorted_probs.numel() ** -epsilon)) ** (1 / s_hat))
                if epsilon > 0
                else 1
            )
            k = max(1, min(k, sorted_probs.numel()))
            candidates = sorted_probs[:k]
        else:
            surprise = -torch.log2(sorted_probs.clamp_min(1e-30))
            k = max(1, int((surprise <= self.mu).sum()))
            candidates = sorted_probs[:k]
        self.k = k
        kept = candidates / candidates.sum()
        choice = int(torch.multinomial(kept, 1, generator=self.generator))
        token = int(order[choice])
        observed = -math.log2(max(float(kept[choice]), 1e-30))
        self.mu -= self.eta * (observed - self.tau)
        out = torch.full_like(scores, NEG_INF)
        out[0, token] = scores[0, token]
        return out


def build_chain(
    params: GenerationParams,
    *,
    vocab: int,
    eos_ids: Sequence[int],
    prompt_length: int,
    breaker_ids: set[int],
    generator: torch.Generator,
    extra: Sequence[Processor] = (),
) -> list[Processor]:
    """The processors for ``params``, in order (``extra`` are extensions' processors, after the penalties)."""
    p = params
    window = p.repetition_penalty_range
    chain: list[Processor] = []
    if p.logit_bias:
        chain.append(LogitBias(p.logit_bias, vocab))
    if p.ban_eos or p.min_tokens > 0:
        chain.append(EosBan(eos_ids, prompt_length, p.min_tokens, p.ban_eos))
    if p.repetition_penalty != 1.0:
        chain.append(RepetitionPenalty(p.repetition_penalty, window))
    if p.presence_penalty or p.frequency_penalty:
        chain.append(PresenceFrequencyPenalty(p.presence_penalty, p.frequency_penalty, window))
    if p.no_repeat_ngram_size > 0:
        chain.append(NoRepeatNGram(p.no_repeat_ngram_size))
    if p.dry_multiplier > 0:
        chain.append(DRY(p.dry_multiplier, p.dry_base, p.dry_allowed_length, breaker_ids, window))
    chain.extend(extra)
    if p.greedy:
        return chain
    temperature: Processor = (
        DynamicTemperature(p.temperature, p.dynatemp_range, p.dynatemp_exponent)
        if p.dynatemp_range > 0
        else Temperature(p.temperature)
    )
    if p.mirostat_mode:
        return [*chain, temperature, Mirostat(p.mirostat_mode, p.mirostat_tau, p.mirostat_eta, generator)]
    if not p.temperature_last:
        chain.append(temperature)
    if p.top_k > 0:
        chain.append(TopK(p.top_k))
    if p.top_p < 1.0:
        chain.append(TopP(p.top_p))
    if p.typical_p < 1.0:
        chain.append(TypicalP(p.typical_p))
    if p.epsilon_cutoff > 0:
        chain.append(EpsilonCutoff(p.epsilon_cutoff))
    if p.eta_cutoff > 0:
        chain.append(EtaCutoff(p.eta_cutoff))
    if p.tfs < 1.0:
        chain.append(TailFree(p.tfs))
    if p.top_a > 0:
        chain.append(TopA(p.top_a))
    if p.min_p > 0:
        chain.append(MinP(p.min_p))
    if p.xtc_probability > 0:
        chain.append(XTC(p.xtc_threshold, p.xtc_probability, generator))
    if p.temperature_last:
        chain.append(temperature)
    return chain


def apply(chain: Sequence[Processor], input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """Run the processors in order."""
    for processor in chain:
        scores = processor(input_ids, scores)
    return scores


def sample(scores: torch.Tensor, greedy: bool, generator: torch.Generator) -> int:
    """The next token: the most likely one when greedy, else drawn from softmax(scores)."""
    if greedy:
        return int(scores.argmax(dim=-1))
    probs = torch.softmax(scores.float(), dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


def top_logprobs(scores: torch.Tensor, token: int, n: int) -> tuple[float, list[tuple[int, float]]]:
    """The chosen token's log probability under ``scores`` and the ``n`` most likely alternatives."""
    log_probs = torch.log_softmax(scores.float(), dim=-1)[0]
    chosen = float(log_probs[token])
    if n <= 0:
        return chosen, []
    values, ids = torch.topk(log_probs, min(n, log_probs.numel()))
    return chosen, [(int(i), float(v)) for i, v in zip(ids, values, strict=True) if math.isfinite(float(v))]


SUPPORTED: frozenset[str] = frozenset(GenerationParams.field_names())  # grammar and json_schema via xgrammar
