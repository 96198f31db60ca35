"""The long-job runner: results, failures kept inside the job, cancellation, one exclusive job at a time, shared
jobs, and the CLIs' foreground runner (Ctrl+C cancels the job and waits for it to stop)."""

from __future__ import annotations

import _thread
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from modules import jobs
from modules.errors import InvalidRequest
from tests.conftest import ROOT


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


def _interrupt_when(event: threading.Event) -> None:
    """Ctrl+C for the main thread (where pytest runs the test) once ``event`` is set."""

    def fire() -> None:
        assert event.wait(5)
        _thread.interrupt_main()  # the same KeyboardInterrupt a SIGINT raises in the main thread

    threading.Thread(target=fire, daemon=True).start()


def test_ctrl_c_in_the_foreground_cancels_the_job_and_waits_for_it_to_stop() -> None:
    started, cleaned_up = threading.Event(), threading.Event()
    steps: list[int] = []

    def work(report: jobs.Reporter, cancel: threading.Event) -> str:
        started.set()
        try:
            for step in range(10_000):
                jobs.check(cancel)
                steps.append(step)
                report(step, 10_000)
                time.sleep(0.005)
            return "finished"
        finally:
            time.sleep(0.2)  # a slow clean-up (a .partial file removed) that the CLI must wait for
            cleaned_up.set()

    _interrupt_when(started)
    with pytest.raises(KeyboardInterrupt):
        jobs.run_foreground("ctrl-c test", work)
    assert cleaned_up.is_set()  # the job had stopped cleanly before the CLI went on
    assert 0 < len(steps) < 10_000
    count = len(steps)
    time.sleep(0.05)
    assert len(steps) == count  # and nothing runs any more


def test_a_job_that_winds_down_on_ctrl_c_returns_what_it_saved() -> None:
    started = threading.Event()

    def train(report: jobs.Reporter, cancel: threading.Event) -> dict:
        started.set()
        step = 0
        while not cancel.is_set() and step < 10_000:  # like training: stop at the next step, keep a checkpoint
            step += 1
            time.sleep(0.005)
        return {"steps": step, "stopped": "stopped by the user" if cancel.is_set() else ""}

    _interrupt_when(started)
    summary = jobs.run_foreground("winding down", train, unit="step")
    assert summary["stopped"] == "stopped by the user" and 0 < summary["steps"] < 10_000


def test_a_foreground_job_error_reaches_the_cli_with_its_type() -> None:
    def bad(report: jobs.Reporter, cancel: threading.Event) -> None:
        raise InvalidRequest("dataset.jsonl line 3: no messages")

    with pytest.raises(InvalidRequest, match="line 3"):
        jobs.run_foreground("bad data", bad)
    assert jobs.run_foreground("quick", lambda report, cancel: 42) == 42


def test_sigint_to_a_cli_process_stops_its_job_cleanly(tmp_path: Path) -> None:
    script = tmp_path / "cli.py"
    script.write_text(
        textwrap.dedent(
            """
            import sys, threading, time
            from modules import jobs

            def work(report, cancel):
                print("started", flush=True)
                try:
                    while True:
                        jobs.check(cancel)
                        time.sleep(0.01)
                finally:
                    print("cleaned up", flush=True)

            try:
                jobs.run_foreground("sigint", work)
            except KeyboardInterrupt:
                print("interrupted", flush=True)
                sys.exit(130)
            """
        )
    )
    proc = subprocess.Popen([sys.executable, str(script)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})  # fmt: skip
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "started"
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    finally:  # the child loops until interrupted
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=30)
    assert proc.returncode == 130, err
    assert out.split() == ["cleaned", "up", "interrupted"] and "Traceback" not in err


def test_a_start_with_the_same_key_joins_the_running_job() -> None:
    release, calls = threading.Event(), []

    def fetch(report: jobs.Reporter, cancel: threading.Event) -> str:
        calls.append(1)
        assert release.wait(5)
        return "org_model"

    first = jobs.start("keyed-test", "org/model", fetch, key="org/model@main")
    second = jobs.start("keyed-test", "org/model", fetch, key="org/model@main")
    other = jobs.start("keyed-test", "org/other", lambda report, cancel: "org_other", key="org/other@main")
    assert second is first and other is not first
    release.set()
    assert first.wait(5) and first.result == "org_model" and len(calls) == 1
    after = jobs.start("keyed-test", "org/model", lambda report, cancel: "again", key="org/model@main")
    assert after is not first and after.wait(5) and after.result == "again"  # a finished job is not joined


def _until_cancelled(marker: str, report: jobs.Reporter, cancel: threading.Event) -> str:
    """A child-process job that works until it is cancelled, then saves (as training writes its checkpoint)."""
    report(message="working")
    while not cancel.is_set():
        time.sleep(0.05)
    Path(marker).write_text("saved", encoding="utf-8")
    raise jobs.Cancelled()


def test_server_shutdown_lets_a_child_job_save_and_a_terminal_ctrl_c_does_not_kill_it(
    hub: object, tmp_path: Path
) -> None:
    marker = tmp_path / "checkpoint"
    job = jobs.start_process("test", "until cancelled", _until_cancelled, str(marker))
    deadline = time.monotonic() + 60
    while job.message != "working" and time.monotonic() < deadline:
        time.sleep(0.1)
    assert job.message == "working" and job.pid is not None, job.to_dict()
    os.kill(job.pid, signal.SIGINT)  # Ctrl+C in the server's terminal reaches the whole process group
    time.sleep(1.0)
    assert job.state == "running", job.to_dict()
    jobs.stop_process_jobs(wait_s=60)  # what server.py does when it shuts down
    assert job.state == "cancelled" and marker.read_text(encoding="utf-8") == "saved"
    jobs.stop_process_jobs(wait_s=60)  # nothing left to stop: returns at once
    assert "stop_process_jobs()" in (ROOT / "server.py").read_text(encoding="utf-8")
