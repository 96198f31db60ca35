"""Speculative decoding for the llama.cpp scheduler.

A drafter guesses the next tokens of a sequence: by prompt lookup (the latest earlier place where the text so far
ends the same way, and what followed it there) or with a small draft model (``--draft-model``, greedy). The
scheduler feeds the pending token and the draft to the target model in the same batched step and samples every
row in turn with the request's own sampler; a row whose sample equals the draft token confirms it and the next
row is read, the first that differs (or the row after the whole draft) gives the token that goes on. For a draft
that is one token (prompt lookup, greedy drafting) this is exactly the standard acceptance rule: the token is kept
with the target's probability of it and a rejection draws from the rest, so the output is what the target model
alone would sample (greedy: the same tokens; seeded sampling: the same random draws, one per token).

How many tokens to draft is chosen per step from the request's acceptance rate so far and the cost of a step
(a one-token step's own time, ``base + per_token * n`` from two tokens up, fitted to the scheduler's own steps): a
draft is taken only when the tokens it is expected to yield per second beat the step's own, so speculation backs off
when drafts are rejected and when many busy slots already fill the step.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import llama_cpp
import numpy as np
from llama_cpp._internals import LlamaBatch, LlamaContext, LlamaModel

from modules.errors import ModelLoadError

log = logging.getLogger(__name__)

MAX_NGRAM = 4  # longest suffix looked up
MAX_DEPTH = 64  # longest draft (the --draft-max bound)
PRIOR_WEIGHT = 2.0  # pseudo-counts a request's acceptance starts from
PRIOR_FIRST = 0.35  # the first depth's prior: below what pays, so drafting starts once undrafted candidates held
PROBE_EVERY = 16  # a draft model that stopped paying drafts one token this often, to notice when it pays again
DOUBT_AFTER = 4  # a lone sequence's last guesses held this many times undrafted: doubt the step-cost fit
FRESH_MIN = 0.98**150  # a one-token step not seen for ~150 steps (StepCost.fresh): make one
GROWTH = 2  # a draft is at most this plus twice the tokens that held in the last verification
DECAY = 0.95  # older verifications weigh less, so a change of text (prose after a copied block) is followed


class NgramIndex:
    """Where each n-gram (n = 1..MAX_NGRAM) of a growing token list last occurred, and what followed it."""

    def __init__(self, tokens: list[int]) -> None:
        self.tokens: list[int] = []
        self._next: list[dict[tuple[int, ...], int]] = [{} for _ in range(MAX_NGRAM + 1)]
        for token in tokens:
            self.append(token)

    def append(self, token: int) -> None:
        """Add a token: every n-gram that ends just before it now has a known continuation (this token)."""
        tokens = self.tokens
        end = len(tokens)
        for n in range(1, min(MAX_NGRAM, end) + 1):
            self._next[n][tuple(tokens[end - n : end])] = end
        tokens.append(token)

    def draft(self, limit: int) -> tuple[list[int], int]:
        """Up to ``limit`` tokens that followed the longest earlier match of the list's end, and that match's n."""
        tokens = self.tokens
        for n in range(min(MAX_NGRAM, len(tokens)), 0, -1):
            start = self._next[n].get(tuple(tokens[-n:]))
            if start is not None:
                return tokens[start : start + limit], n
        return [], 0


class Acceptance:
    """Decayed counts, at each depth of a draft, of how often its token held when the ones before it did.

    Depths are kept apart because drafts hold in runs: a copied passage either goes on or it does not, so the
    fifth token of a draft whose first four held is far likelier to hold than a first one.
    """

    def __init__(self) -> None:
        self.tried = [0.0] * MAX_DEPTH
        self.held = [0.0] * MAX_DEPTH

    def rate(self, depth: int = 0) -> float:
        """The chance the draft's token at ``depth`` holds given the ones before it did (a prior of weight
        ``PRIOR_WEIGHT`` on the depth before's rate, and on PRIOR_FIRST at the first depth)."""
        prior = PRIOR_FIRST
        for j in range(depth + 1):
            prior = (self.held[j] + PRIOR_WEIGHT * prior) / (self.tried[j] + PRIOR_WEIGHT)
        return prior

    def rates(self, limit: int) -> list[float]:
        """``rate(j)`` for j = 0..limit-1."""
        out, prior = [], PRIOR_FIRST
        for j in range(min(limit, MAX_DEPTH)):
            prior = (self.held[j] + PRIOR_WEIGHT * prior) / (self.tried[j] + PRIOR_WEIGHT)
            out.append(prior)
        return out

    def update(self, drafted: int, accepted: int) -> None:
        """A draft of ``drafted`` tokens whose first ``accepted`` held."""
        for j in range(min(accepted + 1, drafted, MAX_DEPTH)):
            self.tried[j] = self.tried[j] * DECAY + 1.0
            self.held[j] = self.held[j] * DECAY + (1.0 if j < accepted else 0.0)


