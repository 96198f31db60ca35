"""Load and reliability: many mixed requests at once against the real server, then checks that nothing leaked.

Starts ``server.py`` (the default model, llama.cpp) on 127.0.0.1 with a temporary user_data and fires N requests
(default 500) from C concurrent clients (default 16): chat and completions, streaming and not, 8-32 new tokens
each; one request in ten is a stream that the client closes after a few tokens. It then checks, against the
server's own state after a warm-up measured in the same run:

- no 5xx answer (and no error event inside a stream, no broken stream, no transport error);
- every slot free at the end (``busy_slots`` and ``queue_depth`` of ``GET /metrics`` back to 0);
- the process's thread count did not grow (``Threads`` of /proc/PID/status);
- its resident memory grew by less than 50 MB from after the warm-up to the end;
- a client that disconnects frees its slot quickly (a long stream, and a non-streaming request, closed mid-way).

Exit status 1 when a target is missed.

    python -m bench.load                      # 500 requests, 16 concurrent
    python -m bench.load --quick              # 60 requests, a smoke run
    python -m bench.load --requests 200 --concurrency 8 --parallel 8
"""

from __future__ import annotations

import argparse
import json
import random
import socket
import statistics
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bench.common import ROOT, machine, percentile, textgen, write_result

EOG_BIAS = {"0": -100, "2": -100, "4": -100}  # SmolLM2's end-of-generation tokens
RSS_GROWTH_LIMIT_MB = 50.0
THREAD_SLACK = 4  # worker threads may come and go a little between two idle moments
DISCONNECT_LIMIT_S = 1.0
CANCEL_EVERY = 10  # every 10th request is a stream closed by the client
PROMPTS = [
    "Tell me about the sea.",
    "Write a haiku about autumn leaves.",
    "What is the capital of France? Explain briefly.",
    "List three uses of a paperclip.",
    "Describe a quiet morning in a small village.",
    "Why is the sky blue?",
    "Give me a short tip for learning to cook.",
    "Summarise the plot of a detective story in one sentence.",
]


@dataclass
class Job:
    """One request to send."""

    index: int
    endpoint: str  # "chat" | "completions"
    stream: bool
    max_tokens: int
    prompt: str
    cancel_after: int = 0  # > 0: close the connection after this many content chunks


@dataclass
class Outcome:
    """What came back for one job."""

    index: int
    kind: str
    status: str  # the HTTP status code, or the name of a transport error
    latency: float = 0.0
    ttft: float = 0.0
    tokens: int = 0
    cancelled: bool = False
    problem: str = ""  # an error event inside a 200 stream, a stream without [DONE], a malformed body


@dataclass
class Sample:
    """The server process at one moment."""

    threads: int
    rss_mb: float


@dataclass
class Monitor:
    """Samples the server process every half second while the load runs."""

    pid: int
    samples: list[Sample] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            self.samples.append(proc_sample(self.pid))

    def __enter__(self) -> Monitor:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def proc_sample(pid: int) -> Sample:
    """Threads and resident memory of a process, from /proc/PID/status."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        fields[key] = value.strip()
    return Sample(threads=int(fields["Threads"]), rss_mb=int(fields["VmRSS"].split()[0]) / 1024)


def slot_state(client: httpx.Client) -> dict[str, float]:
    """``slots``, ``busy_slots`` and ``queue_depth`` from the server's /metrics."""
    state: dict[str, float] = {}
    for line in client.get("/metrics", timeout=10).text.splitlines():
        for name in ("slots", "busy_slots", "queue_depth"):
            if line.startswith(f"textgen_{name} "):
                state[name] = float(line.split()[1])
    return state


def wait_slots_free(client: httpx.Client, timeout: float = 10.0) -> tuple[bool, float, dict[str, float]]:
    """Poll until no slot is busy and nothing waits; (free, seconds it took, last state)."""
    started = time.perf_counter()
    state = slot_state(client)
    while state.get("busy_slots", 1) or state.get("queue_depth", 1):
        if time.perf_counter() - started > timeout:
            return False, time.perf_counter() - started, state
        time.sleep(0.01)
        state = slot_state(client)
    return True, time.perf_counter() - started, state


