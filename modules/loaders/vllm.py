"""vLLM, started and supervised by textgen: the engine runs as a child process from its own venv (``make vllm``
makes ``.venv-vllm``), on a free port of 127.0.0.1, and is spoken to as a remote engine (``remote.py``).

``--loader vllm --model NAME`` starts ``python -m vllm.entrypoints.openai.api_server`` on ``models/NAME`` with the
plan's context (``--n-ctx`` -> ``--max-model-len``) and KV-cache memory (``--vllm-kv-cache-gb``: on a CPU
``VLLM_CPU_KVCACHE_SPACE``, on a GPU ``--kv-cache-memory-bytes``), reports its start in the log and the Model tab,
and waits for its ``/health``. An engine that dies is reported with its exit (the signal and what sends it) and the
last lines it printed, and started again up to ``--vllm-restarts`` times; requests meanwhile get a 503 that says so.
Unloading stops it (SIGTERM to its process group, SIGKILL after 30 s); if textgen itself dies, the kernel sends the
engine SIGTERM (``PR_SET_PDEATHSIG``), so no engine is left behind. An engine textgen did not start (a cluster, Ray,
another machine) is ``--loader remote``.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import json
import logging
import math
import os
import queue
import secrets
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import httpx

from modules.errors import EngineUnavailable, ModelLoadError
from modules.generation.params import GenerationParams
from modules.jobs import describe_exit
from modules.loaders import OPTIONS
from modules.loaders.base import TokenEvent
from modules.loaders.remote import RemoteBackend
from modules.paths import resolve

log = logging.getLogger(__name__)
STOP_GRACE_S = 30.0
CUT_WAIT_S = 5.0  # how long a stream whose connection broke waits to learn whether (and how) the engine died
LOG_LINES = 200  # the engine's last lines, kept for the error a death or a failed start reports


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _libc_prctl() -> Any:
    """libc's prctl, looked up here in the parent: a dlopen between fork and exec can deadlock."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_PRCTL = _libc_prctl()
PR_SET_PDEATHSIG = 1


def _die_with(parent: int) -> Callable[[], None]:
    """What the child runs between fork and exec: SIGTERM when textgen goes, and out at once if it is gone already."""

    def run() -> None:
        if _PRCTL is not None:
            _PRCTL(PR_SET_PDEATHSIG, signal.SIGTERM)
            if os.getppid() != parent:
                os._exit(1)

    return run


_spawns: queue.SimpleQueue[tuple[dict[str, Any], Future[subprocess.Popen[str]]]] = queue.SimpleQueue()
_spawner_lock = threading.Lock()
_spawner: threading.Thread | None = None


def _spawn_forever() -> None:
    while True:
        kwargs, future = _spawns.get()
        try:
            future.set_result(subprocess.Popen(**kwargs))
        except BaseException as exc:
            future.set_exception(exc)


def spawn(**kwargs: Any) -> subprocess.Popen[str]:
    """``subprocess.Popen(**kwargs)`` from one thread that lives as long as textgen: PR_SET_PDEATHSIG fires when
    the *thread* that started a child ends, so a child started from a request's worker thread would be sent SIGTERM
    as soon as that thread is done."""
    global _spawner
    with _spawner_lock:
        if _spawner is None or not _spawner.is_alive():
            _spawner = threading.Thread(target=_spawn_forever, name="vllm-spawner", daemon=True)
            _spawner.start()
    future: Future[subprocess.Popen[str]] = Future()
    _spawns.put((kwargs, future))
    return future.result()