@dataclass
class SpecState:
    """One request's speculation: its drafter state, acceptance per match length, totals for its stats."""

    index: NgramIndex | None = None
    acceptance: dict[int, Acceptance] = field(default_factory=dict)  # by n-gram length (0: the draft model)
    draft: list[int] = field(default_factory=list)  # the tokens in flight this step
    source: int = 0  # which acceptance record the draft in flight belongs to
    shadow: int | None = None  # a candidate not drafted this step: checked against what comes, for free
    idle: int = 0  # steps since the last draft (a draft model probes after PROBE_EVERY)
    run: int = 0  # draft tokens that held in the last verification (a held candidate not drafted: 1)
    held: int = 0  # candidates not drafted that held, in a row
    drafted: int = 0
    accepted: int = 0

    def record(self, first_token: int, accepted: int) -> None:
        """After a verification: ``accepted`` draft tokens held; ``first_token`` is the step's first sample."""
        if self.draft:
            self.acceptance.setdefault(self.source, Acceptance()).update(len(self.draft), accepted)
            self.run = accepted
            self.held = 0
        elif self.shadow is not None:
            self.run = int(self.shadow == first_token)
            self.acceptance.setdefault(self.source, Acceptance()).update(1, self.run)
            self.held = self.held + 1 if self.run else 0
        self.draft, self.shadow = [], None


def best_length(
    rates: float | list[float],
    limit: int,
    step_tokens: float,
    step_time: float,
    per_token: float | Callable[[int], float],
    switch: tuple[int, int, float] = (0, 0, 0.0),
) -> tuple[int, float]:
    """The draft length (0..limit) that most raises the step's tokens per second, 0 when none does, and the
    draft tokens it is expected to yield. ``rates``: the chance each depth holds given the ones before did (one
    number: the same at every depth). ``per_token``: what each draft token adds to the step's time, or a function
    of k giving what k of them add. ``switch``: (tokens in the step so far, tokens in the last step, the cost of
    a step of another size than the last): llama.cpp reuses the last step's compute graph only for a step of the
    same size, so a draft that changes the size pays for a new graph."""
    size, last, penalty = switch
    depth_rates = [rates] * limit if isinstance(rates, float) else rates[:limit]
    best, best_gain = 0, 0.0
    best_speed = step_tokens / (step_time + (penalty if size != last else 0.0))
    reach, gain = 1.0, 0.0
    for k, rate in enumerate(depth_rates, start=1):
        reach *= rate  # the chance all of the first k hold
        gain += reach
        extra = per_token(k) if callable(per_token) else per_token * k
        speed = (step_tokens + gain) / (step_time + extra + (penalty if size + k != last else 0.0))
        if speed > best_speed * 1.001:
            best, best_gain, best_speed = k, gain, speed
    return best, best_gain


def expected_gain(rates: list[float]) -> float:
    """The draft tokens a draft is expected to yield, given each depth's chance to hold when the ones before did."""
    reach, gain = 1.0, 0.0
    for rate in rates:
        reach *= rate
        gain += reach
    return gain


