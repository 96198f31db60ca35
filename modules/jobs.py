"""Long jobs (download, training, export, quantize): one shape for all of them.

A job is a plain function over a dataclass of arguments that reports progress through a callback and checks a
cancel Event: ``fn(args, report, cancel)``. The CLIs run it with :func:`run_foreground` (a tqdm bar; Ctrl+C sets the
cancel Event); the UI and the API run it with :func:`start`, in a background thread, and read its state by id. A job
never runs in a request thread, and an exception inside one (out of memory included) ends that job only, never the
server. Two callers asking for the same work (the same ``key``) share one job.

The process form, :func:`start_process`, runs the same function in a child process (spawned: a fresh interpreter
with the server's settings): what can kill a process (a segfault in native code, the kernel's OOM killer, a
``kill -9``) then ends only that job, as ``failed`` with the signal named, and the server goes on serving. Progress,
cancel and the result cross a pipe; a child whose server is gone stops at its next check and exits. The child leads
a process group of its own, and whatever is left of that group when the child ends is killed with it, so a tool it
started (llama.cpp's converter) never outlives it.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os
import signal
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from modules.errors import TextgenError

log = logging.getLogger(__name__)

STATES = ("running", "done", "failed", "cancelled")  # Job.state
_KEEP = 50  # finished jobs remembered (newest)


class Cancelled(Exception):
    """Raised inside a job function when its cancel Event is set (see :func:`check`)."""


class Busy(Exception):
    """Another job of an exclusive kind is running."""

    def __init__(self, job: Job) -> None:
        super().__init__(f"a {job.kind} job is already running ({job.title}, {job.id}); wait for it or cancel it")
        self.job = job


class Reporter(Protocol):
    """The progress callback a job function receives."""

    def __call__(
        self, done: float | None = None, total: float | None = None, message: str = "", **metrics: Any
    ) -> None:
        """``done`` of ``total`` units (bytes, steps, tensors), a line for the user, and numbers (loss, tokens/s)."""


def check(cancel: threading.Event) -> None:
    """Raise :class:`Cancelled` if the job was asked to stop; call it between units of work."""
    if cancel.is_set():
        raise Cancelled()


@dataclass
class Job:
    """A long job's state, readable while it runs (UI polling, ``GET .../jobs/{id}``)."""

    kind: str
    title: str
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    owner: str | None = None  # who started it (a user name, or None)
    key: str | None = None  # what it does, for sharing: a start with the same key joins this job while it runs
    state: str = "running"
    done: float = 0.0
    total: float | None = None
    message: str = ""
    metrics: dict[str, Any] = field(default_factory=dict)
    history: list[dict[str, Any]] = field(default_factory=list)  # every report with metrics (loss curves)
    result: Any = None
    error: str | None = None
    exception: BaseException | None = field(default=None, repr=False)  # what ``error`` says, for a waiting caller
    started: float = field(default_factory=time.time)
    finished: float | None = None
    cancel: threading.Event = field(default_factory=threading.Event, repr=False)
    thread: threading.Thread | None = field(default=None, repr=False)
    ended: threading.Event = field(default_factory=threading.Event, repr=False)  # set once the job has finished
    pid: int | None = None  # the child process of a job started with start_process, while it runs
    _pace: tuple[float, float] | None = field(default=None, repr=False)  # (time, done) when units began to count

    def report(self, done: float | None = None, total: float | None = None, message: str = "", **metrics: Any) -> None:
        """The :class:`Reporter` of this job."""
        if done is not None:
            self.done = float(done)
        if total is not None:
            self.total = float(total)
        if self._pace is None and done is not None and self.total:
            self._pace = (time.time(), self.done)  # the ETA counts from here: not loading, not resumed units
        if message:
            self.message = message
        if metrics:
            self.metrics.update(metrics)
            self.history.append({"time": time.time(), "done": self.done, **metrics})

    @property
    def fraction(self) -> float | None:
        """Progress from 0 to 1, when the total is known."""
        return min(1.0, self.done / self.total) if self.total else None

    @property
    def eta_s(self) -> float | None:
        """Seconds left at the pace so far, when it can be told."""
        if not self.total or self.state != "running" or self._pace is None:
            return None
        since, first = self._pace
        counted = self.done - first
        if counted <= 0:
            return None
        return (time.time() - since) * max(0.0, self.total - self.done) / counted

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the job ends; False on timeout. (An Event, not Thread.join: a caller that joins a job may
        get it before its thread has started.)"""
        self.ended.wait(timeout)
        return self.state != "running"

    def to_dict(self) -> dict[str, Any]:
        """What the API and the UI show."""
        return {
            "id": self.id,
            "kind": self.kind,
            "title": self.title,
            "state": self.state,
            "done": self.done,
            "total": self.total,
            "fraction": self.fraction,
            "eta_s": self.eta_s,
            "message": self.message,
            "metrics": dict(self.metrics),
            "error": self.error,
            "result": self.result
            if isinstance(self.result, str | int | float | dict | list | type(None))
            else str(self.result),
            "started": self.started,
            "finished": self.finished,
            "pid": self.pid,
        }


_lock = threading.Lock()
_jobs: dict[str, Job] = {}


def start(
    kind: str,
    title: str,
    fn: Callable[[Reporter, threading.Event], Any],
    *,
    exclusive: bool = False,
    owner: str | None = None,
    key: str | None = None,
) -> Job:
    """Run ``fn(report, cancel)`` in a background thread as a job; ``exclusive``: one job of this kind at a time
    (a second raises :class:`Busy`); ``key``: while a job of this kind with the same key runs, that job is returned
    instead of starting another (the caller joins it: one download of a repo however many ask for it)."""
    with _lock:
        if key is not None:
            same = next((j for j in _jobs.values() if j.kind == kind and j.key == key and j.state == "running"), None)
            if same is not None:
                return same
        if exclusive:
            running = next((j for j in _jobs.values() if j.kind == kind and j.state == "running"), None)
            if running is not None:
                raise Busy(running)
        job = Job(kind=kind, title=title, owner=owner, key=key)
        _jobs[job.id] = job
        _forget_old()

    def run() -> None:
        try:
            job.result = fn(job.report, job.cancel)
            job.state = "cancelled" if job.cancel.is_set() else "done"
        except Cancelled:
            job.state = "cancelled"
        except BaseException as exc:  # a job's failure, whatever it is, must not reach the server
            job.state, job.error = "failed", f"{getattr(exc, 'type_name', type(exc).__name__)}: {exc}"
            log.exception("%s job %s (%s) failed", kind, job.id, title)
            job.exception = _without_frames(exc)
        finally:
            job.finished = time.time()
            if job.state == "cancelled" and not job.message.startswith("Cancelled"):
                job.message = "Cancelled" + (f" at {job.message}" if job.message else "")
            job.ended.set()

    job.thread = threading.Thread(target=run, name=f"job-{kind}-{job.id}", daemon=True)
    job.thread.start()
    return job


class ChildFailed(TextgenError):
    """A job's child process raised; ``type_name`` is the exception's class there (the job's error shows it)."""

    def __init__(self, type_name: str, message: str) -> None:
        super().__init__(message)
        self.type_name = type_name


class ProcessDied(TextgenError):
    """A job's child process ended without an answer: killed by a signal (the OOM killer, ``kill -9``), crashed
    in native code, or exited."""

    type_name = "ProcessDied"


def describe_exit(kind: str, code: int | None) -> str:
    """Why a child process ended, in words: the signal's name and what usually sends it."""
    if code is not None and code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        why = {
            "SIGKILL": "killed by SIGKILL (the kernel's out-of-memory killer sends it, and kill -9)",
            "SIGSEGV": "crashed with SIGSEGV (a segmentation fault in native code)",
            "SIGABRT": "aborted with SIGABRT (a native library gave up)",
            "SIGBUS": "crashed with SIGBUS (a memory-mapped file went away, or a bad access)",
        }.get(name, f"ended by {name}")
        return f"the {kind} process was {why}; the server is unaffected"
    return f"the {kind} process exited with code {code} before it answered"


def start_process(
    kind: str,
    title: str,
    target: Callable[[Any, Reporter, threading.Event], Any],
    args: Any,
    *,
    exclusive: bool = False,
    owner: str | None = None,
    key: str | None = None,
    grace_s: float = 120.0,
) -> Job:
    """:func:`start` for ``target(args, report, cancel)`` in a child process. ``target`` must be a module-level
    function and ``args`` picklable. A cancel is sent to the child (it stops at its next check, as in a thread);
    one that has not ended ``grace_s`` seconds later is killed."""

    holder: list[Job] = []
    registered = threading.Event()

    def run(report: Reporter, cancel: threading.Event) -> Any:
        registered.wait()  # the thread may start before start() has returned the job
        return _run_child(holder[0], target, args, report, cancel, grace_s)

    job = start(kind, title, run, exclusive=exclusive, owner=owner, key=key)
    holder.append(job)
    registered.set()
    return job


SHUTDOWN_WAIT_S = 90.0


def stop_process_jobs(wait_s: float = SHUTDOWN_WAIT_S) -> None:
    """At server shutdown: ask every job running in a child process to stop as its Cancel would (training then
    saves a checkpoint that Resume goes on from) and wait up to ``wait_s`` for them; one still running then is
    killed with the server. A second Ctrl+C stops the wait."""
    with _lock:
        running = [job for job in _jobs.values() if job.state == "running" and job.pid is not None]
    if not running:
        return
    log.info(
        "Stopping %s (up to %.0f s; Ctrl+C again to stop at once)",
        ", ".join(f"the {job.kind} job {job.title!r}" for job in running),
        wait_s,
    )
    for job in running:
        job.cancel.set()
    deadline = time.monotonic() + wait_s
    try:
        for job in running:
            if not job.wait(max(0.0, deadline - time.monotonic())):
                log.warning("the %s job %s did not stop in time; it ends with the server", job.kind, job.id)
    except KeyboardInterrupt:
        log.warning("not waiting for the jobs any longer; they end with the server")


def _hub_state() -> dict[str, Any]:
    """What a child needs of the server's state: its settings (paths, limits) and process-wide switches."""
    from modules import shared
    from modules.settings import LoadedSettings

    loaded = LoadedSettings(settings=shared.settings, explicit=shared.explicit,
                            extension_params=shared.extension_params, extra=shared.ui_defaults)  # fmt: skip
    return {"settings": loaded}


def _run_child(
    job: Job, target: Callable[..., Any], args: Any, report: Reporter, cancel: threading.Event, grace_s: float
) -> Any:
    import multiprocessing

    context = multiprocessing.get_context("spawn")  # a fresh interpreter: no copy of the server's threads or locks
    ours, theirs = context.Pipe()
    where = f"{target.__module__}:{target.__qualname__}"
    process = context.Process(target=_child_main, args=(theirs, where, args, _hub_state()), daemon=True,
                              name=f"textgen-{job.kind}-{job.id}")  # fmt: skip
    process.start()
    theirs.close()
    job.pid = process.pid
    log.info("%s job %s (%s) runs in process %d", job.kind, job.id, job.title, process.pid)
    outcome: tuple[Any, ...] | None = None
    asked: float | None = None
    try:
        while True:
            if cancel.is_set() and asked is None:
                asked = time.monotonic()
                with contextlib.suppress(OSError):
                    ours.send(("cancel",))
            if asked is not None and time.monotonic() - asked > grace_s and process.is_alive():
                log.warning("%s job %s did not stop within %.0f s of its cancel: killing it", job.kind, job.id, grace_s)
                process.kill()
            try:
                if not ours.poll(0.2):
                    if not process.is_alive() and not ours.poll(0):
                        break
                    continue
                message = ours.recv()
            except Exception:  # the pipe closed (or broke mid-message): the child is gone
                break
            if message[0] == "report":
                _, done, total, text, metrics = message
                report(done=done, total=total, message=text, **metrics)
            else:
                outcome = message
    finally:
        process.join(10)
        if process.is_alive():
            process.kill()
            process.join()
        _end_group(process.pid)
        ours.close()
        job.pid = None
    if outcome is None:
        raise ProcessDied(describe_exit(job.kind, process.exitcode))
    if outcome[0] == "result":
        return outcome[1]
    if outcome[0] == "cancelled":
        raise Cancelled()
    raise ChildFailed(outcome[1], outcome[2])


def _end_group(pid: int | None) -> None:
    """SIGKILL what is left of a finished child's process group: the tools it started (llama.cpp's converter, data
    loader workers) must not outlive a killed child and go on writing where the next run writes. The group keeps
    its number while any member lives, so no other process can have it."""
    if pid is not None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)


