"""The remote backend against a real second server on 127.0.0.1 (another textgen serving the default model)."""

from __future__ import annotations

import http.server
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
    assert "Paris" in updates[-1].history[-1]["content"]
    partial = {u.history[-1]["content"] for u in updates[1:] if u.history[-1].get("role") == "assistant"}
    assert len(partial - {""}) >= 2  # it streamed: the reply grew in two steps or more
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


class _BurstServer(http.server.ThreadingHTTPServer):
    """A listen backlog like a real engine's (uvicorn's is 2048), not socketserver's 5: with 5, a burst of 110
    connects overflows it and the kernel's handshake retries (1, 2, 4, 8, 16 s) can outlast the test's wait."""

    request_queue_size = 256
    daemon_threads = True


class SilentEngine:
    """A stand-in OpenAI-compatible engine that answers the headers of a completion, then stays silent (a long
    prefill) until released; it records whether the client hung up."""

    def __init__(self) -> None:
        import json as json_module

        self.release = threading.Event()
        self.hung_up = threading.Event()
        self.opened = 0  # completions whose headers were sent
        self.fail_with: tuple[int, object] | None = None  # answer every POST with this status and body
        self.error_chunk = False  # stream an error object instead of the silence
        self._count = threading.Lock()
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
                if engine.fail_with is not None:
                    self._json(*engine.fail_with)
                    return
                if self.path != "/v1/completions":
                    self._json(404, {"error": {"message": "no such endpoint"}})
                    return
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                self.wfile.flush()
                with engine._count:
                    engine.opened += 1
                if engine.error_chunk:
                    line = b'data: {"error": {"message": "engine core died", "code": 500}}\n\n'
                    self.wfile.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(line), line))
                    self.wfile.flush()
                    return
                engine.release.wait(30)
                try:
                    line = b'data: {"choices": [{"text": "late", "finish_reason": "stop"}]}\n\n'
                    self.wfile.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(line), line))
                    self.wfile.flush()
                except OSError:
                    engine.hung_up.set()
                    return
                if self.rfile.read(1) == b"":  # the client closed its side
                    engine.hung_up.set()

        self.server = _BurstServer(("127.0.0.1", 0), Handler)
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
        pressed: list[float] = []
        stop = threading.Timer(0.3, lambda: (pressed.append(time.monotonic()), cancel.set()))
        stop.start()
        reasons = [e.finish_reason for e in events]
        stop.cancel()
        assert pressed and reasons == ["cancelled"]  # the engine stays silent until released: only Stop ends it
        elapsed = time.monotonic() - pressed[0]
        assert elapsed < 2.0, f"Stop took {elapsed:.2f} s while the engine was silent"
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


def test_more_streams_than_an_http_pool_holds_all_reach_the_engine(silent_engine: SilentEngine) -> None:
    """httpx's default pool holds 100 connections and makes the 101st wait, then fail (a 500): an engine that
    batches must get every stream textgen admits."""
    from modules.loaders.remote import RemoteBackend

    backend = RemoteBackend.load(Path("silent"), {"remote_url": silent_engine.url, "parallel": 120})
    results: list[list[str | None]] = []
    errors: list[BaseException] = []

    def one() -> None:
        try:
            events = backend.generate([1], GenerationParams(max_new_tokens=5), threading.Event(), {"prompt_text": "Hi"})
            results.append([e.finish_reason for e in events])
        except BaseException as exc:  # reported by the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=one, daemon=True) for _ in range(110)]
    try:
        for t in threads:
            t.start()
        deadline = time.monotonic() + 20
        while silent_engine.opened < 110 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert silent_engine.opened == 110, f"only {silent_engine.opened} of 110 streams reached the engine"
        silent_engine.release.set()
        for t in threads:
            t.join(timeout=20)
        assert not errors, errors[:3]
        assert len(results) == 110 and all(r[-1] == "stop" for r in results)
    finally:
        silent_engine.release.set()
        backend.unload()


def test_an_engine_failing_gives_clear_503s_and_a_refusal_a_400(silent_engine: SilentEngine) -> None:
    from modules.errors import EngineUnavailable, InvalidRequest
    from modules.loaders.remote import RemoteBackend

    backend = RemoteBackend.load(Path("silent"), {"remote_url": silent_engine.url})
    params = GenerationParams(max_new_tokens=5)

    def run() -> list[str | None]:
        return [e.finish_reason for e in backend.generate([1], params, threading.Event(), {"prompt_text": "Hi"})]

    try:
        silent_engine.error_chunk = True  # an error object in the middle of the stream
        with pytest.raises(EngineUnavailable, match="engine core died"):
            run()
        silent_engine.error_chunk = False
        silent_engine.fail_with = (500, {"error": {"message": "CUDA out of memory"}})
        with pytest.raises(EngineUnavailable, match="answered 500: CUDA out of memory"):
            run()
        silent_engine.fail_with = (422, {"error": {"message": "max_tokens is too large"}})
        with pytest.raises(InvalidRequest, match="max_tokens is too large"):
            run()
        backend._tokenizer = "vllm"  # its /tokenize answers 500 too
        silent_engine.fail_with = (500, {"error": {"message": "tokenizer crashed"}})
        with pytest.raises(EngineUnavailable, match="tokenizer crashed"):
            backend.encode("Hi")
        with pytest.raises(EngineUnavailable, match="tokenizer crashed"):
            backend.decode([1, 2])
        silent_engine.fail_with = None
        assert backend.client is not None
        backend.client.base_url = httpx.URL("http://127.0.0.1:9")  # the engine is gone: nothing listens there
        with pytest.raises(EngineUnavailable, match="cannot be reached"):
            run()
        with pytest.raises(EngineUnavailable, match="cannot be reached"):
            backend.encode("Hi")
    finally:
        backend.unload()