def kv_cache_bytes(folder: Path, n_ctx: int, parallel: int) -> int:
    """Bytes of KV cache ``parallel`` full contexts of ``n_ctx`` tokens take in 16-bit, from ``config.json``;
    0 when the config does not say."""
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return 0
    text = config.get("text_config") or config
    layers = text.get("num_hidden_layers")
    heads = text.get("num_attention_heads")
    kv_heads = text.get("num_key_value_heads") or heads
    head_dim = text.get("head_dim") or (text.get("hidden_size", 0) // heads if heads else 0)
    if not (layers and kv_heads and head_dim):
        return 0
    return int(layers * kv_heads * head_dim * 2 * 2 * n_ctx * parallel)


class Engine:
    """One vLLM api_server child process: started, watched, stopped."""

    def __init__(self, command: list[str], env: dict[str, str], port: int, name: str, api_key: str = "") -> None:
        self.command, self.env, self.port, self.name = command, env, port, name
        self.api_key = api_key  # what the engine's /v1 routes ask for (textgen's own key and admin rules are ours)
        self.url = f"http://127.0.0.1:{port}"
        self.lines: collections.deque[str] = collections.deque(maxlen=LOG_LINES)
        self.proc: subprocess.Popen[str] | None = None
        self.stopping = False
        self.generation = 0  # counts the starts: a stream knows whether the engine it spoke to is the one now
        self.exits: dict[int, str] = {}  # generation -> how that process ended, kept when the next one starts
        self._lock = threading.Lock()  # start and stop never cross: a stop during a restart stops the new one

    def start(self) -> None:
        """Start the process (not yet serving: see :meth:`wait_ready`); nothing once :meth:`stop` was called."""
        with self._lock:
            if self.stopping:
                raise ModelLoadError(f"the vLLM engine for {self.name} was stopped")
            self.kill_group()  # what is left of the last one (its engine-core process) goes first
            if self.proc is not None:  # how the last one ended, for a stream of it that reads its cut late
                self.exits[self.generation] = self.exit_text()
            self._start()

    def _start(self) -> None:
        self.lines.clear()
        self.generation += 1
        log.info("vllm: starting %s", shlex.join(self.command))
        self.proc = spawn(
            args=self.command,
            env=self.env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
            bufsize=1,
            start_new_session=True,  # its own process group: stop() ends the engine core processes with it
            preexec_fn=_die_with(os.getpid()),
        )
        threading.Thread(target=self._read, args=(self.proc,), name="vllm-log", daemon=True).start()

    def _read(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            line = line.rstrip()
            if line:
                self.lines.append(line)
                log.debug("vllm[%d]: %s", proc.pid, line)

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def exit_text(self) -> str:
        """Why it is not running, with the last lines it printed."""
        code = self.proc.poll() if self.proc is not None else None
        tail = "\n".join(list(self.lines)[-12:])
        return describe_exit("vLLM engine", code) + (f". Its last lines:\n{tail}" if tail else "")

    def ended_since(self, generation: int, wait: float) -> bool:
        """Whether the process that was start number ``generation`` has ended (not by our stop), waiting up to
        ``wait`` s for it: a killed engine's sockets close while the kernel is still tearing the process down, and
        a stream sees its connection break before the process can be reaped and its exit code read."""
        deadline = time.monotonic() + wait
        while not self.stopping:
            if self.generation != generation or not self.alive():
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)
        return False

    def exit_of(self, generation: int) -> str:
        """How the process of start number ``generation`` ended (it has: see :meth:`ended_since`)."""
        with self._lock:  # not while a restart swaps the process and clears its lines
            if generation in self.exits:
                return self.exits[generation]
            if generation == self.generation:
                return self.exit_text()
        return "the vLLM engine ended and was started again"

    def last_line(self) -> str:
        return self.lines[-1] if self.lines else ""

    def wait_ready(self, timeout: float, progress: Callable[[str], None] | None = None) -> None:
        """Wait for ``/health`` to answer 200; ModelLoadError if the process ends or ``timeout`` passes first."""
        started = time.monotonic()
        said = 0.0
        with httpx.Client(base_url=self.url, timeout=2.0) as client:
            while True:
                waited = time.monotonic() - started
                if not self.alive():
                    raise ModelLoadError(f"vLLM could not start {self.name}: {self.exit_text()}")
                with contextlib.suppress(httpx.HTTPError):
                    if client.get("/health").status_code == 200:
                        log.info("vllm: %s serving on port %d after %.0f s", self.name, self.port, waited)
                        return
                if waited > timeout:
                    tail = "\n".join(list(self.lines)[-12:])
                    self.stop()
                    raise ModelLoadError(
                        f"vLLM did not start {self.name} within {timeout:.0f} s (--vllm-start-timeout); it was "
                        f"stopped. Its last lines:\n{tail}"
                    )
                if waited - said >= 5:
                    said = waited
                    step = self.last_line()[-160:]
                    if progress is not None:
                        progress(f"starting vLLM ({waited:.0f} s){': ' + step if step else ''}")
                    log.info("vllm: starting %s, %.0f s: %s", self.name, waited, step)
                time.sleep(0.5)

    def stop(self) -> None:
        """SIGTERM to the engine's process group, SIGKILL if it has not ended after STOP_GRACE_S; then whatever
        is left of the group (vLLM's engine-core process does not watch its parent)."""
        with self._lock:
            self.stopping = True
            proc = self.proc
        if proc is None:
            return
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                log.warning("vllm: the engine did not stop within %.0f s; killing it", STOP_GRACE_S)
        self.kill_group()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(10)
        log.info("vllm: engine for %s stopped", self.name)

    def kill_group(self) -> None:
        """SIGKILL what is left of the engine's process group: when the API server ends, vLLM's engine-core
        process may live on, holding its memory, and it does not watch its parent."""
        proc = self.proc
        if proc is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)