class StepCost:
    """Step time by size, in seconds, fitted to the scheduler's own decode steps (steps that feed a prompt are not
    counted): a one-token step on its own, and ``base + per_token * tokens`` for two tokens and more, plus ``switch``
    for a step of another size than the one before (llama.cpp then builds a new compute graph: ~2.2 ms on the Intel
    machine, 0.4 ms on the AMD one). One token is apart because the CPU backend multiplies a single row another way
    than several: on the AMD EPYC a two-token step cost twice a one-token one (13.5 vs 6.6 ms) while each token after
    that added 3.1 ms; a line through all sizes saw drafts as dear and long drafts as dearer still, and barely drafted.

    The line is a decayed least-squares fit (on times less the switch cost; the switch cost from what steps of a new
    size took beyond the model). Until steps of two sizes from 2 up have been seen, it keeps the shape measured for
    small models on a CPU (``base`` = 1.3 ``per_token``) through their mean, or through the one-token time before any
    was seen. There are no calibration decodes at load time: a first decode of another shape than the scheduler's
    slowed every later step of that context by a third.

    The machine's speed drifts (another program, the CPU's clock) while the ratio of one size to another holds, and
    the line learns only from drafts. Fitted in seconds, a line taken in a busy spell kept drafts looking dear for the
    server's life, and a one-token time taken then stayed while drafts made one-token steps rare (measured on the AMD
    EPYC, rewrites after two beside a busy process: none drafted, the two-token step kept at 72.8 ms against a
    one-token 10.5-11.0; in another run 138 tokens a rewrite with the one-token step kept at 28.2 ms, 0.83x a server
    without the spell). So the line is read scaled by the one-token step now against the one-token step while its
    steps were seen, as far as one-token steps came then (``fresh``: a one-token time long unseen tells nothing);
    the one-token time weighs its latest steps whatever came between; and what the line and the switch cost know
    ages at every step that teaches them nothing, back to the prior (that shape, no switch cost): the weight halves
    in ~350 such steps. That alone took ~2,800 plain steps to undo a line that made drafts look four times as dear
    as they are, and a full bench run still drafted nothing after the spell; so the planner also doubts the fit
    (``doubt``) when a lone request's guesses keep holding undrafted (its last four guesses, steps without one not
    counted), and it then ages four times as fast as it learns. The other way round, a lone request drafting at every
    step would keep a one-token time from a slow spell, which makes every draft look cheap: after ~150 steps without
    a one-token step it makes one (not while another request's prompt is fed beside it), whose time replaces the old.
    """

    SHAPE = 1.3
    DECAY = 0.98
    AGE = 0.998  # what the line and the switch cost know ages by this at each step that teaches them nothing
    PRIOR = 0.5  # the weight of the prior against their decayed count of steps
    DOUBT = DECAY**4  # what they know ages by this at each doubt (``doubt``)
    SWITCH_MAX = 0.5  # of a one-token step (measured: 0.21 on the Intel machine, 0.05 on the AMD one)

    def __init__(self, base: float = 0.0065, per_token: float = 0.005) -> None:
        self.one: float | None = None  # a one-token step, once seen
        self.switch = 0.0
        self.last = 0  # tokens in the last step
        self._initial = (base, per_token)  # the line before any step was seen
        self._fitted = (base, per_token)  # the line the steps of 2+ tokens give, in seconds when they were seen
        self._one = [0.0, 0.0]  # one-token steps: (weight, seconds), decayed at every step (drafts make them rare)
        self.fresh = 0.0  # 1 at a one-token step, decayed at every other: how lately ``one`` was seen
        self._spread = False  # the line has seen steps of two sizes or more (a switch cost can be told from it)
        # steps of 2+ tokens, decayed: weight, tokens, seconds, tokens^2, tokens*seconds; and the weight and sum of
        # the one-token step's time when they were seen, each weighed by how fresh it was then
        self._sums = [0.0] * 7
        self._residual = [[0.0, 0.0], [0.0, 0.0]]  # [same size, new size]: decayed (weight, sum of time - model)
        self._now = (base, per_token)  # (base, per_token) as read now: set where what it is read from changes

    @property
    def base(self) -> float:
        return self._now[0]

    @property
    def per_token(self) -> float:
        return self._now[1]

    def _read(self) -> None:
        """The line now: the fitted line at today's speed, drawn towards the prior by how little it saw."""
        weight, then_weight, then = self._sums[0], self._sums[5], self._sums[6]
        if self.one is None:
            prior = self._initial
        else:  # the shape through the one-token step
            prior = (self.SHAPE * self.one / (1 + self.SHAPE), self.one / (1 + self.SHAPE))
        if weight < 1e-9:
            self._now = prior
            return
        scale = 1.0
        if self.one is not None and then > 0:  # by how much the line's steps came with a one-token time of their day
            scale += (self.one * then_weight / then - 1.0) * then_weight / weight
        kept = weight / (weight + self.PRIOR)
        base, per_token = self._fitted
        self._now = (kept * base * scale + (1 - kept) * prior[0], kept * per_token * scale + (1 - kept) * prior[1])

    def time(self, tokens: int) -> float:
        if tokens == 1 and self.one is not None:
            return self.one
        base, per_token = self._now
        return base + per_token * tokens

    def doubt(self) -> None:
        """The planner declined the guess of a lone sequence whose last guesses all held undrafted: what the line
        and the switch cost know ages by ``DOUBT`` (four of their own steps), so a fit that makes drafts look dear
        (taken in a busy spell) gives way to the prior within a few dozen such steps, and the drafts that follow
        measure the machine again."""
        self._sums = [x * self.DOUBT for x in self._sums]
        new = self._residual[1]
        new[0], new[1] = new[0] * self.DOUBT, new[1] * self.DOUBT
        self._read()

    def step(self, tokens: int, seconds: float, pure: bool = True) -> None:
        """Count one decode step of ``tokens`` tokens that took ``seconds`` (``pure``: it fed no prompt)."""
        changed = tokens != self.last
        self.last = tokens
        if pure:
            self.observe(tokens, seconds, changed)

    def observe(self, tokens: int, seconds: float, changed: bool = False) -> None:
        """Fit one decode step of ``tokens`` tokens that took ``seconds`` (``changed``: another size than the last)."""
        same, new = self._residual
        seen, other = (new, same) if changed else (same, new)
        seen[0], seen[1] = seen[0] * self.DECAY + 1.0, seen[1] * self.DECAY + seconds - self.time(tokens)
        other[0], other[1] = other[0] * self.AGE, other[1] * self.AGE
        if same[0] > 0.5 and new[0] > 1e-9 and self._spread:  # what a new size took beyond the model, drawn to none
            # while it is old (with one size of draft, the line's misfit at other sizes would read as a switch cost)
            self.switch = max(0.0, new[1] / new[0] - same[1] / same[0]) * new[0] / (new[0] + self.PRIOR)
            # a new graph costs a fraction of a step; beyond it, the line has not caught up
            self.switch = min(self.switch, self.SWITCH_MAX * self.time(1))
        else:  # not told now: what was told ages as the rest
            self.switch *= self.AGE
        if changed:  # what the step took less the new graph, at least half of it (never a negative time)
            seconds = max(seconds - self.switch, seconds * (1 - self.SWITCH_MAX))
        if tokens == 1:
            if self.fresh < FRESH_MIN:  # a one-token time long unseen: this step replaces it
                self._one = [0.0, 0.0]
            self._one = [self._one[0] * self.DECAY + 1.0, self._one[1] * self.DECAY + seconds]
            self.one = self._one[1] / self._one[0]
            self._sums = [x * self.AGE for x in self._sums]
            self.fresh = 1.0
            self._read()
            return
        self._one = [x * self.DECAY for x in self._one]  # older: the next one-token step counts for more
        self.fresh *= self.DECAY
        seen_one = (self.fresh, self.fresh * self.one) if self.one is not None else (0.0, 0.0)
        sums = [x * self.DECAY for x in self._sums]
        for i, value in enumerate((1.0, tokens, seconds, tokens * tokens, tokens * seconds, *seen_one)):
            sums[i] += value
        self._sums = sums
        weight, n, t, nn, nt = sums[:5]
        mean_n, mean_t = n / weight, t / weight
        shaped = mean_t / (mean_n + self.SHAPE)
        variance = nn / weight - mean_n**2
        self._spread = variance > 0.25
        slope = (nt / weight - mean_n * mean_t) / variance if self._spread else shaped
        per_token = min(max(slope, 0.2 * shaped), mean_t / mean_n)
        self._fitted = (max(mean_t - per_token * mean_n, 1e-4), per_token)
        self._read()


