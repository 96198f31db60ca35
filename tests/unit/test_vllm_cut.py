"""A stream cut by a dying vLLM engine says why, even when the connection breaks before the process is reaped.

The engine here is a real child process started by :class:`modules.loaders.vllm.Engine` and watched by the backend's
own watcher thread (as in serving); only the HTTP stream is replaced by one that breaks at once, since what is under
test is the order of the two events: the broken connection first, the process's end later."""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from modules.errors import EngineUnavailable
from modules.loaders import vllm
from modules.loaders.remote import RemoteBackend


def _backend(monkeypatch: pytest.MonkeyPatch) -> vllm.VllmBackend:
    def broken(self: Any, client: Any, body: Any, cancel: Any) -> Iterator[Any]:
        raise EngineUnavailable("the reply was cut off: the engine's connection broke (peer closed connection)")
        yield  # a generator, as the real one

    monkeypatch.setattr(RemoteBackend, "_events", broken)
    command = [sys.executable, "-c", "import time; time.sleep(60)"]
    engine = vllm.Engine(command, dict(os.environ), port=1, name="stand-in")
    engine.start()
    backend = vllm.VllmBackend()
    backend.engine = engine
    backend.restarts_left = 0  # the watcher records the death and starts nothing
    threading.Thread(target=backend._watch, daemon=True).start()
    return backend


def test_the_reason_is_given_when_the_process_ends_after_the_connection_broke(monkeypatch: pytest.MonkeyPatch) -> None:
    backend = _backend(monkeypatch)
    engine = backend.engine
    assert engine is not None and engine.proc is not None
    killer = threading.Timer(1.0, os.killpg, args=(engine.proc.pid, signal.SIGKILL))
    killer.start()
    try:
        with pytest.raises(EngineUnavailable) as caught:
            list(backend._events(None, {}, threading.Event()))  # type: ignore[arg-type]
    finally:
        killer.cancel()
        engine.stop()
    assert "SIGKILL" in str(caught.value), caught.value
    assert backend.state == "dead"


def test_a_break_with_the_engine_alive_keeps_its_own_message(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(vllm, "CUT_WAIT_S", 0.3)
    backend = _backend(monkeypatch)
    engine = backend.engine
    assert engine is not None
    try:
        with pytest.raises(EngineUnavailable, match="connection broke"):
            list(backend._events(None, {}, threading.Event()))  # type: ignore[arg-type]
        assert engine.alive()
    finally:
        engine.stop()