def make_jobs(count: int, seed: int, offset: int = 0, max_tokens: tuple[int, int] = (8, 32)) -> list[Job]:
    """A reproducible mix: chat or completions, streaming or not, 8-32 new tokens, every 10th a cancelled stream."""
    rng = random.Random(seed)
    low, high = max_tokens
    jobs = []
    for i in range(count):
        cancel = i % CANCEL_EVERY == CANCEL_EVERY - 1
        jobs.append(
            Job(
                index=offset + i,
                endpoint=rng.choice(["chat", "completions"]),
                stream=cancel or rng.random() < 0.5,
                max_tokens=high if cancel else rng.randint(low, high),
                prompt=rng.choice(PROMPTS),
                cancel_after=rng.randint(1, 4) if cancel else 0,
            )
        )
    return jobs


def request_body(job: Job) -> tuple[str, dict[str, Any]]:
    body: dict[str, Any] = {"max_tokens": job.max_tokens, "temperature": 0.7, "seed": job.index}
    if job.stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    if job.cancel_after:
        body["logit_bias"] = EOG_BIAS  # make sure there is something left to cancel
    if job.endpoint == "chat":
        return "/v1/chat/completions", body | {"messages": [{"role": "user", "content": job.prompt}]}
    return "/v1/completions", body | {"prompt": job.prompt}


def chunk_text(data: dict[str, Any]) -> str:
    choices = data.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    return str(choice.get("text") or (choice.get("delta") or {}).get("content") or "")


def send(client: httpx.Client, job: Job) -> Outcome:
    """Send one job and describe what came back."""
    path, body = request_body(job)
    kind = f"{job.endpoint}{' stream' if job.stream else ''}{' cancelled' if job.cancel_after else ''}"
    out = Outcome(job.index, kind, "", cancelled=bool(job.cancel_after))
    started = time.perf_counter()
    try:
        if not job.stream:
            response = client.post(path, json=body)
            out.status = str(response.status_code)
            if response.status_code == 200:
                data = response.json()
                out.tokens = int(data.get("usage", {}).get("completion_tokens", 0))
                if not data.get("choices"):
                    out.problem = "no choices"
        else:
            with client.stream("POST", path, json=body) as response:
                out.status = str(response.status_code)
                if response.status_code != 200:
                    response.read()
                else:
                    done, chunks = False, 0
                    for line in response.iter_lines():
                        if not line.startswith("data: "):
                            continue
                        if line == "data: [DONE]":
                            done = True
                            break
                        data = json.loads(line[6:])
                        if "error" in data:
                            out.problem = f"error event: {data['error'].get('message', '')[:120]}"
                            break
                        if data.get("usage"):
                            out.tokens = int(data["usage"].get("completion_tokens", 0))
                        if chunk_text(data):
                            chunks += 1
                            if chunks == 1:
                                out.ttft = time.perf_counter() - started
                            if job.cancel_after and chunks >= job.cancel_after:
                                out.tokens = chunks
                                break  # leaving the block closes the connection mid-stream
                    if not done and not job.cancel_after and not out.problem:
                        out.problem = "stream ended without [DONE]"
                    if job.cancel_after and not chunks and not out.problem:
                        out.problem = "cancelled stream sent no text"
    except httpx.HTTPError as exc:
        out.status = type(exc).__name__
    except ValueError as exc:  # a body that is not JSON
        out.problem = f"malformed: {exc}"[:160]
    out.latency = time.perf_counter() - started
    return out


def fire(url: str, jobs: list[Job], concurrency: int, deadline: float) -> tuple[list[Outcome], float, int]:
    """Send the jobs from ``concurrency`` clients; (outcomes, wall seconds, jobs skipped at the deadline)."""
    outcomes: list[Outcome] = []
    lock = threading.Lock()
    queue = list(reversed(jobs))
    skipped = 0

    def worker() -> None:
        nonlocal skipped
        with httpx.Client(base_url=url, timeout=120) as client:
            while True:
                with lock:
                    if not queue:
                        return
                    job = queue.pop()
                    if time.monotonic() > deadline:
                        skipped += 1
                        continue
                result = send(client, job)
                with lock:
                    outcomes.append(result)

    started = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        for future in [pool.submit(worker) for _ in range(concurrency)]:
            future.result()
    return sorted(outcomes, key=lambda o: o.index), time.perf_counter() - started, skipped


def raw_request(port: int, path: str, body: dict[str, Any]) -> socket.socket:
    """Send a POST on a bare socket (so that closing it is a plain client disconnect)."""
    payload = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    head = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\n\r\n"
    )
    sock.sendall(head.encode() + payload)
    return sock