@dataclass
class Work:
    """A decoding sequence the speculator may draft for this step."""

    seq_id: int
    state: SpecState
    tokens: list[int]  # what the sequence holds and the token about to be fed (for a draft model)
    limit: int  # most draft tokens it may take (room left in its reply, its context and the batch)


class Speculator:
    """Chooses and makes the drafts of one step, for every decoding sequence."""

    def __init__(
        self, cost: StepCost, draft_max: int, draft_model: DraftModel | None = None, draft_min: int = 0
    ) -> None:
        self.cost, self.draft_max, self.draft_model = cost, draft_max, draft_model
        self.draft_min = min(draft_min, draft_max)  # drafts of at least this many whenever there is a guess
        self.drafted = 0  # totals for /metrics
        self.accepted = 0

    def plan(self, work: list[Work], room: int, alone: bool = True) -> int:
        """Set each sequence's draft (``state.draft``, at most ``room`` tokens in all); returns how many.
        ``alone``: no prompt is fed in this step (so a step of one token measures a one-token step)."""
        stale = self.cost.one is not None and self.cost.fresh < FRESH_MIN
        if alone and len(work) == 1 and stale and not self.draft_min:
            return 0  # a lone sequence drafting at every step: one plain step now and then measures one token again
        step_tokens = float(len(work))
        step_time = self.cost.time(len(work))
        wanted: list[tuple[int, list[int], int]] = []
        total = 0
        for item in work:
            state = item.state
            limit = min(item.limit, self.draft_max, room - total)
            if limit <= 0:
                continue
            if self.draft_model is not None:
                state.source = 0
                candidate: list[int] | None = None
            else:
                assert state.index is not None
                candidate, state.source = state.index.draft(limit)
                if not candidate:
                    continue
                limit = len(candidate)
            # drafts grow with the run that last held, not at once (a long draft on thin evidence costs open text)
            limit = min(limit, max(GROWTH + 2 * state.run, self.draft_min))
            rates = state.acceptance.setdefault(state.source, Acceptance()).rates(limit)
            size = len(work) + total
            switch = (size, self.cost.last, self.cost.switch)
            k, gain = best_length(rates, limit, step_tokens, step_time, self._extra(size), switch)
            if k < self.draft_min:  # drafting forced on (--draft-min): the planner's estimate is overruled
                k = min(self.draft_min, limit)
                gain = expected_gain(rates[:k])
            if k == 0 and candidate is None:  # a draft model's guess is not free to check: probe now and then
                state.idle += 1
                if state.idle >= PROBE_EVERY:
                    k, gain = 1, rates[0]
            if k == 0:
                state.shadow = candidate[0] if candidate else None
                if candidate and len(work) == 1 and state.held >= DOUBT_AFTER:
                    self.cost.doubt()  # guesses keep holding undrafted: a fit that says no draft pays may be stale
                continue
            state.idle = 0
            step_tokens += gain
            total += k
            step_time = self.cost.time(len(work) + total)
            state.drafted += k
            self.drafted += k
            if candidate is not None:
                state.draft = candidate[:k]
            else:
                wanted.append((item.seq_id, item.tokens, k))
        if wanted and self.draft_model is not None:
            by_seq = {item.seq_id: item.state for item in work}
            try:
                drafts = self.draft_model.draft(wanted, CATCH_UP if len(work) > 1 else CATCH_UP_ALONE)
            except Exception:  # the target's step goes on without drafts
                log.exception("the draft model failed; this step runs without drafts")
                drafts = {}
                for seq_id, _, k in wanted:
                    by_seq[seq_id].drafted -= k
                    self.drafted -= k
            for seq_id, _, k in wanted:
                if seq_id in drafts:
                    by_seq[seq_id].draft = drafts[seq_id]
                else:  # still catching up with its prompt: ask again next step, so the catching up goes on
                    by_seq[seq_id].drafted -= k
                    self.drafted -= k
                    by_seq[seq_id].idle = PROBE_EVERY
        return total

    def _extra(self, size: int) -> Callable[[int], float]:
        """What k draft tokens add to a step of ``size`` tokens."""
        cost = self.cost
        before = cost.time(size)
        return lambda k: cost.time(size + k) - before

    def confirmed(self, state: SpecState) -> None:
        """One draft token of ``state`` held."""
        state.accepted += 1
        self.accepted += 1

    def close(self) -> None:
        if self.draft_model is not None:
            self.draft_model.close()
            self.draft_model = None


