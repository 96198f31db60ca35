"""Speculation after a busy spell: the planner fits its step costs to the steps it sees, so a fit taken while
another program slowed the machine must not keep it from drafting once the machine is fast again."""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
from typing import Any

from bench.common import metrics, stream_completion, textgen
from bench.llama_engine import EOG_BIAS, SPEC_TOKENS, TEXT_PROMPT, THREADS


def run(busy: int = 2, rounds: int = 4) -> dict[str, Any]:
    """The rewrite on a server whose first ``busy`` rewrites ran beside a busy process (a CPU-bound loop, as another
    program would be), then ``rounds`` quiet rewrites alternating with a server that had no busy spell (each round's
    two runs next to each other, in both orders; the ratio is the median of the rounds' ratios): the planner fits
    its step costs to the steps it sees, and a fit taken in a slow spell must not stop drafting afterwards."""
    body = {"prompt": TEXT_PROMPT, "max_tokens": SPEC_TOKENS, "temperature": 0, "logit_bias": EOG_BIAS,
            "stream_options": {"include_usage": True}}  # fmt: skip
    runs: dict[str, list[float]] = {"busy": [], "after": [], "quiet": []}
    drafted: dict[str, list[float]] = {"after": [], "quiet": []}

    def drafts(url: str) -> float:
        return sum(metrics(url, "textgen_speculative_draft").values())

    def rewrite(url: str, name: str) -> None:
        before = drafts(url)
        result = stream_completion(url, body)
        runs[name].append(result.tokens / (result.ended - result.started))
        if name in drafted:
            drafted[name].append(drafts(url) - before)

    with textgen("--threads", str(THREADS)) as spelled, textgen("--threads", str(THREADS)) as quiet:
        for url in (spelled.url, quiet.url):
            stream_completion(url, {**body, "max_tokens": 8})
        hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        try:
            for _ in range(busy):
                rewrite(spelled.url, "busy")
        finally:
            hog.kill()
            hog.wait()
        for round_ in range(rounds):
            pair = ((spelled.url, "after"), (quiet.url, "quiet"))
            for url, name in pair if round_ % 2 == 0 else pair[::-1]:
                time.sleep(0.3)
                rewrite(url, name)
        costs = {
            name: round(seconds * 1000, 2) for name, seconds in metrics(spelled.url, "textgen_speculative_step").items()
        }
    after, ref = statistics.median(runs["after"]), statistics.median(runs["quiet"])
    return {
        "after_busy_tokens_per_s": after,
        "no_busy_spell_tokens_per_s": ref,
        # the two runs of a round are next to each other in time: the median of their ratios, which a shift of this
        # machine's speed between rounds does not move as it moves the medians of the two sides
        "ratio": statistics.median(a / b for a, b in zip(runs["after"], runs["quiet"], strict=True)),
        "ratio_of_medians": after / ref,
        "target": ">= 0.9",
        "runs": runs,
        "draft_tokens": drafted,
        "step_ms_after": costs,
    }