def disconnect_time(client: httpx.Client, port: int, stream: bool) -> float:
    """Start a long generation, close its connection once it generates, and time until its slot is free."""
    body: dict[str, Any] = {"prompt": "Write a very long story.", "max_tokens": 2000, "logit_bias": EOG_BIAS}
    if stream:
        body["stream"] = True
    sock = raw_request(port, "/v1/completions", body)
    try:
        if stream:
            received = b""
            while received.count(b"data: {") < 3:  # a few tokens streamed: it is mid-generation
                chunk = sock.recv(65536)
                if not chunk:
                    raise RuntimeError(f"stream closed early: {received[-500:]!r}")
                received += chunk
        else:
            deadline = time.monotonic() + 30
            while not slot_state(client).get("busy_slots"):
                if time.monotonic() > deadline:
                    raise RuntimeError("the non-streaming request never took a slot")
                time.sleep(0.01)
            time.sleep(0.3)  # well into its generation
    finally:
        closed = time.perf_counter()
        sock.close()
    free, _, state = wait_slots_free(client, timeout=30)
    if not free:
        raise RuntimeError(f"slot still busy 30 s after the client left: {state}")
    return time.perf_counter() - closed


def summarise(outcomes: list[Outcome], wall: float) -> dict[str, Any]:
    statuses = Counter(o.status for o in outcomes)
    finished = [o for o in outcomes if not o.cancelled and o.status == "200" and not o.problem]
    latencies = [o.latency for o in finished]
    ttfts = [o.ttft for o in finished if o.ttft]
    tokens = sum(o.tokens for o in outcomes if o.status == "200")
    return {
        "requests": len(outcomes),
        "status_counts": dict(sorted(statuses.items())),
        "server_errors": sum(n for s, n in statuses.items() if s.startswith("5")),
        "transport_errors": sum(n for s, n in statuses.items() if not s.isdigit()),
        "problems": [f"#{o.index} {o.kind}: {o.problem}" for o in outcomes if o.problem],
        "cancelled": sum(1 for o in outcomes if o.cancelled),
        "by_kind": dict(sorted(Counter(o.kind for o in outcomes).items())),
        "latency_p50_s": percentile(latencies, 0.5),
        "latency_p95_s": percentile(latencies, 0.95),
        "stream_ttft_p50_s": percentile(ttfts, 0.5),
        "stream_ttft_p95_s": percentile(ttfts, 0.95),
        "completion_tokens": tokens,
        "seconds": wall,
        "tokens_per_s": tokens / wall if wall else 0.0,
    }


