"""Jupyter kernels for the Code notebook: one ipykernel per browser session and user, started on first use.

Code execution is off unless the server runs with ``--enable-code-execution``. A kernel runs whatever its cells
say with the server's own rights (files, network, processes): there is no sandbox. Kernels run the server's
Python (the virtual environment's), talk over local IPC sockets in a private folder, and stop when their browser
session ends, after an idle time, or with the server: at exit, and else (SIGTERM, a crash) by themselves within
seconds, as ipykernel does when its parent process is gone.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import queue
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jupyter_client import KernelManager
from jupyter_client.kernelspec import KernelSpec, KernelSpecManager

from modules import shared
from modules.errors import TextgenError
from modules.notebook.outputs import Execution, OutputCollector

log = logging.getLogger(__name__)

ENABLE_HINT = (
    "Code execution is off. Start the server with --enable-code-execution (or `enable_code_execution: true` in "
    "user_data/settings.yaml) to run code cells. The kernel runs code with the server's rights: no sandbox."
)
KERNEL_ARGV = [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}", "--HistoryManager.enabled=False"]
POLL = 0.1  # seconds between two checks of a running cell
GRACE = 5.0  # seconds an interrupted cell has to stop before its kernel is restarted
STREAM_EVERY = 0.25  # seconds between two snapshots of a running cell's outputs


class CodeExecutionDisabled(TextgenError):
    """The server runs without --enable-code-execution."""

    def __init__(self) -> None:
        super().__init__(ENABLE_HINT)


class KernelFailed(TextgenError):
    """A kernel could not start or stopped answering."""


@dataclass
class KernelLimits:
    """Limits for one kernel (settings.yaml keys ``code_cell_timeout``, ``code_output_limit``, ``code_kernel_idle_minutes``)."""

    timeout: float = 60.0  # seconds a cell may run before it is interrupted
    max_output_chars: int = 1_000_000  # characters of output (text and encoded images) kept per cell
    idle_shutdown: float = 1800.0  # seconds without a run before the kernel is shut down

    @classmethod
    def from_settings(cls) -> KernelLimits:
        """The limits from user_data/settings.yaml, else the defaults."""
        values = shared.ui_defaults
        try:
            return cls(
                timeout=float(values.get("code_cell_timeout", cls.timeout)),
                max_output_chars=int(values.get("code_output_limit", cls.max_output_chars)),
                idle_shutdown=float(values.get("code_kernel_idle_minutes", cls.idle_shutdown / 60)) * 60,
            )
        except (TypeError, ValueError):
            log.warning("code_cell_timeout, code_output_limit and code_kernel_idle_minutes must be numbers")
            return cls()


def enabled() -> bool:
    """Whether this server may run code."""
    return bool(shared.settings.enable_code_execution)


def require_enabled() -> None:
    """Raise CodeExecutionDisabled unless the server runs with --enable-code-execution."""
    if not enabled():
        raise CodeExecutionDisabled()


def exposure_warning() -> str | None:
    """A warning when anyone who reaches the server could run code on it (listening widely without logins)."""
    settings = shared.settings
    if not enabled() or settings.host in ("127.0.0.1", "localhost", "::1") or settings.auth_pairs():
        return None
    return (
        f"Code execution is on and the server listens on {settings.host} without --gradio-auth: "
        "anyone who can reach it can run programs on this machine."
    )


# What a kernel inherits from the server's environment: what a Python process needs to run and find its files, and
# nothing that may be a secret (HF_TOKEN, TEXTGEN_*, cloud credentials, API keys): code cells are admin work, but
# their output is shown and saved in notebooks.
KERNEL_ENV = (
    "PATH", "HOME", "USER", "LOGNAME", "LANG", "LANGUAGE", "TERM", "TZ", "TMPDIR", "TEMP", "TMP", "SHELL",
    "VIRTUAL_ENV", "PYTHONPATH", "PYTHONHASHSEED", "PYTHONUNBUFFERED", "SYSTEMROOT", "COMSPEC", "PATHEXT", "WINDIR",
    "LD_LIBRARY_PATH", "DYLD_LIBRARY_PATH", "CUDA_VISIBLE_DEVICES", "CUDA_HOME", "OMP_NUM_THREADS",
    "OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE", "MKL_NUM_THREADS", "HF_HUB_OFFLINE", "HF_HOME", "XDG_CACHE_HOME",
)  # fmt: skip


def kernel_env() -> dict[str, str]:
    """The kernel's environment: the harmless part of the server's (:data:`KERNEL_ENV` and ``LC_*``), no secrets."""
    env = {k: v for k, v in os.environ.items() if k in KERNEL_ENV or k.startswith("LC_")}
    env["MPLBACKEND"] = "module://matplotlib_inline.backend_inline"
    env["PYDEVD_DISABLE_FILE_VALIDATION"] = "1"
    return env


class VenvKernelSpecManager(KernelSpecManager):
    """Knows one kernel: this Python's ipykernel (never a kernel spec that happens to be on the machine)."""

    def get_kernel_spec(self, kernel_name: str) -> KernelSpec:
        return KernelSpec(argv=list(KERNEL_ARGV), display_name="Python (textgen)", language="python")


