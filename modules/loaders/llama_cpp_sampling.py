"""Per-request samplers for the llama.cpp backend, built from GenerationParams.

Most requests ask for greedy decoding or plain temperature sampling (with top-k, top-p or min-p, logprobs or not):
those are drawn in numpy straight from the logits row (``PlainSampler``). llama.cpp's chain copies the whole
vocabulary into a candidate array for every token, 0.17 ms a row for greedy and 0.46 ms with temperature on a 49k
vocabulary here, a tenth of a step's time for eight streams of a small model; numpy takes 0.01 and 0.08 ms.
Everything else (penalties, DRY, typical, XTC, mirostat, dynamic temperature, a grammar) uses llama.cpp's sampler
chain, for the whole request. A request whose bias and bans leave no token ends alone with ``NothingToSample``.
"""

from __future__ import annotations

import ctypes
import json
import math
from typing import Any

import llama_cpp
import numpy as np

from modules.errors import InvalidRequest
from modules.generation.params import GenerationParams
from modules.loaders.base import TopLogprob

# Parameters the chain below honours.
SUPPORTED = frozenset(
    {
        "seed", "ban_eos", "min_tokens", "temperature", "dynatemp_range", "dynatemp_exponent", "temperature_last",
        "top_k", "top_p", "min_p", "typical_p", "xtc_threshold", "xtc_probability",
        "repetition_penalty", "repetition_penalty_range", "presence_penalty", "frequency_penalty",
        "dry_multiplier", "dry_base", "dry_allowed_length", "dry_sequence_breakers",
        "mirostat_mode", "mirostat_tau", "mirostat_eta", "logit_bias", "grammar", "json_schema",
        "logprobs", "top_logprobs",
    }
)  # fmt: skip

_TOKEN_DATA = np.dtype([("id", np.intc), ("logit", np.single), ("p", np.single)], align=True)


def schema_to_grammar(schema: dict[str, Any]) -> str:
    """Convert a JSON schema to GBNF; an unsupported or invalid schema is an InvalidRequest."""
    from llama_cpp.llama_grammar import json_schema_to_gbnf

    try:
        return str(json_schema_to_gbnf(json.dumps(schema)))
    except Exception as exc:  # the converter raises plain exceptions on bad schemas
        raise InvalidRequest(f"invalid JSON schema: {exc}", param="response_format") from exc