def run(
    requests: int = 500,
    concurrency: int = 16,
    parallel: int | None = None,
    threads: int | None = None,
    time_limit: float = 300.0,
    disconnect_rounds: int = 3,
    max_tokens: tuple[int, int] = (8, 32),
    warmup: int | None = None,
    seed: int = 0,
    log: Any = print,
) -> dict[str, Any]:
    """The whole load run; the result's ``failures`` lists every target missed (empty: all met)."""
    args = ["--parallel", str(parallel)] if parallel else []
    args += ["--threads", str(threads)] if threads else []
    with textgen(*args) as server, httpx.Client(base_url=server.url, timeout=30) as client:
        pid = server.proc.pid
        at_start = proc_sample(pid)
        slots = int(slot_state(client).get("slots", 0))
        log(f"server pid {pid} on {server.url}: {slots} slots, {at_start.threads} threads, {at_start.rss_mb:.0f} MB")

        # idle reference: the same kind of request, one at a time
        idle_jobs = make_jobs(6, seed + 1, offset=10_000, max_tokens=max_tokens)
        idle = [send(client, job).latency for job in idle_jobs]
        warm_jobs = make_jobs(warmup or max(2 * concurrency, 20), seed + 2, offset=20_000, max_tokens=max_tokens)
        warm, _, _ = fire(server.url, warm_jobs, concurrency, time.monotonic() + min(time_limit, 60.0))
        wait_slots_free(client)
        after_warmup = proc_sample(pid)
        log(f"after warm-up ({len(warm)} requests): {after_warmup.threads} threads, {after_warmup.rss_mb:.1f} MB")

        jobs = make_jobs(requests, seed, max_tokens=max_tokens)
        with Monitor(pid) as monitor:
            outcomes, wall, skipped = fire(server.url, jobs, concurrency, time.monotonic() + time_limit)
        load = summarise(outcomes, wall)
        free, drain_s, state = wait_slots_free(client)
        at_end = proc_sample(pid)
        log(f"load done in {wall:.1f} s; slots free: {free} ({drain_s:.2f} s after the last answer)")

        stream_disconnect = [disconnect_time(client, server.port, stream=True) for _ in range(disconnect_rounds)]
        plain_disconnect = [disconnect_time(client, server.port, stream=False) for _ in range(disconnect_rounds)]
        free_after_disconnects, _, _ = wait_slots_free(client)
        after_disconnects = proc_sample(pid)
        alive = server.proc.poll() is None and client.get("/health").status_code == 200

    peak = max(monitor.samples, key=lambda s: s.threads, default=at_end)
    result: dict[str, Any] = {
        "requests": requests,
        "concurrency": concurrency,
        "server_threads_flag": threads,
        "max_tokens": list(max_tokens),
        "slots": slots,
        "skipped_at_time_limit": skipped,
        "warmup_status_counts": dict(sorted(Counter(o.status for o in warm).items())),
        **load,
        "idle_latency_p50_s": statistics.median(idle),
        "idle_latency_p95_s": percentile(idle, 0.95),
        "slots_free_at_end": free and free_after_disconnects,
        "slot_state_at_end": state,
        "drain_s": drain_s,
        "threads": {
            "start": at_start.threads,
            "after_warmup": after_warmup.threads,
            "peak": peak.threads,
            "end": at_end.threads,
            "after_disconnect_tests": after_disconnects.threads,
        },
        "rss_mb": {
            "start": at_start.rss_mb,
            "after_warmup": after_warmup.rss_mb,
            "peak": max((s.rss_mb for s in monitor.samples), default=at_end.rss_mb),
            "end": at_end.rss_mb,
            "after_disconnect_tests": after_disconnects.rss_mb,
        },
        "rss_growth_mb": after_disconnects.rss_mb - after_warmup.rss_mb,
        "disconnect_stream_s": stream_disconnect,
        "disconnect_non_stream_s": plain_disconnect,
        "server_alive": alive,
        "targets": {
            "server_errors": "0 (and no transport error, broken stream or error event)",
            "slots_free_at_end": "true",
            "threads": f"end <= after warm-up + {THREAD_SLACK}",
            "rss_growth_mb": f"< {RSS_GROWTH_LIMIT_MB:.0f}",
            "disconnect_s": f"< {DISCONNECT_LIMIT_S:.1f} (worst of the rounds)",
        },
    }
    result["failures"] = failures(result)
    return result


def failures(r: dict[str, Any]) -> list[str]:
    """Every target the result misses, in words."""
    missed = []
    if r["server_errors"]:
        missed.append(f"{r['server_errors']} responses with a 5xx status")
    if r["transport_errors"]:
        missed.append(f"{r['transport_errors']} requests failed in transport")
    if r["problems"]:
        missed.append(f"{len(r['problems'])} bad bodies or streams: {'; '.join(r['problems'][:5])}")
    warm_bad = {s: n for s, n in r.get("warmup_status_counts", {}).items() if not s.startswith("2")}
    if warm_bad:
        missed.append(f"warm-up answers that were not 2xx: {warm_bad}")
    if r["skipped_at_time_limit"]:
        missed.append(f"{r['skipped_at_time_limit']} requests not sent within the time limit")
    if not r["slots_free_at_end"]:
        missed.append(f"slots still busy at the end: {r['slot_state_at_end']}")
    t = r["threads"]
    if max(t["end"], t["after_disconnect_tests"]) > t["after_warmup"] + THREAD_SLACK:
        missed.append(f"threads grew from {t['after_warmup']} to {max(t['end'], t['after_disconnect_tests'])}")
    if r["rss_growth_mb"] >= RSS_GROWTH_LIMIT_MB:
        missed.append(f"RSS grew by {r['rss_growth_mb']:.1f} MB")
    worst = max(r["disconnect_stream_s"] + r["disconnect_non_stream_s"], default=0.0)
    if worst >= DISCONNECT_LIMIT_S:
        missed.append(f"a disconnected client's slot took {worst:.2f} s to free")
    if not r["server_alive"]:
        missed.append("the server is not healthy at the end")
    return missed


