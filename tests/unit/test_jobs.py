"""The long-job runner: results, failures kept inside the job, cancellation, one exclusive job at a time."""

from __future__ import annotations

import threading
import time

import pytest

from modules import jobs


def test_a_job_reports_progress_and_returns_its_result() -> None:
    def work(report: jobs.Reporter, cancel: threading.Event) -> str:
        for step in range(1, 4):
            report(step, 3, f"step {step}", loss=1.0 / step)
        return "ok"

    job = jobs.start("test", "three steps", work)
    assert job.wait(5) and job.state == "done" and job.result == "ok"
    assert job.fraction == 1.0 and job.message == "step 3" and [h["loss"] for h in job.history] == [1.0, 0.5, 1 / 3]
    assert jobs.get(job.id) is job and job.to_dict()["state"] == "done"


def test_a_failing_job_fails_alone() -> None:
    def boom(report: jobs.Reporter, cancel: threading.Event) -> None:
        raise MemoryError("out of memory")

    job = jobs.start("test", "boom", boom)
    assert job.wait(5) and job.state == "failed" and job.error == "MemoryError: out of memory"


def test_cancel_stops_a_job_at_its_next_check_and_exclusive_kinds_say_busy() -> None:
    started = threading.Event()

    def slow(report: jobs.Reporter, cancel: threading.Event) -> None:
        started.set()
        while True:
            jobs.check(cancel)
            time.sleep(0.01)

    job = jobs.start("exclusive-test", "slow", slow, exclusive=True)
    assert started.wait(5)
    with pytest.raises(jobs.Busy, match="already running"):
        jobs.start("exclusive-test", "second", slow, exclusive=True)
    assert jobs.running("exclusive-test") is job
    assert jobs.cancel(job.id) and job.wait(5) and job.state == "cancelled"
    assert not jobs.cancel(job.id)  # no longer running
    again = jobs.start("exclusive-test", "after", lambda report, cancel: 1, exclusive=True)
    assert again.wait(5) and again.result == 1