class VllmBackend(RemoteBackend):
    """A model served by a vLLM engine that textgen started and watches."""

    loader_name = "vllm"
    option_names = OPTIONS["vllm"]
    required_packages = ("httpx",)

    def __init__(self) -> None:
        super().__init__()
        self.engine: Engine | None = None
        self.restarts_left = 0
        self.state = "serving"  # "serving" | "restarting" | "dead" | "stopped"
        self.failure = ""
        self._options: dict[str, Any] = {}

    @staticmethod
    def engine_python(options: dict[str, Any]) -> Path:
        """The vLLM venv's Python (``--vllm-python``, default .venv-vllm/bin/python)."""
        return resolve(Path(options.get("vllm_python") or ".venv-vllm/bin/python"))

    @classmethod
    def check(cls, path: Path, options: dict[str, Any]) -> None:
        """An HF model folder, and vLLM's venv present."""
        super(RemoteBackend, cls).check(path, options)
        python = cls.engine_python(options)
        if not python.is_file():
            raise ModelLoadError(
                f"the vllm loader needs vLLM in its own venv ({python} is missing): run `make vllm`, or point "
                "--vllm-python at the Python of a venv where vLLM is installed"
            )
        if not (path / "config.json").is_file():
            raise ModelLoadError(
                f"the vllm loader serves a Hugging Face model folder (config.json and safetensors); {path.name} is "
                "not one. For a GGUF use the llama.cpp loader."
            )
        try:
            shlex.split(str(options.get("vllm_args") or ""))
        except ValueError as exc:
            raise ModelLoadError(f"--vllm-args cannot be read: {exc}") from exc

    @classmethod
    def load(cls, path: Path, options: dict[str, Any]) -> VllmBackend:
        """Start the engine on ``path``, wait until it serves, then talk to it as a remote engine."""
        progress = options.get("on_progress")
        self = cls()
        self._options = dict(options)
        self.restarts_left = int(options.get("vllm_restarts") or 0)
        self.engine = self._engine(path, options)
        self.engine.start()
        try:
            self.engine.wait_ready(float(options.get("vllm_start_timeout") or 900), progress)
            self.connect(self.engine.url, path.name, {**options, "remote_api_key": self.engine.api_key})
        except BaseException:
            self.engine.stop()
            raise
        self.path = path
        self.metadata.extra["engine_pid"] = self.engine.pid
        threading.Thread(target=self._watch, name="vllm-watch", daemon=True).start()
        return self

    @staticmethod
    def _engine(path: Path, options: dict[str, Any]) -> Engine:
        n_ctx = int(options.get("n_ctx") or 4096)
        parallel = int(options.get("parallel") or 4)
        kv_gb = options.get("vllm_kv_cache_gb")
        if kv_gb is None:
            kv_gb = max(1, math.ceil(kv_cache_bytes(path, n_ctx, parallel) / 2**30))
        port = _free_port()
        command = [
            str(VllmBackend.engine_python(options)), "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(path), "--served-model-name", path.name,
            "--host", "127.0.0.1", "--port", str(port),
            "--max-model-len", str(n_ctx),
        ]  # fmt: skip
        env = dict(os.environ)
        env.setdefault("HF_HUB_OFFLINE", "1")  # a folder in models/: nothing to fetch
        gpu = _has_cuda()
        if gpu:
            command += ["--kv-cache-memory-bytes", str(int(float(kv_gb) * 2**30))]
        else:
            env["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, math.ceil(float(kv_gb))))
            command += ["--dtype", "bfloat16"]
        extra = shlex.split(str(options.get("vllm_args") or ""))
        command += extra
        # a key of its own, in its environment (not on argv, which every user of the machine can read): another
        # local user cannot use the engine's /v1 routes past textgen's API key and admin rules
        given = extra[extra.index("--api-key") + 1] if "--api-key" in extra[:-1] else ""
        key = given or secrets.token_urlsafe(24)
        env["VLLM_API_KEY"] = key
        return Engine(command, env, port, path.name, key)

    def _watch(self) -> None:
        """Wait for the engine to end; unless we stopped it, report and start it again while restarts are left."""
        while True:
            engine = self.engine
            if engine is None or engine.proc is None:
                return
            engine.proc.wait()
            if engine.stopping:
                return
            engine.kill_group()  # the rest of a dead engine goes now, whether or not it is restarted
            self.failure = engine.exit_text()
            log.error("vllm: %s", self.failure)
            if self.restarts_left <= 0:
                self.state = "dead"
                log.error("vllm: no restarts left; load the model again (Model tab or /v1/internal/model/load)")
                return
            self.restarts_left -= 1
            self.state = "restarting"
            try:
                engine.start()
                engine.wait_ready(float(self._options.get("vllm_start_timeout") or 900))
            except (ModelLoadError, OSError) as exc:
                self.failure = str(exc)
                log.error("vllm: restarting failed: %s", exc)
                if engine.stopping or not isinstance(exc, ModelLoadError):  # not up in time, unloaded, no venv
                    self.state = "dead" if self.state == "restarting" else self.state
                    return
                continue  # it ended during its start: counted; the loop tries again or gives up
            if engine.stopping:
                return
            self.state, self.failure = "serving", ""
            self.metadata.extra["engine_pid"] = engine.pid
            log.info("vllm: the engine serves again (%d restart(s) left)", self.restarts_left)

    def _available(self) -> None:
        """Raise EngineUnavailable when the engine is not serving, saying why and what happens next."""
        engine = self.engine
        if self.state == "serving" and engine is not None and engine.alive():
            return
        if self.state == "stopped" or engine is None:
            raise EngineUnavailable("the vLLM engine was stopped (the model was unloaded)")
        why = self.failure or (engine.exit_text() if not engine.alive() else "")
        if self.state == "dead":
            raise EngineUnavailable(f"{why}. It was not started again: load the model again.")
        raise EngineUnavailable(f"{why}. It is being started again; try again in a minute or two.")

    def generate(
        self,
        prompt_ids: list[int],
        params: GenerationParams,
        cancel: threading.Event,
        extra: dict[str, Any] | None = None,
    ) -> Iterator[TokenEvent]:
        self._available()
        return super().generate(prompt_ids, params, cancel, extra)

    def _events(self, client: httpx.Client, body: dict[str, Any], cancel: threading.Event) -> Iterator[TokenEvent]:
        engine = self.engine
        generation = engine.generation if engine is not None else 0
        try:
            yield from super()._events(client, body, cancel)
        except (httpx.HTTPError, EngineUnavailable) as exc:
            broken = isinstance(exc, httpx.HTTPError) or isinstance(exc.__cause__, httpx.HTTPError)
            wait = CUT_WAIT_S if broken and not cancel.is_set() else 0.0  # an answer (5xx, an error chunk): look once
            if engine is not None and engine.ended_since(generation, wait):
                raise EngineUnavailable(f"the reply was cut off: {engine.exit_of(generation)}") from exc
            raise

    def encode(self, text: str, add_special: bool = True) -> list[int]:
        self._available()
        return super().encode(text, add_special)

    def decode(self, ids: list[int]) -> str:
        self._available()
        return super().decode(ids)

    def unload(self) -> None:
        """Close the connection and stop the engine."""
        self.state = "stopped"
        super().unload()
        if self.engine is not None:
            self.engine.stop()

    def stats(self) -> dict[str, Any]:
        return {
            **super().stats(),
            "engine": self.state,
            "engine_pid": self.engine.pid if self.engine else None,
            "engine_failure": self.failure if self.state != "serving" else "",
        }


def _has_cuda() -> bool:
    """A CUDA GPU here (nvidia-smi lists one); vLLM's CPU build is used otherwise."""
    try:
        return subprocess.run(["nvidia-smi", "-L"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False
