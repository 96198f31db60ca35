"""The load tool (bench/load.py) on a tiny run against the real server: its answers and its checks.

Correctness only (every answer 2xx, streams whole, slots free, the server alive); speeds are bench's business.
"""

from __future__ import annotations

import copy

import pytest

from bench import load


def test_a_small_mixed_load_gets_no_5xx_and_leaves_every_slot_free() -> None:
    # one llama.cpp thread: on a busy machine two threads wait on each other at every step and crawl
    result = load.run(requests=24, concurrency=4, threads=1, disconnect_rounds=1, max_tokens=(4, 8), warmup=8)

    assert result["requests"] == 24 and sum(result["status_counts"].values()) == 24
    assert result["status_counts"] == {"200": 24}, result["status_counts"]
    assert result["server_errors"] == 0 and result["transport_errors"] == 0
    assert result["problems"] == []
    assert result["cancelled"] == 2  # every 10th request is a stream the client closes
    assert {"chat", "completions", "chat stream", "completions stream"} <= set(result["by_kind"])
    assert result["completion_tokens"] > 0 and result["tokens_per_s"] > 0
    assert result["slots_free_at_end"], result["slot_state_at_end"]
    assert result["server_alive"]
    # a client that went away gave its slot back (the tool raises when it stays busy for 30 s)
    assert len(result["disconnect_stream_s"]) == 1 and len(result["disconnect_non_stream_s"]) == 1

    table = load.table(result)
    assert "| status codes | 200: 24 |" in table and "| all slots free at the end | yes |" in table

    # the tool's checks fail on what a broken server would show
    broken = copy.deepcopy(result)
    broken["status_counts"] = {"200": 23, "500": 1}
    broken["server_errors"] = 1
    broken["slots_free_at_end"] = False
    broken["slot_state_at_end"] = {"slots": 4.0, "busy_slots": 1.0, "queue_depth": 0.0}
    missed = load.failures(broken)
    assert any("5xx" in m for m in missed) and any("slots still busy" in m for m in missed)


def test_the_bench_stream_client_counts_and_times_what_the_server_streamed(shared_server: object) -> None:
    import httpx

    from bench.common import stream_completion
    from bench.llama_engine import EOG_BIAS

    url = shared_server.url  # type: ignore[attr-defined]
    body = {"prompt": "Count: one, two, three,", "max_tokens": 12, "temperature": 0, "logit_bias": EOG_BIAS}
    whole = httpx.post(url + "/v1/completions", json=body, timeout=60).json()
    streamed = stream_completion(url, {**body, "stream_options": {"include_usage": True}})

    assert streamed.text == whole["choices"][0]["text"]
    assert streamed.tokens == whole["usage"]["completion_tokens"] == 12
    assert len(streamed.chunk_times) == len(streamed.chunk_chars) >= 1
    assert sum(streamed.chunk_chars) == len(streamed.text)
    assert streamed.started < streamed.first_token == streamed.chunk_times[0] <= streamed.chunk_times[-1]
    assert streamed.chunk_times[-1] <= streamed.ended
    assert streamed.tokens_between(streamed.started, streamed.ended) == 12

    with pytest.raises(RuntimeError, match="HTTP 4"):  # a client mistake is the tool's error, not an empty result
        stream_completion(url, {**body, "max_tokens": -1})
