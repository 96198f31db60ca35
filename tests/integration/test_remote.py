"""The remote backend against a real second server on 127.0.0.1 (another textgen serving the default model)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from modules import models, shared
from modules.chat import engine
from modules.chat.prompt import ChatOptions
from modules.errors import ModelLoadError
from modules.generation.params import GenerationParams
from modules.generation.pipeline import generate_reply
from modules.settings import load_settings
from tests.conftest import DEFAULT_MODEL

SYSTEM = "You are a helpful AI assistant."


@pytest.fixture(scope="module")
def engine_server(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    from tests.conftest import LiveServer

    tmp = tmp_path_factory.mktemp("engine")
    server = LiveServer(["--nowebui", "--user-data-dir", str(tmp / "ud"), "--parallel", "2"], tmp)
    server.wait_ready()
    yield server
    server.stop()


def busy(server) -> int:  # type: ignore[no-untyped-def]
    metrics = httpx.get(server.url + "/metrics").text
    return int(float(next(line for line in metrics.splitlines() if line.startswith("textgen_busy_slots")).split()[-1]))


def test_remote_backend_in_process(engine_server, hub: object, user_data: Path) -> None:  # type: ignore[no-untyped-def]
    shared.init(
        load_settings(
            ["--user-data-dir", str(user_data), "--loader", "remote", "--remote-url", engine_server.url], env={}
        )
    )
    backend = models.load_model(DEFAULT_MODEL)
    assert backend.loader_name == "remote" and DEFAULT_MODEL in backend.served_models()
    assert backend.metadata.chat_template and "im_start" in backend.metadata.chat_template
    assert (
        backend.encode("Hello world")
        == httpx.post(engine_server.url + "/v1/internal/encode", json={"text": "Hello world"}).json()["tokens"]
    )
    assert backend.decode(backend.encode("Hello world")) == "Hello world"
    updates = list(
        engine.send(
            [],
            "What is the capital of France?",
            GenerationParams(temperature=0, max_new_tokens=30),
            options=ChatOptions(system=SYSTEM),
        )
    )
    assert "Paris" in updates[-1].history[-1]["content"] and len(updates) > 3
    cancel = threading.Event()
    for n, _ in enumerate(
        generate_reply("Tell me a very long story.", GenerationParams(max_new_tokens=500, ban_eos=True), cancel=cancel)
    ):
        if n == 3:
            assert busy(engine_server) == 1
            cancel.set()
    deadline = time.monotonic() + 5
    while busy(engine_server) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert busy(engine_server) == 0, "the engine kept generating after Stop"


def test_remote_refuses_clearly(hub: object, user_data: Path) -> None:
    shared.init(load_settings(["--user-data-dir", str(user_data), "--loader", "remote"], env={}))
    with pytest.raises(ModelLoadError, match="remote-url"):
        models.load_model("anything")
    shared.init(
        load_settings(
            ["--user-data-dir", str(user_data), "--loader", "remote", "--remote-url", "http://127.0.0.1:9"], env={}
        )
    )
    with pytest.raises(ModelLoadError, match="cannot reach"):
        models.load_model("anything")


def test_textgen_in_front_of_an_engine(engine_server, live_server_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    front = live_server_factory(
        "--nowebui",
        "--loader",
        "remote",
        "--remote-url",
        engine_server.url,
        "--model",
        DEFAULT_MODEL,
        "--user-data-dir",
        str(tmp_path / "ud"),
    )
    client = openai.OpenAI(base_url=front.url + "/v1", api_key="x", max_retries=0)
    assert DEFAULT_MODEL in [m.id for m in client.models.list().data]
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is the capital of France?"}]
    reply = client.chat.completions.create(model="gpt-4o", messages=messages, temperature=0, max_tokens=30)
    assert "Paris" in reply.choices[0].message.content
    streamed = "".join(
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(
            model="gpt-4o", messages=messages, temperature=0, max_tokens=30, stream=True
        )
        if c.choices
    )
    assert streamed == reply.choices[0].message.content
    assert "Loaded" in front.log() and "with remote" in front.log()


class SilentEngine:
    """A stand-in OpenAI-compatible engine that answers the headers of a completion, then stays silent (a long
    prefill) until released; it records whether the client hung up."""

    def __init__(self) -> None:
        import http.server
        import json as json_module

        self.release = threading.Event()
        self.hung_up = threading.Event()
        engine = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def _json(self, status: int, body: object) -> None:
                data = json_module.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                self._json(200, {"data": [{"id": "silent"}]} if self.path == "/v1/models" else {})

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if self.path != "/v1/completions":
                    self._json(404, {"error": {"message": "no such endpoint"}})
                    return
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                self.wfile.flush()
                engine.release.wait(10)
                try:
                    line = b'data: {"choices": [{"text": "late", "finish_reason": "stop"}]}\n\n'
                    self.wfile.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(line), line))
                    self.wfile.flush()
                except OSError:
                    engine.hung_up.set()
                    return
                if self.rfile.read(1) == b"":  # the client closed its side
                    engine.hung_up.set()

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def silent_engine():  # type: ignore[no-untyped-def]
    engine = SilentEngine()
    yield engine
    engine.close()


def test_stop_works_while_the_engine_is_silent(silent_engine: SilentEngine) -> None:
    from modules.loaders.remote import RemoteBackend

    backend = RemoteBackend.load(Path("silent"), {"remote_url": silent_engine.url})
    try:
        cancel = threading.Event()
        events = backend.generate([1, 2, 3], GenerationParams(max_new_tokens=5), cancel, {"prompt_text": "Hi"})
        threading.Timer(0.3, cancel.set).start()
        started = time.monotonic()
        reasons = [e.finish_reason for e in events]
        elapsed = time.monotonic() - started
        assert reasons == ["cancelled"]
        assert elapsed < 1.0, f"Stop took {elapsed:.2f} s while the engine was silent"
        assert backend.stats()["queue_depth"] == 0
        silent_engine.release.set()
        assert silent_engine.hung_up.wait(5), "the engine never saw the client go"
    finally:
        backend.unload()


def test_a_stream_never_started_gives_its_place_back(silent_engine: SilentEngine) -> None:
    import gc

    from modules.errors import QueueFull
    from modules.loaders.remote import RemoteBackend

    backend = RemoteBackend.load(Path("silent"), {"remote_url": silent_engine.url, "parallel": 1, "max_queue": 0})
    try:
        params = GenerationParams(max_new_tokens=5)
        unstarted = backend.generate([1], params, threading.Event(), {"prompt_text": "Hi"})
        with pytest.raises(QueueFull):
            backend.generate([1], params, threading.Event(), {"prompt_text": "Hi"})
        del unstarted  # a client gone before its stream began
        gc.collect()
        backend.generate([1], params, threading.Event(), {"prompt_text": "Hi"})  # not QueueFull
    finally:
        backend.unload()
