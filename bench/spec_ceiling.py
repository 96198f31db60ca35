"""What speculation can reach on this CPU for the rewrite benchmark: the step costs measured with ``llama_decode``, and
the recorded greedy reply replayed through them with our planner, fixed draft lengths and an oracle.

Each step feeds the pending token and a draft of k tokens (prompt lookup: what followed the latest match) and
costs ``t(1 + k)`` (plus the graph switch when the step's size differs from the last one's); it yields the pending
token and every draft token that holds. Plain decoding is ``t(1)`` a token. The oracle drafts exactly the run of
the candidate that will hold (so no step pays for a rejected token) when that is quicker than plain steps: it knows
where the model will depart from the text, which no drafter is told. "Known odds" is the planner's decision rule
(``best_length``) fed this reply's own odds, measured after the fact: the chance that the next candidate token holds
after a streak of s that held in a row. It is not a bound: our planner keeps its odds by place in a draft, not by
streak, and has beaten it in some runs (AMD EPYC, 2026-12-05 13:09: 1.31x against 1.25x). What it shows is that
knowing the average odds in advance is far from the oracle: the rest is where in the text the model departs.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from bench.common import MODEL
from bench.llama_engine import EOG_BIAS_IDS, SPEC_TOKENS, TEXT_PROMPT, THREADS

SIZES = (1, 2, 3, 4, 5, 6, 8, 12, 16)
REPEATS = 15
POOL = 8  # streaks of this many and more share one odds in "known odds" (fewer cases each beyond)


def _decode_costs(prompt: list[int]) -> tuple[dict[int, float], float]:
    """Median seconds of one decode step of n tokens at the end of ``prompt`` (n in SIZES, the same size again and
    again: llama.cpp reuses the graph), and the extra cost of a one-token step after a step of another size."""
    import llama_cpp
    from llama_cpp._internals import LlamaBatch, LlamaContext, LlamaModel

    llama_cpp.llama_backend_init()
    model = LlamaModel(path_model=str(MODEL), params=llama_cpp.llama_model_default_params(), verbose=False)
    params = llama_cpp.llama_context_default_params()
    params.n_ctx, params.n_batch, params.n_ubatch = 4096, 512, 512
    params.n_threads = params.n_threads_batch = THREADS
    params.flash_attn_type = 0  # as the backend on the CPU
    ctx = LlamaContext(model=model, params=params, verbose=False)
    holder = LlamaBatch(n_tokens=512, embd=0, n_seq_max=1, verbose=False)
    batch = holder.batch

    def decode(tokens: list[int], start: int, logits: bool) -> float:
        for j, token in enumerate(tokens):
            batch.token[j], batch.pos[j], batch.n_seq_id[j] = token, start + j, 1
            batch.seq_id[j][0], batch.logits[j] = 0, logits
        batch.n_tokens = len(tokens)
        began = time.perf_counter()
        assert llama_cpp.llama_decode(ctx.ctx, batch) == 0
        return time.perf_counter() - began

    for start in range(0, len(prompt), 512):
        decode(prompt[start : start + 512], start, False)
    end = len(prompt)
    costs: dict[int, float] = {}
    for n in SIZES:
        times = []
        for _ in range(REPEATS + 2):
            times.append(decode(prompt[-n:], end, True))
            llama_cpp.llama_memory_seq_rm(llama_cpp.llama_get_memory(ctx.ctx), 0, end, -1)
        costs[n] = statistics.median(times[2:])
    switched = []
    for _ in range(REPEATS):
        decode(prompt[-4:], end, True)
        llama_cpp.llama_memory_seq_rm(llama_cpp.llama_get_memory(ctx.ctx), 0, end, -1)
        switched.append(decode(prompt[-1:], end, True))
        llama_cpp.llama_memory_seq_rm(llama_cpp.llama_get_memory(ctx.ctx), 0, end, -1)
    holder.close()
    ctx.close()
    model.close()
    return costs, max(0.0, statistics.median(switched) - costs[1])


def _reply() -> tuple[list[int], list[int]]:
    """The prompt and the greedy reply (the same tokens with speculation on or off)."""
    from llama_cpp import Llama

    llm = Llama(str(MODEL), n_ctx=4096, n_threads=THREADS, n_threads_batch=THREADS, verbose=False)
    prompt = llm.tokenize(TEXT_PROMPT.encode(), add_bos=True, special=True)
    out = llm.create_completion(TEXT_PROMPT, max_tokens=SPEC_TOKENS, temperature=0, logit_bias=EOG_BIAS_IDS)
    reply = llm.tokenize(out["choices"][0]["text"].encode(), add_bos=False, special=True)
    llm.close()
    return prompt, reply[:SPEC_TOKENS]


def streak_odds(prompt: list[int], reply: list[int]) -> list[float]:
    """For s = 0..POOL: how often the candidate's first token was the reply's next one after s in a row were (POOL:
    s >= POOL), over the whole reply."""
    from modules.loaders.llama_cpp_spec import NgramIndex

    index = NgramIndex(prompt + reply[:1])
    tried, held = [0] * (POOL + 1), [0] * (POOL + 1)
    streak = 0
    for token in reply[1:]:
        candidate, _ = index.draft(1)
        hit = bool(candidate) and candidate[0] == token
        tried[min(streak, POOL)] += 1
        held[min(streak, POOL)] += hit
        streak = streak + 1 if hit else 0
        index.append(token)
    return [h / t if t else 0.0 for h, t in zip(held, tried, strict=True)]


def replay(
    prompt: list[int],
    reply: list[int],
    cost: Any,
    policy: str,
    draft_max: int = 16,
    fixed: int = 3,
    odds: list[float] | None = None,
) -> tuple[float, int, int]:
    """(seconds, steps, draft tokens) to produce ``reply`` under ``policy``: "planner" (our Speculator, its cost
    line fed with the measured step times), "fixed" (always ``fixed`` tokens of the candidate), "known" (the
    planner's rule with this reply's odds by streak, known in advance: ``odds``, else measured here), "oracle"."""
    from modules.loaders.llama_cpp_spec import NgramIndex, SpecState, Speculator, StepCost, Work, best_length

    index = NgramIndex(prompt + reply[:1])
    state = SpecState(index=index)
    planner = Speculator(StepCost(), draft_max)
    if policy == "known" and odds is None:
        odds = streak_odds(prompt, reply)
    seconds, steps, drafted, last, streak = 0.0, 0, 0, 0, 0
    i = 1  # reply[0] came from the prompt's own step; reply[i - 1] is the pending token fed next
    while i < len(reply):
        candidate, _ = index.draft(min(draft_max, len(reply) - i))
        holds = next((j for j, t in enumerate(candidate) if t != reply[i + j]), len(candidate))
        if policy == "planner":
            k = planner.plan([Work(0, state, [], min(draft_max, len(reply) - i))], room=64)
        elif policy == "fixed":
            k = min(fixed, len(candidate))
        elif policy == "known":
            assert odds is not None
            rates = [odds[min(streak + j, POOL)] for j in range(len(candidate))]
            one = cost(1, last)
            k, _ = best_length(rates, len(candidate), 1.0, one, lambda n, size=last, one=one: cost(1 + n, size) - one)
        else:  # the oracle: exactly the run that holds, when that beats plain steps
            k = holds if holds and cost(1 + holds, last) < (holds + 1) * cost(1, 1) else 0
        accepted = min(k, holds)
        step = cost(1 + k, last)
        seconds, steps, drafted, last = seconds + step, steps + 1, drafted + k, 1 + k
        if policy == "planner":
            state.draft = candidate[:k]
            planner.cost.step(1 + k, step)
            state.record(reply[i], accepted)
        # the streak goes on while drafts hold and the candidate's next token (checked for free) is the one that came
        streak = 0 if accepted < k or holds == k or len(candidate) == k else streak + k + 1
        for token in reply[i : i + accepted + 1]:
            index.append(token)
        i += accepted + 1
    return seconds, steps, drafted


class _Oracle:
    """A speculator for ``measured``: drafts, for one greedy reply known in advance, exactly the run of prompt
    lookup's candidate that will hold (``perfect``: of the reply itself, as a drafter that knows the text would),
    when a step of that size yields more tokens per second than a one-token step."""

    def __init__(self, planner: Any, full: list[int], draft_max: int, perfect: bool = False) -> None:
        self.planner, self.full, self.draft_max, self.perfect = planner, full, draft_max, perfect
        self.cost, self.draft_model = planner.cost, None
        self.drafted = self.accepted = 0

    def plan(self, work: list[Any], room: int) -> int:
        from modules.loaders.llama_cpp_spec import common_prefix

        total = 0
        cost = self.cost
        for item in work:
            state = item.state
            done = state.index.tokens
            future = self.full[len(done) :]
            limit = min(item.limit, self.draft_max, room - total)
            if limit <= 0:
                continue
            candidate = future[:limit] if self.perfect else state.index.draft(limit)[0]
            k = common_prefix(candidate, future)
            if k and cost.time(1 + k) >= (1 + k) * cost.time(1):
                k = 0
            state.draft, state.shadow = candidate[:k], None
            state.drafted += k
            self.drafted += k
            total += k
        return total

    def confirmed(self, state: Any) -> None:
        state.accepted += 1
        self.accepted += 1

    def close(self) -> None:
        self.planner.close()


def measured(rounds: int = 4) -> dict[str, Any]:
    """The rewrite run for real in this process (textgen's scheduler, no HTTP) with speculation off, our planner
    and two oracles that know the reply in advance, against raw ``Llama.create_completion``, runs alternating:
    the ceiling measured rather than replayed. The prompt-lookup oracle drafts exactly the part of the candidate
    that will hold (at most 16 tokens, the default ``--draft-max``, or 64, the most the planner takes); the perfect
    drafter drafts the reply itself (64 at most), as a draft model that never misses and costs nothing would."""
    from llama_cpp import Llama

    from modules.generation.params import GenerationParams
    from modules.loaders.llama_cpp import LlamaCppBackend
    from modules.loaders.llama_cpp_spec import MAX_DEPTH

    raw = Llama(str(MODEL), n_ctx=4096, n_threads=THREADS, n_threads_batch=THREADS, n_batch=512, verbose=False)
    backend = LlamaCppBackend.load(MODEL, {"threads": THREADS, "parallel": 1})
    planner = backend._spec
    assert planner is not None, "speculation is off in this build"
    prompt = backend.encode(TEXT_PROMPT)
    params = GenerationParams(max_new_tokens=SPEC_TOKENS, temperature=0, logit_bias=EOG_BIAS_IDS)
    texts: dict[str, list[int]] = {}
    runs: dict[str, list[float]] = {}
    drafted: dict[str, tuple[int, int]] = {}

    def ours(name: str, spec: Any) -> None:
        import threading

        backend._spec = spec
        before = (spec.drafted, spec.accepted) if spec is not None else (0, 0)
        started = time.perf_counter()
        tokens = [e.token_id for e in backend.generate(prompt, params, threading.Event()) if e.token_id >= 0]
        runs.setdefault(name, []).append(len(tokens) / (time.perf_counter() - started))
        texts[name] = tokens
        if spec is not None:
            drafted[name] = (spec.drafted - before[0], spec.accepted - before[1])

    def local() -> None:
        started = time.perf_counter()
        out = raw.create_completion(TEXT_PROMPT, max_tokens=SPEC_TOKENS, temperature=0, logit_bias=EOG_BIAS_IDS)
        runs.setdefault("raw", []).append(out["usage"]["completion_tokens"] / (time.perf_counter() - started))

    try:
        local()
        ours("off", None)  # warm-up, and the reply the oracles are told
        full = prompt + texts["off"]
        oracles = {
            "oracle_16": _Oracle(planner, full, 16),
            "oracle_64": _Oracle(planner, full, MAX_DEPTH),
            "perfect_64": _Oracle(planner, full, MAX_DEPTH, perfect=True),
        }
        ours("planner", planner)
        for round_ in range(rounds):
            steps = [local, lambda: ours("off", None), lambda: ours("planner", planner)]
            steps += [lambda name=name, spec=spec: ours(name, spec) for name, spec in oracles.items()]
            for step in steps if round_ % 2 == 0 else steps[::-1]:
                time.sleep(0.2)
                step()
    finally:
        backend._spec = planner
        backend.unload()
        raw.close()
    med = {k: statistics.median(v[-rounds:]) for k, v in runs.items()}
    out: dict[str, Any] = {"raw_tokens_per_s": round(med["raw"], 1), "reply_tokens": len(texts["off"])}
    for name in ("off", "planner", "oracle_16", "oracle_64", "perfect_64"):
        out[name] = {
            "tokens_per_s": round(med[name], 1),
            "ratio_vs_raw": round(med[name] / med["raw"], 3),
            "same_reply": texts[name] == texts["off"],
        }
        if name in drafted:
            out[name]["drafted_accepted_last_run"] = drafted[name]
    out["runs"] = {k: [round(x, 1) for x in v] for k, v in runs.items()}
    return out


def run() -> dict[str, Any]:
    """Step costs on this CPU and the rewrite's ceiling: replayed, then measured in this process."""
    prompt, reply = _reply()
    costs, switch = _decode_costs(prompt)
    sizes = sorted(costs)

    def cost(n: int, last: int) -> float:
        below = max(s for s in sizes if s <= n)
        above = min((s for s in sizes if s >= n), default=below)
        base = (
            costs[below]
            if above == below
            else costs[below] + (costs[above] - costs[below]) * (n - below) / (above - below)
        )
        return base + (switch if n != last else 0.0)

    plain = len(reply) * costs[1]
    from bench.common import cpu_name

    out: dict[str, Any] = {
        "cpu": cpu_name(),
        "step_ms": {n: round(costs[n] * 1000, 2) for n in sizes},
        "per_extra_token_ms": round((costs[5] - costs[1]) / 4 * 1000, 2),
        "switch_ms": round(switch * 1000, 2),
        "reply_tokens": len(reply),
    }
    odds = streak_odds(prompt, reply)
    out["odds_by_streak"] = [round(x, 2) for x in odds]
    for policy, label in (("planner", "planner"), ("fixed", "always_3"), ("known", "known_odds"), ("oracle", "oracle")):
        seconds, steps, drafted = replay(prompt, reply, cost, policy, odds=odds)
        out[label] = {"speedup": round(plain / seconds, 3), "steps": steps, "draft_tokens": drafted}
    out["measured"] = measured()
    return out


if __name__ == "__main__":
    import json

    print(json.dumps(run(), indent=1))