class KernelSession:
    """One ipykernel, started on first use; runs one cell at a time."""

    def __init__(self, cwd: Path, limits: KernelLimits | None = None) -> None:
        self.cwd = cwd
        self.limits = limits or KernelLimits()
        self.last_used = time.monotonic()
        self.busy = False
        self._lock = threading.Lock()  # held while starting, running a cell, restarting
        self._abandon = threading.Event()  # a restart or shutdown asks the running cell to stop waiting
        self._manager: Any = None
        self._client: Any = None
        self._sockets: str | None = None
        self._lost = False  # the running cell left the kernel unusable

    @property
    def started(self) -> bool:
        """True while a kernel process is running."""
        return self._manager is not None and bool(self._manager.is_alive())

    def status(self) -> str:
        """'not started', 'idle' or 'busy'."""
        if not self.started:
            return "not started"
        return "busy" if self.busy else "idle"

    def _start(self) -> None:
        require_enabled()
        self.cwd.mkdir(parents=True, exist_ok=True)
        self._sockets = tempfile.mkdtemp(prefix="textgen-kernel-")  # 0700: only this user reaches the sockets
        manager = KernelManager(
            kernel_spec_manager=VenvKernelSpecManager(), kernel_name="textgen", transport="ipc", ip=self._sockets + "/k"
        )
        started = time.monotonic()
        try:
            manager.start_kernel(cwd=str(self.cwd), env=kernel_env())
            client = manager.client()
            client.start_channels()
            client.wait_for_ready(timeout=60)
        except Exception as exc:
            with contextlib.suppress(Exception):
                manager.shutdown_kernel(now=True)
            raise KernelFailed(f"the Python kernel did not start: {exc}") from exc
        self._manager, self._client = manager, client
        log.info("Kernel started in %.1f s (pid %s)", time.monotonic() - started, self.pid)

    @property
    def pid(self) -> int | None:
        """The kernel process id, if one runs."""
        provisioner = getattr(self._manager, "provisioner", None)
        process = getattr(provisioner, "process", None)
        return getattr(process, "pid", None)

    def ensure_started(self) -> None:
        """Start the kernel unless it runs."""
        with self._lock:
            self._ensure_started()

    def _ensure_started(self) -> None:
        if not self.started:
            self._stop()
            self._start()

    def execute_iter(self, code: str, timeout: float | None = None) -> Iterator[Execution]:
        """Run ``code``; yields snapshots of its outputs while it runs, the finished run last.

        The cell runs in a thread of its own, so that it ends (and frees the kernel) even when nobody reads the
        snapshots any more. A cell that runs past ``timeout`` seconds (0: no limit) is interrupted; one that
        does not stop within a few seconds of the interrupt has its kernel stopped, and the next cell starts a
        new one (the outputs say that the variables are lost). Raises CodeExecutionDisabled or KernelFailed.
        """
        require_enabled()
        limit = self.limits.timeout if timeout is None else timeout
        collector = OutputCollector(self.limits.max_output_chars)
        done = threading.Event()
        failure: list[BaseException] = []

        def work() -> None:
            try:
                self._execute(code, limit, collector)
            except BaseException as exc:  # handed to the reader below
                failure.append(exc)
            finally:
                done.set()

        threading.Thread(target=work, name="kernel-cell", daemon=True).start()
        finished = False
        try:
            while not done.wait(STREAM_EVERY):
                yield collector.snapshot()
            if failure:
                raise failure[0]
            finished = True
            yield collector.snapshot()
        finally:
            if not finished and not done.is_set():  # the reader went away: stop the cell too
                self.interrupt()

    def _execute(self, code: str, limit: float, collector: OutputCollector) -> None:
        with self._lock:
            self._ensure_started()
            self.busy, self.last_used = True, time.monotonic()
            self._abandon.clear()
            try:
                self._run(code, limit, collector, time.monotonic())
            finally:
                self.busy, self.last_used = False, time.monotonic()
                if self._lost:  # stuck or dead: the next cell starts a fresh kernel
                    self._lost = False
                    self._stop()

    def _run(self, code: str, limit: float, collector: OutputCollector, started: float) -> None:
        client = self._client
        msg_id = client.execute(code, store_history=True, allow_stdin=False, stop_on_error=False)
        interrupted_at: float | None = None
        while True:
            now = time.monotonic()
            collector.elapsed(now - started)
            if self._abandon.is_set():
                collector.note("the kernel was restarted while this cell ran")
                collector.finish("restarted")
                break
            if interrupted_at is None and limit > 0 and now - started > limit:
                collector.note(f"the cell ran past its {limit:g} s limit and was interrupted")
                collector.finish("timeout", final=False)
                interrupted_at = now
                self.interrupt()
            elif interrupted_at is not None and now - interrupted_at > GRACE:
                collector.note("the cell did not stop when interrupted: the kernel was stopped (variables lost)")
                collector.finish("restarted")
                self._lost = True
                break
            if not self._manager.is_alive():
                collector.note("the kernel died (variables lost); the next cell starts a new one")
                collector.finish("restarted")
                self._lost = True
                break
            try:
                msg = client.get_iopub_msg(timeout=POLL)
            except queue.Empty:
                continue
            if msg.get("parent_header", {}).get("msg_id") != msg_id:
                continue
            if msg["msg_type"] == "status" and msg["content"].get("execution_state") == "idle":
                break
            collector.feed(msg)
        self._drain_replies()
        collector.elapsed(time.monotonic() - started)
        collector.finish(None)

    def _drain_replies(self) -> None:
        """Read the shell channel's execute replies (the outputs came on iopub) so that they do not pile up."""
        with contextlib.suppress(queue.Empty):
            while True:
                self._client.get_shell_msg(timeout=0)

    def execute(self, code: str, timeout: float | None = None) -> Execution:
        """Run ``code`` and return the finished run."""
        result = Execution()
        for snapshot in self.execute_iter(code, timeout):
            result = snapshot
        return result

    def interrupt(self) -> bool:
        """Interrupt the running cell (KeyboardInterrupt in the kernel); False when no kernel runs."""
        if not self.started:
            return False
        try:
            self._manager.interrupt_kernel()
        except RuntimeError:
            return False
        return True

    def restart(self) -> None:
        """A fresh kernel: every variable and import is gone."""
        self._abandon.set()
        self.interrupt()
        with self._lock:
            self._stop()
            self._start()
            self._abandon.clear()

    def shutdown(self) -> None:
        """Stop the kernel (a later cell starts a new one)."""
        self._abandon.set()
        with self._lock:
            self._stop()

    def _stop(self) -> None:
        manager, client, sockets = self._manager, self._client, self._sockets
        self._manager = self._client = self._sockets = None
        if client is not None:
            with contextlib.suppress(Exception):
                client.stop_channels()
        if manager is not None:
            try:
                manager.shutdown_kernel(now=True)
            except Exception as exc:  # a kernel that is already gone
                log.debug("kernel shutdown: %s", exc)
            log.info("Kernel stopped")
        if sockets:
            shutil.rmtree(sockets, ignore_errors=True)