def table(r: dict[str, Any]) -> str:
    """The printed table: measure, value, reference measured in the same run, target."""
    t, m = r["threads"], r["rss_mb"]
    statuses = ", ".join(f"{s}: {n}" for s, n in r["status_counts"].items())
    worst_stream = max(r["disconnect_stream_s"], default=0.0)
    worst_plain = max(r["disconnect_non_stream_s"], default=0.0)
    rows = [
        ("requests (concurrent clients / slots)", f"{r['requests']} ({r['concurrency']} / {r['slots']})", "", ""),
        ("status codes", statuses, "", "no 5xx"),
        ("transport errors, bad streams", f"{r['transport_errors']}, {len(r['problems'])}", "", "0, 0"),
        ("cancelled mid-stream by the client", str(r["cancelled"]), "", ""),
        (
            "latency p50 / p95",
            f"{r['latency_p50_s']:.2f} s / {r['latency_p95_s']:.2f} s",
            f"{r['idle_latency_p50_s']:.2f} s / {r['idle_latency_p95_s']:.2f} s (one at a time)",
            "for the record",
        ),
        ("stream time to first token p50 / p95", f"{r['stream_ttft_p50_s']:.2f} s / {r['stream_ttft_p95_s']:.2f} s",
         "", "for the record"),
        ("completion tokens/s (all clients)", f"{r['tokens_per_s']:.1f} ({r['completion_tokens']} in "
         f"{r['seconds']:.1f} s)", "", "for the record"),
        ("all slots free at the end", "yes" if r["slots_free_at_end"] else f"NO {r['slot_state_at_end']}", "",
         "yes"),
        ("server threads at end (peak)", f"{max(t['end'], t['after_disconnect_tests'])} ({t['peak']})",
         f"{t['after_warmup']} after warm-up ({t['start']} at start)", f"<= +{THREAD_SLACK}"),
        ("server RSS at end", f"{m['after_disconnect_tests']:.1f} MB (+{r['rss_growth_mb']:.1f} MB)",
         f"{m['after_warmup']:.1f} MB after warm-up", f"< +{RSS_GROWTH_LIMIT_MB:.0f} MB"),
        ("disconnect to slot free, stream (worst)", f"{worst_stream * 1000:.0f} ms",
         f"{len(r['disconnect_stream_s'])} rounds", f"< {DISCONNECT_LIMIT_S * 1000:.0f} ms"),
        ("disconnect to slot free, non-stream (worst)", f"{worst_plain * 1000:.0f} ms",
         f"{len(r['disconnect_non_stream_s'])} rounds", f"< {DISCONNECT_LIMIT_S * 1000:.0f} ms"),
    ]  # fmt: skip
    lines = ["| measure | textgen | reference (same run) | target |", "|---|---|---|---|"]
    lines += [f"| {' | '.join(row)} |" for row in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.load", description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=500, help="requests to send (default 500)")
    parser.add_argument("--concurrency", type=int, default=16, help="concurrent clients (default 16)")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 60 requests")
    parser.add_argument("--parallel", type=int, default=None, help="server slots (default: the server's)")
    parser.add_argument("--threads", type=int, default=None, help="the server's --threads (default: the server's)")
    parser.add_argument("--time-limit", type=float, default=300.0, help="stop sending after this many seconds")
    parser.add_argument("--disconnect-rounds", type=int, default=3, help="rounds of each disconnect test")
    parser.add_argument("--max-tokens", default="8-32", help="new tokens per request, LOW-HIGH (default 8-32)")
    parser.add_argument("--no-save", action="store_true", help="do not write bench/results/load.json")
    args = parser.parse_args(argv)
    if args.requests < 1 or args.concurrency < 1 or args.disconnect_rounds < 1:
        parser.error("--requests, --concurrency and --disconnect-rounds must be at least 1")
    try:
        low, high = (int(v) for v in args.max_tokens.split("-"))
    except ValueError:
        parser.error("--max-tokens must look like 8-32")
    if not 1 <= low <= high:
        parser.error("--max-tokens must look like 8-32, with 1 <= LOW <= HIGH")
    requests = 60 if args.quick else args.requests
    result = run(
        requests, args.concurrency, args.parallel, args.threads, args.time_limit, args.disconnect_rounds, (low, high)
    )
    m = machine()
    print()
    print(f"Machine: {m['cpu']}, {m['cores']} cores / {m['threads']} threads, {m['memory_gb']} GiB.")
    print(table(result))
    if not args.no_save:
        path = write_result("load", result)
        print(f"wrote {path.relative_to(ROOT)}")
    if result["failures"]:
        print("\nTARGETS MISSED:\n- " + "\n- ".join(result["failures"]), file=sys.stderr)
        return 1
    print("\nall targets met")
    return 0


if __name__ == "__main__":
    sys.exit(main())
