"""Shared helpers for the benchmarks: start servers on 127.0.0.1, stream requests, summarise timings."""

from __future__ import annotations

import http.client
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
RESULTS = ROOT / "bench" / "results"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Server:
    """A server process on 127.0.0.1 that is stopped on exit."""

    def __init__(self, argv: list[str], port: int, health: str, timeout: float = 120) -> None:
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.log = tempfile.NamedTemporaryFile(prefix="bench-server-", suffix=".log", delete=False)
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}
        self.proc = subprocess.Popen(argv, cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited: {Path(self.log.name).read_text()[-3000:]}")
            try:
                if httpx.get(self.url + health, timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        self.__exit__()  # not left running by a benchmark that fails here
        raise TimeoutError(Path(self.log.name).read_text()[-3000:])

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc: object) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def textgen(*args: str, timeout: float = 120) -> Server:
    port = free_port()
    user_data = tempfile.mkdtemp(prefix="bench-ud-")
    argv = [sys.executable, "server.py", "--nowebui", "--listen-port", str(port), "--user-data-dir", user_data, *args]
    return Server(argv, port, "/health", timeout)


def llama_cpp_server(*args: str) -> Server:
    port = free_port()
    argv = [
        sys.executable,
        "-m",
        "llama_cpp.server",
        "--model",
        str(MODEL),
        "--port",
        str(port),
        "--host",
        "127.0.0.1",
        *args,
    ]
    return Server(argv, port, "/v1/models")


@dataclass
class StreamResult:
    """One streamed request: when it started, when its first token came, how many tokens, when it ended."""

    started: float
    first_token: float
    ended: float
    tokens: int
    text: str = ""
    chunk_times: list[float] = field(default_factory=list)  # when each chunk with text came
    chunk_chars: list[int] = field(default_factory=list)  # and how much text it brought

    def tokens_between(self, low: float, high: float) -> float:
        """Tokens that came in (low, high]: the chunks there when each brought one, else the usage count
        shared out by text length (a chunk carries every token that arrived together)."""
        inside = [c for t, c in zip(self.chunk_times, self.chunk_chars, strict=True) if low < t <= high]
        if self.tokens == len(self.chunk_times) or not sum(self.chunk_chars):
            return float(len(inside))
        return self.tokens * sum(inside) / sum(self.chunk_chars)

    @property
    def ttft(self) -> float:
        return self.first_token - self.started


def stream_completion(
    url: str, body: dict[str, Any], timeout: float = 300, headers: dict[str, str] | None = None
) -> StreamResult:
    """POST a streaming /v1/completions request and count the tokens: the usage record's count when the server
    sends one (a chunk may carry several tokens), else the chunks that carry text.

    The client shares the 2 cores with the server it measures, so while the stream runs it only reads each event
    and notes when it came (the standard library's HTTP client, no JSON); the events are parsed after the stream."""
    target = urllib.parse.urlsplit(url)
    started = time.perf_counter()
    events: list[tuple[float, bytes]] = []
    connection = http.client.HTTPConnection(target.hostname or "127.0.0.1", target.port, timeout=timeout)
    try:
        connection.request(
            "POST",
            target.path.rstrip("/") + "/v1/completions",
            json.dumps({**body, "stream": True}),
            {"Content-Type": "application/json", **(headers or {})},
        )
        response = connection.getresponse()
        if response.status != 200:
            raise RuntimeError(f"{url}: HTTP {response.status}: {response.read()[:500]!r}")
        readline, clock = response.readline, time.perf_counter
        while line := readline():
            if line.startswith(b"data: {"):
                events.append((clock(), line))
        ended = time.perf_counter()
    finally:
        connection.close()
    tokens = usage = 0
    text: list[str] = []
    times: list[float] = []
    chars: list[int] = []
    for when, line in events:
        data = json.loads(line[6:])
        if data.get("usage"):
            usage = int(data["usage"].get("completion_tokens") or 0)
        if data.get("choices") and data["choices"][0].get("text"):
            tokens += 1
            text.append(data["choices"][0]["text"])
            times.append(when)
            chars.append(len(text[-1]))
    return StreamResult(started, times[0] if times else ended, ended, usage or tokens, "".join(text), times, chars)


class CpuAccount:
    """CPU seconds spent while requests ran: by the server's two busiest threads (llama.cpp's compute threads, which
    spin through a step), by its other threads (HTTP, JSON, the event loop, the scheduler's bookkeeping between
    steps) and by this process (the benchmark's clients). On 2 cores every CPU second outside the compute threads
    is taken from a step, so it accounts for what the clients' view of a step costs beyond the engine's own."""

    def __init__(self, server_pid: int) -> None:
        import psutil

        self._server = psutil.Process(server_pid)
        self._me = psutil.Process()
        self.threads: dict[int, float] = {}
        self.client = 0.0
        self._start: tuple[dict[int, float], float] | None = None

    def _snapshot(self) -> tuple[dict[int, float], float]:
        threads = {t.id: t.user_time + t.system_time for t in self._server.threads()}
        mine = self._me.cpu_times()
        return threads, mine.user + mine.system

    def __enter__(self) -> CpuAccount:
        self._start = self._snapshot()
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._start is not None
        threads, client = self._snapshot()
        for tid, seconds in threads.items():
            self.threads[tid] = self.threads.get(tid, 0.0) + seconds - self._start[0].get(tid, 0.0)
        self.client += client - self._start[1]

    def summary(self, tokens: int) -> dict[str, float]:
        """Milliseconds of CPU per generated token, by part."""
        busiest = sorted(self.threads.values(), reverse=True)
        per = 1000 / max(tokens, 1)
        return {
            "server_compute_threads_ms": sum(busiest[:2]) * per,
            "server_other_threads_ms": sum(busiest[2:]) * per,
            "clients_ms": self.client * per,
        }


def metrics(url: str, prefix: str = "textgen_") -> dict[str, float]:
    """The samples of a server's ``/metrics`` whose name starts with ``prefix``: {name and labels: value}."""
    text = httpx.get(url + "/metrics", timeout=10).text
    return {line.split()[0]: float(line.split()[1]) for line in text.splitlines() if line.startswith(prefix)}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return 0.0
    k = (len(ordered) - 1) * q
    low, high = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (k - low)


def cpu_name() -> str:
    """The CPU's model name (``AMD EPYC``, ``Intel(R) Xeon(R) Platinum 8481C``, ...): numerics and speeds differ
    between them, so every figure names it."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                amx = " with AMX" if "amx_tile" in Path("/proc/cpuinfo").read_text() else ""
                return line.split(":", 1)[1].strip() + amx
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine() -> dict[str, Any]:
    import psutil

    return {
        "cpu": cpu_name(),
        "cores": psutil.cpu_count(logical=False),
        "threads": psutil.cpu_count(),
        "memory_gb": round(psutil.virtual_memory().total / 2**30, 1),
        "python": platform.python_version(),
        "system": platform.platform(),
    }


def write_result(name: str, data: dict[str, Any]) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps({"machine": machine(), "time": time.strftime("%Y-%m-%d %H:%M:%S"), **data}, indent=2))
    return path