CATCH_UP = 128  # prompt tokens the draft model reads per step while other sequences decode (as the target's prefill)
CATCH_UP_ALONE = 512


class DraftModel:
    """A small GGUF that drafts greedily for the scheduler's sequences, in a context of its own."""

    def __init__(
        self,
        path: Path,
        target: Any,
        n_ctx: int,
        parallel: int,
        threads: int,
        flash_attn: int,
        model_params: Any,
    ) -> None:
        """``target``: the target model (a LlamaModel); ``model_params``: the target's load parameters (GPU
        layers, the AMX guard's extra buffers), used for the draft too."""
        try:
            self.model = LlamaModel(path_model=str(path), params=model_params, verbose=False)
        except (ValueError, OSError) as exc:
            raise ModelLoadError(f"llama.cpp could not load the draft model {path.name}: {exc}") from exc
        try:
            ours, theirs = self.model.n_vocab(), target.n_vocab()
            # llama.cpp's own rule: vocabularies may differ by padding (up to 128 tokens), the shared part must agree
            if abs(ours - theirs) > 128 or not _same_vocab(self.model.vocab, target.vocab, min(ours, theirs)):
                raise ModelLoadError(
                    f"the draft model {path.name} has another vocabulary than the model it drafts for "
                    f"({ours} vs {theirs} tokens): pick a draft model of the same family"
                )
            if llama_cpp.llama_model_is_recurrent(self.model.model) or llama_cpp.llama_model_is_hybrid(
                self.model.model
            ):
                raise ModelLoadError(
                    f"the draft model {path.name} is a recurrent or hybrid model, whose state cannot drop rejected "
                    "draft tokens: pick a transformer"
                )
            ctx_params = llama_cpp.llama_context_default_params()
            ctx_params.n_ctx, ctx_params.n_seq_max = n_ctx * parallel, parallel
            ctx_params.n_batch = ctx_params.n_ubatch = 512
            ctx_params.n_threads = ctx_params.n_threads_batch = threads
            ctx_params.no_perf = True
            ctx_params.flash_attn_type = flash_attn  # as the target's
            self.ctx = LlamaContext(model=self.model, params=ctx_params, verbose=False)
        except BaseException:
            self.model.close()
            raise
        self.n_vocab = ours
        self.usable = min(ours, theirs)  # a drafted token must exist in the target's vocabulary
        self.batch = LlamaBatch(n_tokens=512, embd=0, n_seq_max=1, verbose=False)
        self.tokens: list[list[int]] = [[] for _ in range(parallel)]  # what the draft KV holds per sequence

    def close(self) -> None:
        self.batch.close()
        self.ctx.close()
        self.model.close()

    def _decode(self, items: list[tuple[int, int, int, bool]]) -> None:
        raw = self.batch.batch
        for j, (token, pos, seq, logits) in enumerate(items):
            raw.token[j], raw.pos[j], raw.n_seq_id[j] = token, pos, 1
            raw.seq_id[j][0], raw.logits[j] = seq, logits
        raw.n_tokens = len(items)
        if llama_cpp.llama_decode(self.ctx.ctx, raw) != 0:
            raise RuntimeError("llama_decode failed in the draft model")
        for token, _, seq, _ in items:  # the draft cache now holds them
            self.tokens[seq].append(token)

    def _argmax(self, row: int) -> int:
        logits = llama_cpp.llama_get_logits_ith(self.ctx.ctx, row)
        return int(np.ctypeslib.as_array(logits, shape=(self.n_vocab,))[: self.usable].argmax())

    def draft(self, wanted: list[tuple[int, list[int], int]], budget: int = CATCH_UP_ALONE) -> dict[int, list[int]]:
        """For each (seq_id, tokens so far, k): k greedy tokens after ``tokens``. Each sequence catches up alone
        (its new tokens, in chunks; its first guess read from its own last chunk), then all step together. At most
        ``budget`` tokens of catching up per call (a long prompt would freeze the other streams): a sequence that
        is not caught up yet gets no draft this time."""
        out: dict[int, list[int]] = {}
        limits = {seq: k for seq, _, k in wanted}
        try:
            behind = []
            for seq, tokens, _ in wanted:
                held = self.tokens[seq]
                keep = min(common_prefix(held, tokens), len(tokens) - 1)  # the last token is fed again for its logits
                if keep < len(held):
                    self.ctx.kv_cache_seq_rm(seq, keep, -1)
                    del held[keep:]
                behind.append((len(tokens) - keep, seq, keep, tokens[keep:]))
            for _, seq, keep, rest in sorted(behind):  # the nearly caught up first: one long prompt waits alone
                if len(rest) > budget:
                    for start in range(0, budget, 512):
                        chunk = rest[start : min(start + 512, budget)]
                        self._decode([(t, keep + start + j, seq, False) for j, t in enumerate(chunk)])
                    budget = 0
                    continue
                budget -= len(rest)
                row = 0
                for start in range(0, len(rest), 512):
                    chunk = rest[start : start + 512]
                    last = start + len(chunk) == len(rest)
                    items = [(t, keep + start + j, seq, last and j == len(chunk) - 1) for j, t in enumerate(chunk)]
                    self._decode(items)
                    row = len(chunk) - 1
                out[seq] = [self._argmax(row)]  # read before the next sequence's decode replaces the logits
            while True:
                items = [(out[seq][-1], len(self.tokens[seq]), seq, True) for seq in out if len(out[seq]) < limits[seq]]
                if not items:
                    return out
                self._decode(items)
                for j, (_, _, seq, _) in enumerate(items):
                    out[seq].append(self._argmax(j))
        except Exception:
            for seq, _, _ in wanted:  # whatever the cache holds now is unknown: start these sequences afresh
                self.forget(seq)
            raise

    def forget(self, seq: int) -> None:
        self.ctx.kv_cache_seq_rm(seq, 0, -1)
        self.tokens[seq].clear()


