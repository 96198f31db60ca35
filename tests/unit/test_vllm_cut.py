"""A stream cut by a dying vLLM engine says why, even when the connection breaks before the process is reaped.

The engine here is a real child process started by :class:`modules.loaders.vllm.Engine` and watched by the backend's
own watcher thread (as in serving); only the HTTP stream is replaced by one that breaks at once, since what is under
test is the order of the two events: the broken connection first, the process's end later."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from modules.errors import EngineUnavailable
from modules.loaders import vllm
from modules.loaders.remote import RemoteBackend


def _backend(monkeypatch: pytest.MonkeyPatch) -> tuple[vllm.VllmBackend, threading.Thread]:
    def broken(self: Any, client: Any, body: Any, cancel: Any) -> Iterator[Any]:
        cause = httpx.RemoteProtocolError("peer closed connection without sending complete message body")
        raise EngineUnavailable(f"the reply was cut off: the engine's connection broke ({cause})") from cause
        yield  # a generator, as the real one

    monkeypatch.setattr(RemoteBackend, "_events", broken)
    command = [sys.executable, "-c", "import time; time.sleep(60)"]
    engine = vllm.Engine(command, dict(os.environ), port=1, name="stand-in")
    engine.start()
    backend = vllm.VllmBackend()
    backend.engine = engine
    backend.restarts_left = 0  # the watcher records the death and starts nothing
    watcher = threading.Thread(target=backend._watch, daemon=True)
    watcher.start()
    return backend, watcher


def test_the_reason_is_given_when_the_process_ends_after_the_connection_broke(monkeypatch: pytest.MonkeyPatch) -> None:
    backend, watcher = _backend(monkeypatch)
    engine = backend.engine
    assert engine is not None and engine.proc is not None
    killer = threading.Timer(1.0, os.killpg, args=(engine.proc.pid, signal.SIGKILL))
    killer.start()
    try:
        with pytest.raises(EngineUnavailable) as caught:
            list(backend._events(None, {}, threading.Event()))  # type: ignore[arg-type]
        watcher.join(10)  # it records the death (a stop before that would read as ours)
    finally:
        killer.cancel()
        engine.stop()
    assert "SIGKILL" in str(caught.value), caught.value
    assert backend.state == "dead" and "SIGKILL" in backend.failure


def test_a_break_with_the_engine_alive_keeps_its_own_message(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(vllm, "CUT_WAIT_S", 0.3)
    backend, _ = _backend(monkeypatch)
    engine = backend.engine
    assert engine is not None
    try:
        with pytest.raises(EngineUnavailable, match="connection broke"):
            list(backend._events(None, {}, threading.Event()))  # type: ignore[arg-type]
        assert engine.alive()
    finally:
        engine.stop()


def test_an_error_the_engine_answered_is_not_held_back(monkeypatch: pytest.MonkeyPatch) -> None:
    backend, _ = _backend(monkeypatch)

    def answered(self: Any, client: Any, body: Any, cancel: Any) -> Iterator[Any]:
        raise EngineUnavailable("the remote engine answered 500: boom")
        yield

    monkeypatch.setattr(RemoteBackend, "_events", answered)
    monkeypatch.setattr(vllm, "CUT_WAIT_S", 30.0)  # a broken connection would wait this long for the process
    engine = backend.engine
    assert engine is not None
    try:
        started = time.monotonic()
        with pytest.raises(EngineUnavailable, match="answered 500"):
            list(backend._events(None, {}, threading.Event()))  # type: ignore[arg-type]
        assert time.monotonic() - started < 10
    finally:
        engine.stop()


def test_a_cut_read_after_the_restart_names_the_old_process_end() -> None:
    command = [sys.executable, "-c", "import time; time.sleep(60)"]
    engine = vllm.Engine(command, dict(os.environ), port=1, name="stand-in")
    engine.start()
    try:
        assert engine.proc is not None
        os.killpg(engine.proc.pid, signal.SIGKILL)
        assert engine.ended_since(1, 10)
        engine.start()  # what the watcher does next: a stream of the first that reads its cut now has a new process
        assert engine.generation == 2 and engine.alive()
        assert "SIGKILL" in engine.exit_of(1)
        assert engine.exit_of(1) != engine.exit_text()  # the new process's (still running) is not the cut's cause
    finally:
        engine.stop()
