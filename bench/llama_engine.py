"""llama.cpp engine benchmarks, each side measured in the same run on the default model.

1. single stream: one streamed request through textgen's HTTP API vs raw ``Llama.create_completion`` in this
   process (same prompt, 128 new tokens, greedy, end-of-sequence banned on both sides);
2. concurrency: 8 concurrent streaming clients (128 new tokens each) vs ``python -m llama_cpp.server`` serving the
   same file with the same threads: aggregate tokens/s and p95 time to first token;
3. prompt cache: time to first token of the third turn of a chat, with the prompt cache and without it.
"""

from __future__ import annotations

import statistics
import threading
import time
from typing import Any

import httpx

from bench.common import MODEL, StreamResult, llama_cpp_server, percentile, stream_completion, textgen

NEW_TOKENS = 128
PROMPT = "Write a long, detailed story about a lighthouse keeper who finds a message in a bottle."
EOG_BIAS = {"0": -100, "2": -100, "4": -100}  # SmolLM2's end-of-generation tokens
THREADS = 2
REPEATS = 3


def single_stream(rounds: int = 7) -> dict[str, Any]:
    """Alternate raw and API runs (both warm) and compare the medians, to tame this machine's noise."""
    from llama_cpp import Llama

    llm = Llama(str(MODEL), n_ctx=4096, n_threads=THREADS, n_threads_batch=THREADS, n_batch=512, verbose=False)
    bias = {int(k): float(v) for k, v in EOG_BIAS.items()}
    body = {"prompt": PROMPT, "max_tokens": NEW_TOKENS, "temperature": 0, "logit_bias": EOG_BIAS}
    raw: list[float] = []
    ours: list[float] = []
    with textgen("--threads", str(THREADS)) as server:
        llm.create_completion(PROMPT, max_tokens=8, temperature=0)  # warm-up both
        stream_completion(server.url, {**body, "max_tokens": 8})
        for _ in range(rounds):
            time.sleep(0.5)
            started = time.perf_counter()
            out = llm.create_completion(PROMPT, max_tokens=NEW_TOKENS, temperature=0, logit_bias=bias)
            raw.append(out["usage"]["completion_tokens"] / (time.perf_counter() - started))
            time.sleep(0.5)
            result = stream_completion(server.url, body)
            ours.append(result.tokens / (result.ended - result.started))
    llm.close()
    r, o = statistics.median(raw), statistics.median(ours)
    return {
        "raw_tokens_per_s": r,
        "textgen_tokens_per_s": o,
        "ratio": o / r,
        "target": ">= 0.95",
        "raw_runs": raw,
        "textgen_runs": ours,
    }


def _concurrent(url: str, clients: int) -> dict[str, float]:
    results: list[StreamResult] = []
    lock = threading.Lock()

    def one(i: int) -> None:
        body = {
            "prompt": f"{PROMPT} Chapter {i + 1}.",
            "max_tokens": NEW_TOKENS,
            "temperature": 0.8,
            "seed": i,
            "logit_bias": EOG_BIAS,
        }
        result = stream_completion(url, body)
        with lock:
            results.append(result)

    stream_completion(url, {"prompt": PROMPT, "max_tokens": 4})  # warm-up
    threads = [threading.Thread(target=one, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    start = min(r.started for r in results)
    end = max(r.ended for r in results)
    tokens = sum(r.tokens for r in results)
    return {
        "tokens": tokens,
        "seconds": end - start,
        "tokens_per_s": tokens / (end - start),
        "p95_ttft_s": percentile([r.ttft for r in results], 0.95),
    }


def concurrency(clients: int = 8) -> dict[str, Any]:
    with textgen("--threads", str(THREADS), "--parallel", str(clients)) as server:
        ours = _concurrent(server.url, clients)
    with llama_cpp_server(
        "--n_threads",
        str(THREADS),
        "--n_threads_batch",
        str(THREADS),
        "--n_ctx",
        "4096",
        "--interrupt_requests",
        "False",
    ) as peer:
        theirs = _concurrent(peer.url, clients)
    return {
        "clients": clients,
        "textgen": ours,
        "llama_cpp_server": theirs,
        "ratio": ours["tokens_per_s"] / theirs["tokens_per_s"],
        "target": ">= 1.5, and p95 TTFT lower than the peer's",
        "ttft_lower": ours["p95_ttft_s"] < theirs["p95_ttft_s"],
    }


LONG_SYSTEM = (
    "You are a helpful assistant for a hardware store. Here is the catalogue you know about:\n"
    + "\n".join(f"- Item {i}: a {c} {t} made of {m}, sold in packs of {i % 7 + 1}." for i, (c, t, m) in enumerate(
        [(c, t, m) for c in ("red", "blue", "green", "black") for t in ("hammer", "wrench", "drill", "saw", "clamp") for m in ("steel", "oak", "plastic", "brass", "iron")]
    ))
)  # fmt: skip


def _third_turn_ttft(url: str) -> float:
    client = httpx.Client(timeout=120)
    history: list[dict[str, str]] = [{"role": "system", "content": LONG_SYSTEM}]
    ttft = 0.0
    for turn, question in enumerate(
        ["Which hammers do you have?", "And which saws?", "Which items are made of brass?"]
    ):
        history.append({"role": "user", "content": question})
        body = {"messages": history, "max_tokens": 32, "temperature": 0, "stream": True}
        started = time.perf_counter()
        first = 0.0
        text = ""
        with client.stream("POST", url + "/v1/chat/completions", json=body) as response:
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    import json

                    delta = json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
                    if delta and not first:
                        first = time.perf_counter()
                    text += delta
        history.append({"role": "assistant", "content": text})
        if turn == 2:
            ttft = (first or time.perf_counter()) - started
    return ttft


def prompt_cache() -> dict[str, Any]:
    results = {}
    for label, flags in (("with_cache", []), ("without_cache", ["--no-prompt-cache"])):
        with textgen("--threads", str(THREADS), *flags) as server:
            results[label] = statistics.median(_third_turn_ttft(server.url) for _ in range(REPEATS))
    return {
        "third_turn_ttft_with_cache_s": results["with_cache"],
        "third_turn_ttft_without_cache_s": results["without_cache"],
        "ratio": results["with_cache"] / results["without_cache"],
        "target": "<= 0.5",
    }
