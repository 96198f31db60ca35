"""Long jobs (download, training, export, quantize): one shape for all of them.

A job is a plain function over a dataclass of arguments that reports progress through a callback and checks a
cancel Event: ``fn(args, report, cancel)``. The CLIs run it with :func:`run_foreground` (a tqdm bar; Ctrl+C sets the
cancel Event); the UI and the API run it with :func:`start`, in a background thread, and read its state by id. A job
never runs in a request thread, and an exception inside one (out of memory included) ends that job only, never the
server. Two callers asking for the same work (the same ``key``) share one job.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

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

    def report(self, done: float | None = None, total: float | None = None, message: str = "", **metrics: Any) -> None:
        """The :class:`Reporter` of this job."""
        if done is not None:
            self.done = float(done)
        if total is not None:
            self.total = float(total)
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
        fraction = self.fraction
        if not fraction or self.state != "running":
            return None
        elapsed = time.time() - self.started
        return elapsed * (1 - fraction) / fraction

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
            job.state, job.error = "failed", f"{type(exc).__name__}: {exc}"
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
) -> Any:
    """Run ``fn(report, cancel)`` for a CLI: a tqdm bar on the console, the work in a worker thread, and Ctrl+C
    (KeyboardInterrupt in the main thread) setting ``cancel`` so the job stops at its next check, cleanly.

    Returns what ``fn`` returns (also after a Ctrl+C, when ``fn`` chose to finish, as training does with a
    checkpoint); re-raises what ``fn`` raised; a :class:`Cancelled` after Ctrl+C is raised as KeyboardInterrupt,
    so the caller prints its "interrupted" line. A second Ctrl+C stops waiting for the job to wind down.
    """
    report, close = tqdm_reporter(title, unit=unit, unit_scale=unit == "B" if unit_scale is None else unit_scale)
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

    worker = threading.Thread(target=work, name=f"foreground-{title}", daemon=True)
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