class RequestSampler:
    """One request's sampler: grammar (kept apart so prompt tokens do not advance it) and the chain."""

    def __init__(
        self,
        vocab: Any,
        n_vocab: int,
        params: GenerationParams,
        eog_tokens: list[int],
        context_length: int,
        grammar: str | None = None,
    ) -> None:
        self.n_vocab = n_vocab
        self.params = params
        self.chain: Any = None
        self.grammar: Any = None
        self.eog_ban: Any = None  # applied while fewer than min_tokens have been generated
        self._keep: list[Any] = []  # ctypes buffers that must outlive the samplers
        self._candidates: np.ndarray | None = None
        self.plain = PlainSampler(n_vocab, params, eog_tokens) if PlainSampler.fits(params, grammar) else None
        if self.plain is not None:
            return
        self.chain = llama_cpp.llama_sampler_chain_init(llama_cpp.llama_sampler_chain_default_params())
        try:
            if grammar:
                sampler = llama_cpp.llama_sampler_init_grammar(vocab, grammar.encode("utf-8"), b"root")
                if not sampler:
                    raise InvalidRequest("the grammar could not be parsed (see the server log)", param="grammar")
                self.grammar = sampler
            self._build(vocab, eog_tokens, context_length)
            if params.min_tokens > 0 and eog_tokens:
                array = (llama_cpp.llama_logit_bias * len(eog_tokens))()
                for i, token in enumerate(eog_tokens):
                    array[i].token, array[i].bias = token, -math.inf
                self._keep.append(array)
                self.eog_ban = llama_cpp.llama_sampler_init_logit_bias(self.n_vocab, len(eog_tokens), array)
        except BaseException:
            self.close()
            raise

    def _add(self, sampler: Any) -> None:
        if not sampler:
            raise InvalidRequest("llama.cpp refused a sampler setting")
        llama_cpp.llama_sampler_chain_add(self.chain, sampler)

    def _build(self, vocab: Any, eog_tokens: list[int], context_length: int) -> None:
        p = self.params
        seed = p.resolved_seed() & 0xFFFFFFFF
        bias = {int(k): float(v) for k, v in p.logit_bias.items() if 0 <= int(k) < self.n_vocab}
        if p.ban_eos:
            bias.update({t: -math.inf for t in eog_tokens})
        if bias:
            array = (llama_cpp.llama_logit_bias * len(bias))()
            for i, (token, value) in enumerate(bias.items()):
                array[i].token, array[i].bias = token, (-math.inf if value <= -100 else value)
            self._keep.append(array)
            self._add(llama_cpp.llama_sampler_init_logit_bias(self.n_vocab, len(bias), array))
        last_n = p.repetition_penalty_range or context_length
        if p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty:
            self._add(
                llama_cpp.llama_sampler_init_penalties(
                    self.n_vocab, last_n, p.repetition_penalty, p.frequency_penalty, p.presence_penalty
                )
            )
        if p.dry_multiplier > 0:
            breakers = (ctypes.c_char_p * len(p.dry_sequence_breakers))(
                *[b.encode("utf-8") for b in p.dry_sequence_breakers]
            )
            self._keep.append(breakers)
            self._add(
                llama_cpp.llama_sampler_init_dry(
                    vocab,
                    p.dry_multiplier,
                    p.dry_base,
                    p.dry_allowed_length,
                    last_n,
                    breakers,
                    len(p.dry_sequence_breakers),
                )
            )
        if p.greedy:
            self._add(llama_cpp.llama_sampler_init_greedy())
            return
        if p.mirostat_mode:
            self._add_temperature()
            if p.mirostat_mode == 1:
                self._add(
                    llama_cpp.llama_sampler_init_mirostat(self.n_vocab, seed, p.mirostat_tau, p.mirostat_eta, 100)
                )
            else:
                self._add(llama_cpp.llama_sampler_init_mirostat_v2(seed, p.mirostat_tau, p.mirostat_eta))
            return
        if not p.temperature_last:
            self._add_temperature()
        if p.top_k > 0:
            self._add(llama_cpp.llama_sampler_init_top_k(p.top_k))
        if p.typical_p < 1.0:
            self._add(llama_cpp.llama_sampler_init_typical(p.typical_p, 1))
        if p.top_p < 1.0:
            self._add(llama_cpp.llama_sampler_init_top_p(p.top_p, 1))
        if p.min_p > 0.0:
            self._add(llama_cpp.llama_sampler_init_min_p(p.min_p, 1))
        if p.xtc_probability > 0.0:
            self._add(llama_cpp.llama_sampler_init_xtc(p.xtc_probability, p.xtc_threshold, 1, seed))
        if p.temperature_last:
            self._add_temperature()
        self._add(llama_cpp.llama_sampler_init_dist(seed))

    def _add_temperature(self) -> None:
        p = self.params
        if p.dynatemp_range > 0:
            self._add(llama_cpp.llama_sampler_init_temp_ext(p.temperature, p.dynatemp_range, p.dynatemp_exponent))
        else:
            self._add(llama_cpp.llama_sampler_init_temp(p.temperature))

    def accept_prompt(self, tokens: list[int]) -> None:
        """Let the penalty samplers see the prompt (the grammar does not: it constrains the reply only)."""
        if self.plain is not None:
            return
        window = self.params.repetition_penalty_range or len(tokens)
        for token in tokens[-window:]:
            llama_cpp.llama_sampler_accept(self.chain, token)

    def sample(
        self, ctx: Any, index: int, generated: int = 0
    ) -> tuple[int, float | None, list[tuple[int, float]] | None]:
        """Sample the next token from output ``index`` of the last decode (``generated`` tokens so far).

        Returns (token, logprob, top candidates) where the log probabilities (when asked for) come from
        the distribution the token was drawn from: after penalties, bias, temperature and truncation.
        """
        if self.plain is not None:
            logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, index), shape=(self.n_vocab,))
            return self.plain.sample(logits, generated)
        want = self.params.logprobs or self.params.top_logprobs > 0
        early = self.eog_ban is not None and generated < self.params.min_tokens
        if self.grammar is None and not want and not early:
            return int(llama_cpp.llama_sampler_sample(self.chain, ctx, index)), None, None
        logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, index), shape=(self.n_vocab,))
        if self._candidates is None:
            self._candidates = np.empty(self.n_vocab, dtype=_TOKEN_DATA)
        cand = self._candidates
        cand["id"] = np.arange(self.n_vocab, dtype=np.intc)
        cand["logit"] = logits
        cand["p"] = 0.0
        array = llama_cpp.llama_token_data_array(
            data=cand.ctypes.data_as(llama_cpp.llama_token_data_p), size=self.n_vocab, selected=-1, sorted=False
        )
        if self.grammar is not None:
            llama_cpp.llama_sampler_apply(self.grammar, ctypes.byref(array))
        if early:
            llama_cpp.llama_sampler_apply(self.eog_ban, ctypes.byref(array))
        llama_cpp.llama_sampler_apply(self.chain, ctypes.byref(array))
        size, selected = int(array.size), int(array.selected)
        if not 0 <= selected < size:
            raise NothingToSample()
        kept = _surviving(cand, array.data, size)
        token = int(kept["id"][selected])
        llama_cpp.llama_sampler_accept(self.chain, token)
        if self.grammar is not None:
            llama_cpp.llama_sampler_accept(self.grammar, token)
        if not want:
            return token, None, None
        scores = kept["logit"].astype(np.float64)
        finite = np.isfinite(scores)
        top = float(scores[finite].max()) if finite.any() else 0.0
        log_z = top + math.log(float(np.exp(scores[finite] - top).sum())) if finite.any() else 0.0
        logprobs = np.where(finite, scores - log_z, -np.inf)
        chosen = float(logprobs[selected])
        alternatives: list[tuple[int, float]] = []
        n = self.params.top_logprobs
        if n > 0:
            order = np.argsort(-logprobs)[:n]
            alternatives = [(int(kept["id"][i]), float(logprobs[i])) for i in order if np.isfinite(logprobs[i])]
        return token, chosen, alternatives

    def close(self) -> None:
        """Free the samplers."""
        if self.chain:
            llama_cpp.llama_sampler_free(self.chain)
            self.chain = None
        for name in ("grammar", "eog_ban"):
            sampler = getattr(self, name)
            if sampler:
                llama_cpp.llama_sampler_free(sampler)
                setattr(self, name, None)
        self._keep.clear()