def start_speculation(
    target: LlamaModel,
    options: dict[str, Any],
    n_ctx: int,
    parallel: int,
    threads: int,
    flash_attn: int,
    model_params: Any,
) -> Speculator | None:
    """The speculator for a loaded model (None for recurrent and hybrid models, whose state cannot drop rejected
    drafts); loads ``options["draft_model"]`` when set (ModelLoadError when it cannot be used)."""
    if llama_cpp.llama_model_is_recurrent(target.model) or llama_cpp.llama_model_is_hybrid(target.model):
        log.info("Speculative decoding off: a recurrent or hybrid model's state cannot drop rejected drafts")
        return None
    draft = None
    if options.get("draft_model"):
        path = draft_path(options["draft_model"])
        draft = DraftModel(path, target, n_ctx, parallel, threads, flash_attn, model_params)
    log.info(
        "Speculative decoding on (%s)",
        f"draft model {draft_path(options['draft_model']).name}" if draft else "prompt lookup",
    )
    draft_max = int(options.get("draft_max") or 16)
    return Speculator(StepCost(), draft_max, draft, int(options.get("draft_min") or 0))


def draft_path(value: str | Path) -> Path:
    """The draft model's file: as given, else a file or the first GGUF of a folder of that name under models/."""
    path = Path(value).expanduser()
    if not path.is_absolute() and not path.exists():
        from modules import shared

        path = shared.models_dir() / path
    if path.is_dir():  # not a vision projector (mmproj-*.gguf) that sorts first
        ggufs = sorted(p for p in path.glob("*.gguf") if not p.name.lower().startswith("mmproj"))
        if ggufs:
            return ggufs[0]
    return path


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens two lists share."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    x, y = np.asarray(a[:n], dtype=np.int32), np.asarray(b[:n], dtype=np.int32)
    diff = np.flatnonzero(x != y)
    return int(diff[0]) if diff.size else n


def _same_vocab(a: Any, b: Any, n_vocab: int) -> bool:
    """The two vocabularies spell a sample of tokens (the first 256, then every 97th) the same."""
    for token in [*range(min(256, n_vocab)), *range(256, n_vocab, 97)]:
        if llama_cpp.llama_vocab_get_text(a, token) != llama_cpp.llama_vocab_get_text(b, token):
            return False
    return True