def _child_main(conn: Any, where: str, args: Any, state: dict[str, Any]) -> None:
    """The child's side: the server's settings, a thread that turns the parent's cancel (or its going away) into
    the cancel Event, progress sent up the pipe and logged on the console, and one answer at the end."""
    import importlib

    os.setpgid(0, 0)  # a group of its own: what it starts ends with it (_end_group), whatever ends it
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from modules import shared

    shared.init(state["settings"])
    module, _, name = where.partition(":")
    target = getattr(importlib.import_module(module), name)
    # in its own group a terminal's Ctrl+C does not reach it; a kill -INT to it is ignored too: the server decides
    # (stop_process_jobs cancels us)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    cancel = threading.Event()
    sending = threading.Lock()

    def listen() -> None:
        try:
            while conn.recv()[0] != "cancel":
                pass
        except (EOFError, OSError):  # the server is gone: stop at the next check, and do not outlive it for long
            cancel.set()
            time.sleep(60)
            os._exit(3)
        cancel.set()

    threading.Thread(target=listen, name="cancel-listener", daemon=True).start()
    last = [""]

    def report(done: float | None = None, total: float | None = None, message: str = "", **metrics: Any) -> None:
        if message and (message != last[0] or metrics):
            last[0] = message
            extra = " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in metrics.items())
            log.info("%s%s", message, f" ({extra})" if extra else "")
        with sending, contextlib.suppress(OSError):
            conn.send(("report", done, total, message, metrics))

    try:
        answer: tuple[Any, ...] = ("result", target(args, report, cancel))
    except Cancelled:
        answer = ("cancelled",)
    except BaseException as exc:  # every failure goes to the parent as the job's error
        log.exception("the job failed")
        answer = ("error", type(exc).__name__, str(exc))
    with sending:
        conn.send(answer)
    conn.close()