class NothingToSample(InvalidRequest):
    """Every token is banned for this request (by logit_bias, min_tokens or its grammar): it alone ends."""

    def __init__(self) -> None:
        super().__init__(
            "nothing is left to sample: logit_bias, min_tokens or the grammar bans every token", param="logit_bias"
        )


class PlainSampler:
    """Greedy, or temperature with top-k, top-p and min-p, in llama.cpp's order and with its rules (logit bias
    first; temperature before the truncations, or after them with ``temperature_last``; top-k, then top-p, then
    min-p; greedy takes the first of equal best; logprobs from the distribution drawn from), drawn from the logits
    row with numpy: one uniform number per token from the request's own seeded generator, so a seed gives the same
    reply alone, batched or speculative, with or without logprobs."""

    BLOCK = 1024  # the draw finds its block of the vocabulary first, then the token in it
    TINY = 1e-30  # a temperature below this is greedy (its inverse would overflow float32)

    @staticmethod
    def fits(p: GenerationParams, grammar: str | None = None) -> bool:
        """True when ``p`` asks for nothing beyond what this sampler does."""
        if grammar or p.dry_multiplier > 0:
            return False
        if p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty:
            return False
        return p.greedy or (
            not p.mirostat_mode and p.dynatemp_range <= 0 and p.typical_p >= 1.0 and p.xtc_probability <= 0
        )

    def __init__(self, n_vocab: int, p: GenerationParams, eog_tokens: list[int]) -> None:
        self.p, self.n_vocab = p, n_vocab
        self.greedy = p.greedy or p.temperature < self.TINY
        self.want = p.logprobs or p.top_logprobs > 0
        bias = {int(k): float(v) for k, v in p.logit_bias.items() if 0 <= int(k) < n_vocab}
        if p.ban_eos:
            bias.update({t: -math.inf for t in eog_tokens})
        self.bias_ids = np.array(list(bias), dtype=np.intp)
        self.bias = np.array([-np.inf if v <= -100 else v for v in bias.values()], dtype=np.float32)
        self.eog = np.array(eog_tokens, dtype=np.intp)
        self.rng = np.random.Generator(np.random.PCG64(p.resolved_seed() & 0xFFFFFFFF))
        self.row = np.empty(n_vocab, dtype=np.float32)
        self.starts = np.arange(0, n_vocab, self.BLOCK)

    def sample(
        self, logits: np.ndarray, generated: int = 0
    ) -> tuple[int, float | None, list[tuple[int, float]] | None]:
        """The next token from one row of logits (``generated``: tokens so far, for min_tokens), and when asked
        for, its log probability and the top candidates' (as RequestSampler.sample)."""
        best, top = self._biased(logits, generated)
        if self.greedy:
            if not self.want:
                return best, None, None
            x = self.row  # greedy's logprobs: the biased logits' own distribution, as llama.cpp's chain gives them
            x -= top
            np.exp(x, out=x)
            return best, *self._logprobs(None, x, best)
        kept, weights = self._truncate(top)
        if kept is None:
            token = self._draw(weights)
        elif len(kept) == 1:  # a truncation that left one token: no draw
            token = int(kept[0])
        else:
            cumulative = np.cumsum(weights, dtype=np.float64)
            i = int(np.searchsorted(cumulative, self.rng.random() * cumulative[-1], side="right"))
            token = int(kept[min(i, len(kept) - 1)])
        if not self.want:
            return token, None, None
        return token, *self._logprobs(kept, weights, token)

    def weights(self, logits: np.ndarray, generated: int = 0) -> tuple[np.ndarray | None, np.ndarray]:
        """What a (non-greedy) draw picks from: the tokens left and their unnormalised probabilities, or
        (None, a weight per vocabulary entry) when no truncation applies (that array is reused by the next call)."""
        _, top = self._biased(logits, generated)
        return self._truncate(top)

    def _biased(self, logits: np.ndarray, generated: int) -> tuple[int, float]:
        """Copy the row into ``self.row`` with the bias and bans applied; the best token and its logit."""
        p, x = self.p, self.row
        np.copyto(x, logits)
        if self.bias_ids.size:
            x[self.bias_ids] += self.bias
        if generated < p.min_tokens and self.eog.size:
            x[self.eog] = -np.inf
        best = int(x.argmax())  # the first of equal best, as llama.cpp's greedy sampler
        top = float(x[best])
        if math.isnan(top):  # a model fault: NaN logits count as banned
            x[np.isnan(x)] = -np.inf
            best = int(x.argmax())
            top = float(x[best])
        if top == -math.inf:
            raise NothingToSample()
        if top == math.inf:  # certain: nothing else can be drawn
            x[:] = np.where(x == top, 0.0, -np.inf)
            top = 0.0
        return best, top

    def _truncate(self, top: float) -> tuple[np.ndarray | None, np.ndarray]:
        p, x = self.p, self.row
        # x becomes the logits the truncations see: less the best, over the temperature unless it comes last
        x -= top
        if not p.temperature_last:
            x *= np.float32(1.0 / p.temperature)
        final = 1.0 / p.temperature if p.temperature_last else 1.0  # what turns x into the drawn distribution
        kept: np.ndarray | None = None  # token ids still in the running (None: the whole vocabulary)
        if 0 < p.top_k < self.n_vocab:
            kept = np.argpartition(x, self.n_vocab - p.top_k)[self.n_vocab - p.top_k :]
        if p.top_p < 1.0:
            kept = self._nucleus(x, kept, p.top_p)
        if p.min_p > 0.0:
            floor = math.log(p.min_p)
            kept = np.flatnonzero(x >= floor) if kept is None else kept[x[kept] >= floor]
        if kept is None:  # the whole vocabulary: exponentials in place
            if final != 1.0:
                x *= np.float32(final)
            np.exp(x, out=x)
            return None, x
        return kept, np.exp(x[kept].astype(np.float64) * final)

    def _logprobs(
        self, kept: np.ndarray | None, weights: np.ndarray, token: int
    ) -> tuple[float, list[tuple[int, float]]]:
        """The drawn token's log probability and the top_logprobs most likely tokens' (weights > 0 only)."""
        total = float(weights.sum(dtype=np.float64))
        ids = np.arange(len(weights)) if kept is None else kept
        where = token if kept is None else int(np.flatnonzero(kept == token)[0])
        chosen = math.log(float(weights[where]) / total) if weights[where] > 0 else -math.inf
        n = min(self.p.top_logprobs, len(weights))
        if n <= 0:
            return chosen, []
        most = np.argpartition(-weights, n - 1)[:n] if n < len(weights) else np.arange(len(weights))
        most = most[np.argsort(-weights[most], kind="stable")]
        return chosen, [(int(ids[i]), math.log(float(weights[i]) / total)) for i in most if weights[i] > 0]

    @staticmethod
    def _nucleus(x: np.ndarray, kept: np.ndarray | None, top_p: float) -> np.ndarray:
        """The most likely tokens (of ``kept``) whose probabilities add up to ``top_p``, the one that crosses it
        included. Only the most likely are sorted: the best 64, or 8 times more until they hold enough."""
        ids = np.arange(len(x)) if kept is None else kept
        weights = np.exp(x[ids])
        target = top_p * float(weights.sum(dtype=np.float64))
        best = np.arange(len(ids))
        size = 64
        while size < len(ids):
            part = np.argpartition(weights, len(ids) - size)[len(ids) - size :]
            if float(weights[part].sum(dtype=np.float64)) >= target:
                best = part
                break
            size *= 8
        order = best[np.argsort(-weights[best], kind="stable")]
        n = int(np.searchsorted(np.cumsum(weights[order], dtype=np.float64), target)) + 1
        return ids[order[: min(n, len(order))]]

    def _draw(self, weights: np.ndarray) -> int:
        """A token with probability proportional to ``weights`` (float32, over the whole vocabulary)."""
        blocks = np.add.reduceat(weights, self.starts, dtype=np.float64)
        cumulative = np.cumsum(blocks)
        target = self.rng.random() * cumulative[-1]
        b = min(int(np.searchsorted(cumulative, target, side="right")), len(blocks) - 1)
        start = int(self.starts[b])
        inner = np.cumsum(weights[start : start + self.BLOCK], dtype=np.float64)
        i = start + min(int(np.searchsorted(inner, target - (cumulative[b - 1] if b else 0.0), side="right")),
                        len(inner) - 1)  # fmt: skip
        while weights[i] == 0.0 and i > start:  # rounding at the block's end landed on a dropped token
            i -= 1
        return i


def _surviving(cand: np.ndarray, data: Any, size: int) -> np.ndarray:
    """The candidates the chain left: ``size`` entries from where ``data`` now points.

    Samplers may move the array's start (XTC drops the top choices by advancing ``data``), so the survivors
    are not always at the start of ``cand``.
    """
    address = ctypes.cast(data, ctypes.c_void_p).value or 0
    base, item = cand.ctypes.data, cand.dtype.itemsize
    offset, rest = divmod(address - base, item)
    if rest == 0 and offset >= 0 and offset + size <= len(cand):
        return cand[offset : offset + size]
    # a sampler pointed into a buffer of its own: copy from there
    raw = (ctypes.c_char * (size * item)).from_address(address)
    return np.frombuffer(bytes(raw), dtype=_TOKEN_DATA).copy()


def top_logprobs(pairs: list[tuple[int, float]] | None, piece: Any) -> list[TopLogprob] | None:
    """Turn (token, logprob) pairs into TopLogprob records using ``piece(token) -> bytes``."""
    if pairs is None:
        return None
    return [TopLogprob(token_id=t, piece=piece(t), logprob=lp) for t, lp in pairs]
