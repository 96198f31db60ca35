"""Prometheus metrics in the text exposition format: requests, tokens, time to first token, speed, load."""

from __future__ import annotations

import threading
from collections import defaultdict
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from modules.generation.pipeline import GenerationStats

TTFT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class Metrics:
    """Process-wide counters (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests: dict[tuple[str, int], int] = defaultdict(int)
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.ttft_buckets = [0] * len(TTFT_BUCKETS)
        self.ttft_count = 0
        self.ttft_sum = 0.0
        self.last_tokens_per_second = 0.0
        self.generation_seconds = 0.0

    def observe_request(self, endpoint: str, status: int) -> None:
        """Count one HTTP request."""
        with self._lock:
            self.requests[(endpoint, status)] += 1

    def observe_generation(
        self, endpoint: str, stats: list[GenerationStats], seconds: float, prompt_tokens: int | None = None
    ) -> None:
        """Count the tokens and timings of a finished generation request (the prompt once, unless given)."""
        with self._lock:
            if prompt_tokens is not None:
                self.prompt_tokens += prompt_tokens
            elif stats:
                self.prompt_tokens += stats[0].prompt_tokens
            for s in stats:
                self.completion_tokens += s.new_tokens
                self.ttft_count += 1
                self.ttft_sum += s.time_to_first_token
                for i, bound in enumerate(TTFT_BUCKETS):
                    if s.time_to_first_token <= bound:
                        self.ttft_buckets[i] += 1
                if s.tokens_per_second:
                    self.last_tokens_per_second = s.tokens_per_second
            self.generation_seconds += seconds

    def render(self, backend_stats: dict[str, Any], model: str | None, running: int) -> str:
        """The exposition text."""
        lines: list[str] = []

        def metric(name: str, kind: str, help_text: str, samples: list[tuple[str, float]]) -> None:
            lines.append(f"# HELP textgen_{name} {help_text}")
            lines.append(f"# TYPE textgen_{name} {kind}")
            for labels, value in samples:
                lines.append(f"textgen_{name}{labels} {value}")

        with self._lock:
            metric(
                "requests_total",
                "counter",
                "HTTP API requests by endpoint and status.",
                [(f'{{endpoint="{e}",status="{s}"}}', n) for (e, s), n in sorted(self.requests.items())],
            )
            metric("prompt_tokens_total", "counter", "Prompt tokens processed.", [("", self.prompt_tokens)])
            metric("completion_tokens_total", "counter", "Tokens generated.", [("", self.completion_tokens)])
            cumulative = [(f'{{le="{b}"}}', n) for b, n in zip(TTFT_BUCKETS, self.ttft_buckets, strict=True)]
            cumulative.append(('{le="+Inf"}', self.ttft_count))
            lines.append("# HELP textgen_time_to_first_token_seconds Time from request to first token.")
            lines.append("# TYPE textgen_time_to_first_token_seconds histogram")
            lines.extend(f"textgen_time_to_first_token_seconds_bucket{labels} {n}" for labels, n in cumulative)
            lines.append(f"textgen_time_to_first_token_seconds_sum {self.ttft_sum}")
            lines.append(f"textgen_time_to_first_token_seconds_count {self.ttft_count}")
            metric(
                "tokens_per_second",
                "gauge",
                "Decode speed of the last generation.",
                [("", self.last_tokens_per_second)],
            )
        metric("queue_depth", "gauge", "Requests waiting for a free slot.", [("", backend_stats.get("queue_depth", 0))])
        metric("busy_slots", "gauge", "Slots generating now.", [("", backend_stats.get("busy_slots", running))])
        metric("slots", "gauge", "Generation slots of the loaded model.", [("", backend_stats.get("slots", 0))])
        metric(
            "prompt_cache_hit_tokens_total",
            "counter",
            "Prompt tokens reused from a slot's cache.",
            [("", backend_stats.get("cache_hit_tokens", 0))],
        )
        if "draft_tokens" in backend_stats:
            drafted, accepted = backend_stats["draft_tokens"], backend_stats.get("accepted_tokens", 0)
            metric(
                "speculative_draft_tokens_total",
                "counter",
                "Draft tokens speculative decoding checked.",
                [("", drafted)],
            )
            metric(
                "speculative_accepted_tokens_total",
                "counter",
                "Draft tokens the model confirmed (each one a step saved).",
                [("", accepted)],
            )
            metric(
                "speculative_acceptance_ratio",
                "gauge",
                "Confirmed draft tokens / drafted, since the model loaded.",
                [("", round(accepted / drafted, 4) if drafted else 0)],
            )
        if "step_seconds" in backend_stats:
            metric(
                "speculative_step_seconds",
                "gauge",
                "A decode step's time by its tokens, as the speculation planner has fitted it to the steps it ran.",
                [(f'{{tokens="{n}"}}', seconds) for n, seconds in backend_stats["step_seconds"].items()],
            )
            metric(
                "speculative_step_switch_seconds",
                "gauge",
                "What a step of another size than the one before adds (a new compute graph), as fitted.",
                [("", backend_stats.get("step_switch_seconds", 0))],
            )
        metric(
            "model_loaded", "gauge", "1 when a model is loaded.", [(f'{{model="{model or ""}"}}', 1 if model else 0)]
        )
        return "\n".join(lines) + "\n"


METRICS = Metrics()