def _without_frames(exc: BaseException) -> BaseException:
    """``exc`` (and what it chains) without tracebacks: a kept failure must not keep a failed run's tensors alive."""
    seen: set[int] = set()
    link: BaseException | None = exc
    while link is not None and id(link) not in seen:
        seen.add(id(link))
        link.__traceback__ = None
        link = link.__cause__ or link.__context__
    return exc


def _forget_old() -> None:
    finished = [j for j in _jobs.values() if j.state != "running"]
    for old in sorted(finished, key=lambda j: j.finished or 0)[: max(0, len(finished) - _KEEP)]:
        _jobs.pop(old.id, None)


def get(job_id: str) -> Job | None:
    """The job with this id (running or recently finished)."""
    with _lock:
        return _jobs.get(job_id)


def all_jobs(kind: str | None = None) -> list[Job]:
    """Jobs, newest first (of one kind, if given)."""
    with _lock:
        jobs = [j for j in _jobs.values() if kind is None or j.kind == kind]
    return sorted(jobs, key=lambda j: j.started, reverse=True)


def running(kind: str) -> Job | None:
    """The running job of this kind, if any."""
    return next((j for j in all_jobs(kind) if j.state == "running"), None)


def cancel(job_id: str) -> bool:
    """Ask a job to stop (it stops at its next check); False if there is no such running job."""
    job = get(job_id)
    if job is None or job.state != "running":
        return False
    job.cancel.set()
    return True


