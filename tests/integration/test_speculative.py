"""Speculative decoding in the llama.cpp engine: the output is the target model's, token for token.

The Makefile builds llama.cpp without llamafile's tinyBLAS and the backend runs without flash attention on the CPU,
so a token's logits do not depend on how many tokens share its step: speculative and plain decoding must agree to
the bit (tokens and log probabilities), at any context length.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from modules.generation.params import GenerationParams
from modules.loaders.base import Backend, TokenEvent
from modules.loaders.llama_cpp import LlamaCppBackend
from modules.loaders.llama_cpp_spec import (
    DOUBT_AFTER,
    Acceptance,
    NgramIndex,
    SpecState,
    Speculator,
    StepCost,
    Work,
    best_length,
)
from tests.conftest import default_model_path

CODE = """def area(width, height):
    return width * height


def perimeter(width, height):
    return 2 * (width + height)
"""
LONG_CODE = Path(__file__).read_text()[:2400]  # ~600 tokens: past the 512 KV cells where attention splits
PROMPTS = [
    f"Rewrite this Python code with type hints, and change nothing else:\n\n{CODE}",
    "Write a story about a robot who learns to paint.",
    "List the planets of the solar system, one per line, with one fact about each.",
    f"Repeat this text exactly: {CODE}",
    f"Rewrite this file with the word 'draft' replaced by 'guess':\n\n{LONG_CODE}",
]


def chat(backend: Backend, text: str) -> list[int]:
    return backend.encode(f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n")


def events(backend: Backend, ids: list[int], params: GenerationParams) -> list[TokenEvent]:
    return list(backend.generate(ids, params, threading.Event()))


def tokens(evs: list[TokenEvent]) -> list[int]:
    return [e.token_id for e in evs if e.token_id >= 0]


@pytest.fixture(scope="module")
def plain() -> LlamaCppBackend:
    backend = LlamaCppBackend.load(default_model_path(), {"speculative": False, "parallel": 2})
    yield backend
    backend.unload()


GREEDY_128 = GenerationParams(temperature=0, max_new_tokens=128, ban_eos=True)


@pytest.fixture(scope="module")
def plain_reply(plain: LlamaCppBackend) -> Callable[[str], list[TokenEvent]]:
    """The plain engine's greedy 128-token reply to a prompt, computed once per module: greedy decoding on one
    build is deterministic, and several tests compare against the same replies (a long prompt costs seconds)."""
    replies: dict[str, list[TokenEvent]] = {}

    def reply(text: str) -> list[TokenEvent]:
        if text not in replies:
            replies[text] = events(plain, chat(plain, text), GREEDY_128)
        return replies[text]

    return reply


@pytest.fixture(scope="module")
def planned() -> LlamaCppBackend:
    """Speculation as users get it: the planner drafts only what it expects to pay on this CPU (maybe nothing)."""
    backend = LlamaCppBackend.load(default_model_path(), {"parallel": 2})
    yield backend
    backend.unload()


@pytest.fixture(scope="module")
def spec() -> LlamaCppBackend:
    """Drafting forced on (--draft-min 3): every guess is checked, so the machinery runs on every CPU, whatever
    the cost fit decides there (on an AMD EPYC the planner drafts almost nothing for these prompts)."""
    backend = LlamaCppBackend.load(default_model_path(), {"parallel": 2, "draft_min": 3})
    yield backend
    backend.unload()


@pytest.mark.parametrize("which", ["planned", "forced"])
def test_speculative_greedy_equals_plain_greedy(
    plain_reply: Callable[[str], list[TokenEvent]], planned: LlamaCppBackend, spec: LlamaCppBackend, which: str
) -> None:
    from modules.loaders import llama_cpp_check

    assert llama_cpp_check.batch_invariant()  # built by the Makefile
    backend = planned if which == "planned" else spec
    before = backend.stats()
    for text in PROMPTS:
        want, got = plain_reply(text), events(backend, chat(backend, text), GREEDY_128)
        assert tokens(got) == tokens(want), text
        assert len(tokens(got)) == 128
        assert want[-1].speculation is None
    if which == "planned":
        return  # what the planner drafted depends on this CPU's step costs: only the output is asserted
    after = backend.stats()
    accepted = after["accepted_tokens"] - before["accepted_tokens"]
    drafted = after["draft_tokens"] - before["draft_tokens"]
    assert accepted >= 150, (drafted, accepted)  # the copying prompts were drafted and confirmed in bulk
    # fewer steps than tokens: several tokens were accepted per weight read
    assert after["steps"] - before["steps"] < len(PROMPTS) * 128 - accepted // 2


def test_draft_min_forces_a_draft_the_planner_would_not_make() -> None:
    state = SpecState(index=NgramIndex([1, 2, 3, 9, 1, 2]))
    state.acceptance[2] = Acceptance()
    for _ in range(20):
        state.acceptance[2].update(1, 0)  # no draft has held: the planner drafts nothing
    assert Speculator(StepCost(), draft_max=8).plan([Work(0, state, [], 8)], room=64) == 0
    assert state.draft == []
    forced = Speculator(StepCost(), draft_max=8, draft_min=2)
    assert forced.plan([Work(0, state, [], 8)], room=64) == 2
    assert state.draft == [3, 9] and forced.drafted == 2  # the first two tokens of what followed "1 2"
    state.draft = []
    assert forced.plan([Work(0, state, [], 1)], room=64) == 1  # never past the sequence's own room


def test_metrics_and_the_stats_line_show_acceptance(spec: LlamaCppBackend) -> None:
    from extensions.openai.metrics import Metrics
    from modules.generation.pipeline import generate_text

    _, stats = generate_text(chat(spec, PROMPTS[3]), GenerationParams(temperature=0, max_new_tokens=64), backend=spec)
    assert 0 < stats.accepted_tokens <= stats.draft_tokens
    assert f"drafts {stats.accepted_tokens}/{stats.draft_tokens} accepted" in stats.summary()
    now = spec.stats()
    text = Metrics().render(now, "default", 0)
    assert f"textgen_speculative_draft_tokens_total {now['draft_tokens']}" in text
    assert f"textgen_speculative_accepted_tokens_total {now['accepted_tokens']}" in text
    assert now["accepted_tokens"] > 0
    # the planner's fitted step costs, so a run that drafted less can be told apart from one whose text held less
    fitted = {n: float(s) for n, s in re.findall(r'textgen_speculative_step_seconds\{tokens="(\d+)"\} (\S+)', text)}
    assert sorted(fitted, key=int) == ["1", "2", "4", "8"]
    assert 0 < fitted["1"] < 1 and fitted["2"] < fitted["4"] < fitted["8"], fitted
    assert "textgen_speculative_step_switch_seconds " in text


def test_logprobs_and_seeded_sampling_are_unchanged(plain: LlamaCppBackend, spec: LlamaCppBackend) -> None:
    ids = chat(spec, PROMPTS[0])
    greedy = GenerationParams(temperature=0, max_new_tokens=96, ban_eos=True, logprobs=True, top_logprobs=3)
    want, got = events(plain, ids, greedy), events(spec, ids, greedy)
    assert [(e.token_id, e.logprob) for e in got] == [(e.token_id, e.logprob) for e in want]
    assert [[(t.token_id, t.logprob) for t in e.top_logprobs or []] for e in got] == [
        [(t.token_id, t.logprob) for t in e.top_logprobs or []] for e in want
    ]
    assert (got[-1].speculation or (0, 0))[1] > 0
    # with sampling, a draft token is kept when the request's own sampler draws it: one random draw per token,
    # as without speculation, so a seed gives the same reply
    for seed in (1, 2, 3):
        sampled = GenerationParams(temperature=0.7, top_p=0.9, seed=seed, max_new_tokens=96, ban_eos=True)
        assert tokens(events(spec, ids, sampled)) == tokens(events(plain, ids, sampled)), seed


def test_grammar_holds_with_speculation(plain: LlamaCppBackend, spec: LlamaCppBackend) -> None:
    import json

    text = 'Copy this JSON: {"name": "Ada Lovelace", "city": "London", "age": 36}'
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "city": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "city", "age"],
        "additionalProperties": False,
    }
    params = GenerationParams(temperature=0, max_new_tokens=96, json_schema=schema)
    ids = chat(spec, text)
    got = events(spec, ids, params)
    assert tokens(got) == tokens(events(plain, ids, params))
    reply = json.loads(spec.decode(tokens(got)))
    assert set(reply) == {"name", "city", "age"} and isinstance(reply["age"], int)
    assert (got[-1].speculation or (0, 0))[1] > 0  # the copied JSON was drafted


def test_cancelling_mid_draft_frees_the_slot_and_keeps_the_cache_right(
    plain: LlamaCppBackend, spec: LlamaCppBackend
) -> None:
    ids = chat(spec, PROMPTS[3])
    params = GREEDY_128
    cancel = threading.Event()
    seen = []
    # room for far more than is read before the cancel, so it lands mid-reply however late this thread reads
    stream = spec.generate(ids, params.replace(max_new_tokens=1000), cancel)
    started = time.monotonic()
    steps_at_cancel = -1
    for event in stream:
        seen.append(event)
        if len(seen) == 20:  # inside a copied run: drafts are in flight at every step
            cancel.set()
            steps_at_cancel = spec.stats()["steps"]
        if event.finish_reason:
            break
    assert seen[-1].finish_reason == "cancelled"
    # it ended within two of the engine's steps (the engine does not wait for its reader, so the tokens read say
    # nothing of how soon it stopped)
    assert spec.stats()["steps"] - steps_at_cancel <= 2 and time.monotonic() - started < 30
    deadline = time.monotonic() + 5
    while spec.stats()["busy_slots"] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert spec.stats()["busy_slots"] == 0
    # the slot's cache now holds the prompt and the confirmed part of the reply only: going on from the reply
    # so far reuses all of it (a rejected draft left in the cache would change what comes next)
    hits = spec.stats()["cache_hit_tokens"]
    more = ids + tokens(seen)
    assert tokens(events(spec, more, params)) == tokens(events(plain, more, params))
    assert spec.stats()["cache_hit_tokens"] - hits >= len(ids) + len(tokens(seen)) - 2


def test_concurrent_speculative_streams_equal_plain_streams_alone(
    plain_reply: Callable[[str], list[TokenEvent]], spec: LlamaCppBackend
) -> None:
    texts = [PROMPTS[4], PROMPTS[1]]  # a long copying one beside a story
    alone = [tokens(plain_reply(text)) for text in texts]
    together: dict[int, list[int]] = {}
    threads = [
        threading.Thread(
            target=lambda i=i: together.__setitem__(i, tokens(events(spec, chat(spec, texts[i]), GREEDY_128)))
        )
        for i in range(2)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert together[0] == alone[0] and together[1] == alone[1]


def test_draft_model_output_is_the_target_model_s(plain: LlamaCppBackend, tmp_path: Path) -> None:
    params = GenerationParams(temperature=0, max_new_tokens=64, ban_eos=True)
    options = {"draft_model": str(default_model_path()), "draft_max": 6, "draft_min": 2, "parallel": 2}
    backend = LlamaCppBackend.load(default_model_path(), options)
    try:
        # a story (prompt lookup finds little, a draft model guesses well), and beside it a prompt longer than
        # the draft model's 512-token chunk while the story is decoding
        story, long = chat(backend, PROMPTS[1]), chat(backend, PROMPTS[4])
        assert len(long) > 600  # ~720 tokens: more than one of the drafter's 512-token chunks
        plain_long = tokens(events(plain, long, params))  # read once: each costs a long prompt and 64 tokens
        got = events(backend, story, params)
        assert tokens(got) == tokens(events(plain, story, params))
        drafted, accepted = got[-1].speculation or (0, 0)
        assert drafted > 0 and accepted / drafted > 0.9, (drafted, accepted)  # the same model drafts itself
        results: dict[str, list[int]] = {}
        threads = [
            threading.Thread(target=lambda k=k, ids=ids: results.__setitem__(k, tokens(events(backend, ids, params))))
            for k, ids in (("story", story), ("long", long))
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert results["story"] == tokens(got)
        assert results["long"] == plain_long
        # the drafter itself, for two sequences at once, one longer than its 512-token chunk: each gets the
        # greedy continuation (the draft is the target model, so it must guess the target's tokens)
        assert backend._spec is not None and backend._spec.draft_model is not None
        drafter = backend._spec.draft_model
        drafts = drafter.draft([(0, long, 3), (1, story, 3)], budget=10_000)
        assert drafts[0] == plain_long[:3]
        assert drafts[1] == tokens(got)[:3]
        # a long prompt is read a budget at a time (the other streams' steps go on meanwhile), then drafted for
        drafter.forget(0)
        drafts = drafter.draft([(0, long, 3), (1, story, 3)], budget=200)  # the nearly caught up one goes first
        assert 0 not in drafts and drafts[1] == tokens(got)[:3] and len(drafter.tokens[0]) == 199  # 1 went to seq 1
        for calls in range(1, 10):
            drafts = drafter.draft([(0, long, 3)], budget=200)
            if drafts:
                break
            assert len(drafter.tokens[0]) == 199 + 200 * calls
        assert calls == -(-(len(long) - 199 - 200) // 200) + 1 and drafts[0] == plain_long[:3]
    finally:
        backend.unload()
    with pytest.raises(Exception, match="draft model"):
        LlamaCppBackend.load(default_model_path(), {"draft_model": str(tmp_path / "missing.gguf")})


def test_a_draft_model_named_alone_is_found_under_models(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from modules import shared
    from modules.loaders.llama_cpp_spec import draft_path

    (tmp_path / "small.gguf").write_bytes(b"GGUF")
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "b.gguf").write_bytes(b"GGUF")
    monkeypatch.setattr(shared, "models_dir", lambda: tmp_path)
    assert draft_path("small.gguf") == tmp_path / "small.gguf"
    assert draft_path("folder") == tmp_path / "folder" / "b.gguf"
    assert draft_path(tmp_path / "small.gguf") == tmp_path / "small.gguf"
    assert draft_path("absent.gguf") == tmp_path / "absent.gguf"  # the load then says it is missing


# ---------------------------------------------------------------- the drafter and the policy, without a model
def test_prompt_lookup_drafts_what_followed_the_latest_match() -> None:
    index = NgramIndex([5, 6, 7, 8, 9, 1, 2, 5, 6, 7])
    assert index.draft(3) == ([8, 9, 1], 3)  # "5 6 7" came before, followed by 8 9 1
    index.append(4)
    assert index.draft(3) == ([], 0)  # nothing ever followed a 4
    index = NgramIndex([1, 2, 3, 1, 2, 4, 1, 2])
    assert index.draft(2) == ([4, 1], 2)  # the latest "1 2" wins


def test_draft_length_follows_acceptance_and_busy_slots() -> None:
    cost = StepCost(base=0.007, per_token=0.005)
    one, _ = best_length(0.9, 16, 1, cost.time(1), cost.per_token)
    assert one >= 3
    assert best_length(0.3, 16, 1, cost.time(1), cost.per_token)[0] == 0  # drafts that fail cost more than they give
    eight, _ = best_length(0.9, 16, 8, cost.time(8), cost.per_token)
    assert eight < one  # a full step gains less from each extra token
    # drafts hold in runs: when the first tokens held, deeper ones are likelier to, and drafts grow long
    copying = [0.8] + [0.99] * 15
    assert best_length(copying, 16, 1, cost.time(1), cost.per_token)[0] >= 10
    rate = Acceptance()
    for _ in range(10):
        rate.update(4, 0)
    assert rate.rate() < 0.15
    for _ in range(20):
        rate.update(8, 8)
    assert rate.rate() > 0.75 and rate.rate(7) > 0.9  # it recovers when the text turns to copying


def test_a_step_of_a_new_size_costs_a_graph_and_drafts_keep_their_size() -> None:
    # llama.cpp reuses the last compute graph only for a step of the same size: the cost line learns what a new
    # size costs on top (here 2.2 ms) from the steps themselves
    cost = StepCost()
    for i in range(400):
        tokens = [1, 1, 4, 4, 4, 2, 1, 5, 5][i % 9]
        cost.step(tokens, 0.0063 + 0.0041 * tokens + (0.0022 if tokens != cost.last else 0.0))
    assert abs(cost.switch - 0.0022) < 2e-4 and abs(cost.per_token - 0.0041) < 2e-4, (cost.switch, cost.per_token)
    assert abs(cost.base - 0.0063) < 3e-4
    cost.step(9, 1.0, pure=False)  # a step that fed a prompt: only its size is kept
    assert cost.last == 9 and abs(cost.per_token - 0.0041) < 2e-4
    # a draft length that keeps the step's size wins over a slightly better one that changes it
    rates = [0.6] * 16
    free = best_length(rates, 16, 1, 0.0104, 0.0041)[0]
    kept = best_length(rates, 16, 1, 0.0104, 0.0041, switch=(1, 1 + free + 1, 0.0022))[0]
    assert kept == free + 1
    half = [0.5] * 16
    assert best_length(half, 16, 1, 0.0104, 0.0041)[0] == 1
    assert best_length(half, 16, 1, 0.0104, 0.0041, switch=(1, 3, 0.0022))[0] == 2  # the last step's size
    assert best_length(half, 16, 1, 0.0104, 0.0041, switch=(1, 1, 0.0022))[0] == 0


def test_a_one_token_step_is_costed_apart_from_the_line_of_larger_ones() -> None:
    # measured on an AMD EPYC: one token 6.6 ms, then 13.5 ms for two and 3.1 ms for each token more (the CPU
    # backend multiplies one row another way than several); a line through all sizes saw every draft as dear
    def took(n: int) -> float:
        return 0.0066 if n == 1 else 0.0073 + 0.0031 * n

    cost = StepCost()
    for i in range(300):
        tokens = [1, 1, 1, 3, 1, 9, 1, 1, 5, 2][i % 10]
        cost.step(tokens, took(tokens))
    for n in (1, 2, 5, 9, 13):
        assert abs(cost.time(n) - took(n)) < 0.05 * took(n), (n, cost.time(n), took(n))
    # a copied passage: a long draft pays, though a one-token one would cost a whole step more for less than one
    speculator = Speculator(cost, draft_max=16)
    state = SpecState(index=NgramIndex([5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 5, 6]))
    state.acceptance[2] = Acceptance()
    for _ in range(30):
        state.acceptance[2].update(8, 8)
    assert speculator.plan([Work(0, state, [], 16)], room=64) == 2  # no run held yet: drafts start short
    state.run = 8  # the last draft held 8 tokens
    assert speculator.plan([Work(0, state, [], 16)], room=64) >= 8
    assert best_length([0.9] * 16, 1, 1, cost.time(1), lambda k: cost.time(1 + k) - cost.time(1))[0] == 0


def _copying(run: int = 8) -> SpecState:
    """A sequence in a copied passage: its drafts have held in full, the last one for ``run`` tokens."""
    state = SpecState(index=NgramIndex([5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 5, 6]))
    state.acceptance[2] = Acceptance()
    for _ in range(30):
        state.acceptance[2].update(8, 8)
    state.run = run
    return state


def test_a_fit_taken_in_a_busy_spell_does_not_stop_drafting_for_good() -> None:
    # the line learns only from drafts: fitted while the machine was slow, it made drafts look dear in seconds, so
    # none were made and it never saw the machine fast again (measured on an AMD EPYC after a busy process)
    def took(n: int, slow: float = 1.0) -> float:  # the AMD EPYC's shape
        return slow * (0.0066 if n == 1 else 0.0073 + 0.0031 * n)

    sizes = [1, 1, 1, 3, 1, 9, 1, 1, 5, 2]
    cost = StepCost()
    for i in range(300):
        cost.step(sizes[i % 10], took(sizes[i % 10]))
    assert Speculator(cost, draft_max=16).plan([Work(0, _copying(), [], 16)], room=64) >= 8
    for i in range(300):  # a busy spell four times as slow, drafts and all
        cost.step(sizes[i % 10], took(sizes[i % 10], slow=4.0))
    assert Speculator(cost, draft_max=16).plan([Work(0, _copying(), [], 16)], room=64) >= 8  # the same shape
    for _ in range(300):  # fast again (3 s): the planner may make no draft at first, and one-token steps show it
        cost.step(1, took(1))
    for n in (1, 2, 5, 9):  # (the one-token time lagged the spell's start a little: not exact)
        assert abs(cost.time(n) - took(n)) < 0.15 * took(n), (n, cost.time(n), took(n))
    assert Speculator(cost, draft_max=16).plan([Work(0, _copying(), [], 16)], room=64) >= 8
    # a line that no longer fits the machine for another reason (here drafts were slowed and one token was not)
    for i in range(300):
        n = [1, 1, 4, 4, 4, 1, 6, 6, 1, 1][i % 10]
        cost.step(n, took(n, slow=1.0 if n == 1 else 4.0))
    assert Speculator(cost, draft_max=16).plan([Work(0, _copying(), [], 16)], room=64) == 0
    for _ in range(4000):  # ~26 s of plain steps: what the line knew has aged, and drafting is tried again
        cost.step(1, took(1))
    assert Speculator(cost, draft_max=16).plan([Work(0, _copying(), [], 16)], room=64) > 0
    # the same dear line, but the planner declines guesses of a lone request that keep holding: it doubts the fit,
    # which then gives way within a few hundred steps instead of thousands
    cost = StepCost()
    for i in range(300):
        n = [1, 1, 4, 4, 4, 1, 6, 6, 1, 1][i % 10]
        cost.step(n, took(n, slow=1.0 if n == 1 else 4.0))
    speculator, state, steps = Speculator(cost, draft_max=16), _copying(), 0
    state.held = DOUBT_AFTER  # its last guesses held without being drafted
    while speculator.plan([Work(0, state, [], 16)], room=64) == 0 and steps < 3000:
        cost.step(1, took(1))
        steps += 1
    assert steps < 400, steps
    # slow one-token steps, then many drafted ones of changing sizes (slow too, each new size 10 ms dearer), then a
    # fast one-token step of a new size: the switch cost taken off it is bounded, and the one-token time stays a time
    cost = StepCost()
    for _ in range(50):
        cost.step(1, took(1, slow=4.0))
    for i in range(400):
        n = [3, 9, 5, 2][i % 4]
        cost.step(n, took(n, slow=4.0) + 0.01)
    cost.step(1, took(1))
    assert cost.time(1) >= 0.5 * took(1) and cost.time(2) > 0, (cost.time(1), cost.time(2), cost.switch)


def test_a_lone_request_drafting_at_every_step_measures_one_token_again() -> None:
    # a one-token time from a slow spell, then only drafted steps (fast): every draft would look cheap for good
    cost = StepCost()
    for _ in range(100):
        cost.step(1, 0.0264)
    for i in range(300):
        n = [3, 9, 5, 2][i % 4]
        cost.step(n, 0.0073 + 0.0031 * n)
    speculator, state = Speculator(cost, draft_max=16), _copying()
    # not while another request's prompt is fed in the same step: that step would not measure one token
    assert speculator.plan([Work(0, state, [], 16)], room=64, alone=False) >= 8
    state.draft = []
    assert speculator.plan([Work(0, state, [], 16)], room=64) == 0  # one plain step, to measure one token again
    cost.step(1, 0.0066)
    assert abs(cost.time(1) - 0.0066) < 0.0005  # the long-unseen time is replaced, not averaged in
    assert speculator.plan([Work(0, state, [], 16)], room=64) >= 8
    two = [Work(0, _copying(), [], 16), Work(1, _copying(), [], 16)]
    for _ in range(300):
        cost.step(3, 0.0166)
    assert speculator.plan(two, room=64) > 0  # beside another sequence: one-token steps cannot come, none is forced


def test_guesses_that_hold_undrafted_are_counted_in_a_row() -> None:
    state = _copying()
    for token in (7, 7, 7):
        state.shadow = 7
        state.record(token, 0)
    assert state.held == 3
    state.shadow = 7
    state.record(8, 0)  # a miss
    assert state.held == 0
    state.shadow = 7
    state.record(7, 0)
    state.draft = [1, 2]
    state.record(1, 2)  # a draft: what held undrafted starts again
    assert state.held == 0


def test_an_undrafted_candidate_still_teaches_the_rate() -> None:
    state = SpecState(index=NgramIndex([1, 2, 3, 9, 1, 2]))
    state.acceptance[2] = Acceptance()
    for _ in range(20):
        state.acceptance[2].update(1, 0)  # no draft pays now
    speculator = Speculator(StepCost(), draft_max=8)
    assert speculator.plan([Work(0, state, [], 8)], room=64) == 0
    assert state.shadow == 3
    for _ in range(40):
        state.record(3, 0)  # what came was the candidate's first token, again and again
        state.shadow = 3
    assert state.acceptance[2].rate() > 0.8
    assert speculator.plan([Work(0, state, [], 8)], room=64) > 0