class KernelRegistry:
    """The kernels of this server, one per (user, browser session); idle ones are shut down by a reaper thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sessions: dict[tuple[str, str], KernelSession] = {}
        self._reaper: threading.Thread | None = None
        self._wake = threading.Event()

    def get(self, user: str, session: str, cwd: Path) -> KernelSession:
        """The kernel of this user's browser session (made, not started, on first use)."""
        require_enabled()
        with self._lock:
            found = self._sessions.get((user, session))
            if found is None:
                found = self._sessions[(user, session)] = KernelSession(cwd, KernelLimits.from_settings())
            self._start_reaper()
            return found

    def find(self, user: str, session: str) -> KernelSession | None:
        """The kernel of this session if one was made."""
        with self._lock:
            return self._sessions.get((user, session))

    def sessions(self) -> list[KernelSession]:
        """Every kernel session known (started or not)."""
        with self._lock:
            return list(self._sessions.values())

    def close_session(self, user: str, session: str) -> int:
        """Shut down the kernel of this user's browser session that ended (another user's kernel of the same
        session hash is not theirs to end); returns how many."""
        with self._lock:
            found = self._sessions.pop((user, session), None)
        if found is not None:
            found.shutdown()
        return int(found is not None)

    def shutdown_idle(self) -> int:
        """Shut down kernels idle for longer than their limit; returns how many."""
        now = time.monotonic()
        stopped = 0
        for kernel in self.sessions():
            if kernel.started and not kernel.busy and now - kernel.last_used > kernel.limits.idle_shutdown:
                log.info("Kernel idle for %.0f s: shutting it down", now - kernel.last_used)
                kernel.shutdown()
                stopped += 1
        return stopped

    def shutdown_all(self) -> None:
        """Stop every kernel (server exit, tests)."""
        with self._lock:
            found = list(self._sessions.values())
            self._sessions.clear()
        for kernel in found:
            kernel.shutdown()

    def _start_reaper(self) -> None:
        if self._reaper is None or not self._reaper.is_alive():
            self._reaper = threading.Thread(target=self._reap, name="kernel-reaper", daemon=True)
            self._reaper.start()

    def _reap(self) -> None:
        while not self._wake.wait(30):
            try:
                self.shutdown_idle()
            except Exception:  # the reaper must keep running
                log.exception("idle kernel shutdown failed")


registry = KernelRegistry()
atexit.register(registry.shutdown_all)