def _quiet(*args: Any, **kwargs: Any) -> None:
    """A reporter that shows nothing."""


def _nothing() -> None:
    """Nothing to close."""


def tqdm_reporter(desc: str, unit: str = "it", unit_scale: bool = False) -> tuple[Reporter, Callable[[], None]]:
    """A reporter that draws a tqdm bar on the console (for the CLIs), and the function that closes it."""
    from tqdm import tqdm

    bar = tqdm(desc=desc, unit=unit, unit_scale=unit_scale, dynamic_ncols=True)

    def report(done: float | None = None, total: float | None = None, message: str = "", **metrics: Any) -> None:
        if total is not None and bar.total != total:
            bar.total = total
        if done is not None:
            bar.n = done
        postfix = {k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in metrics.items()}
        if message:
            postfix["status"] = message
        if postfix:
            bar.set_postfix(postfix, refresh=False)
        bar.refresh()

    return report, bar.close


def run_foreground(
    title: str,
    fn: Callable[[Reporter, threading.Event], Any],
    *,
    unit: str = "it",
    unit_scale: bool | None = None,
    poll_s: float = 0.1,
    progress: bool = True,
) -> Any:
    """Run ``fn(report, cancel)`` for a CLI or a script: a tqdm bar on the console (none with ``progress=False``),
    the work in a worker thread, and Ctrl+C (KeyboardInterrupt in the main thread) setting ``cancel`` so the job
    stops at its next check, cleanly. The bar is closed however the job ends.

    Returns what ``fn`` returns (also after a Ctrl+C, when ``fn`` chose to finish, as training does with a
    checkpoint); re-raises what ``fn`` raised; a :class:`Cancelled` after Ctrl+C is raised as KeyboardInterrupt,
    so the caller prints its "interrupted" line. A second Ctrl+C stops waiting for the job to wind down.
    The worker runs in a copy of the caller's context (its context variables, such as
    :func:`modules.training.datasets.allow_paths`).
    """
    context = contextvars.copy_context()
    if progress:
        report, close = tqdm_reporter(title, unit=unit, unit_scale=unit == "B" if unit_scale is None else unit_scale)
    else:
        report, close = _quiet, _nothing
    cancel = threading.Event()
    outcome: dict[str, Any] = {}

    ended = threading.Event()  # waited on, not Thread.join: Ctrl+C inside join can mark a running thread stopped

    def work() -> None:
        try:
            outcome["result"] = fn(report, cancel)
        except BaseException as exc:  # handed to the main thread, which raises it
            outcome["error"] = exc
        finally:
            ended.set()

    worker = threading.Thread(target=context.run, args=(work,), name=f"foreground-{title}", daemon=True)
    try:
        try:
            worker.start()
            while not ended.wait(poll_s):
                pass
        except KeyboardInterrupt:
            cancel.set()
            log.info("interrupted: stopping %s at its next check (Ctrl+C again to quit at once)", title)
            while not ended.wait(poll_s):  # a second Ctrl+C raises out of here
                pass
    finally:
        close()
    error = outcome.get("error")
    if isinstance(error, Cancelled) and cancel.is_set():
        raise KeyboardInterrupt from error
    if error is not None:
        raise error
    return outcome.get("result")
