"""Oversized API requests are refused at once (413 for big bodies, 400 for prompts that cannot fit), and the server
keeps answering other clients meanwhile; the web UI's uploads have their own limit (--max-upload-mb)."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

import httpx
import pytest

from tests.conftest import LiveServer

T = TypeVar("T")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """A live server with the web UI, the default model, a 24 MiB body limit, 40 MiB uploads and a 2048-token
    context."""
    tmp = tmp_path_factory.mktemp("limits")
    server = LiveServer(
        [
            "--user-data-dir",
            str(tmp / "user_data"),
            "--max-request-mb",
            "24",
            "--max-upload-mb",
            "40",
            "--n-ctx",
            "2048",
        ],
        tmp,
    )
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


def _timed(fn: Callable[[], T]) -> tuple[T, float]:
    started = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - started


def _raw_request(server: LiveServer, headers: str) -> socket.socket:
    host, port = server.url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=10)
    sock.sendall(
        f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n{headers}\r\n".encode()
    )
    return sock


def _read_answer(sock: socket.socket) -> tuple[int, dict]:
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(
        next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length"))
    )
    while len(body) < length:
        body += sock.recv(65536)
    return int(head.split()[1]), json.loads(body)


def test_a_declared_body_over_the_limit_is_answered_before_it_is_sent(server: LiveServer) -> None:
    started = time.perf_counter()
    with _raw_request(server, f"Content-Length: {60 * 2**20}\r\n") as sock:  # headers only: not a byte of the body
        status, body = _read_answer(sock)
    print(f"60 MB declared, no body sent: {status} in {time.perf_counter() - started:.3f} s")
    assert status == 413
    assert body["error"]["code"] == "request_too_large" and "--max-request-mb" in body["error"]["message"]


def test_a_60_mb_body_gets_413_and_the_connection_stays_usable(server: LiveServer) -> None:
    body = b'{"prompt": "' + b"x" * (60 * 2**20) + b'"}'
    with httpx.Client(timeout=30) as client:
        response, seconds = _timed(
            lambda: client.post(
                server.url + "/v1/completions", content=body, headers={"Content-Type": "application/json"}
            )
        )
        print(
            f"60 MB body with Content-Length (httpx): {response.status_code} in {seconds:.2f} s, "
            f"X-Process-Time {response.headers.get('x-process-time')} s"
        )
        assert response.status_code == 413 and seconds < 10
        assert response.json()["error"]["code"] == "request_too_large"
        assert client.get(server.url + "/v1/models").status_code == 200  # the same connection, still fine


def test_a_chunked_body_is_answered_once_it_grows_past_the_limit(server: LiveServer) -> None:
    with _raw_request(server, "Transfer-Encoding: chunked\r\n") as sock:
        chunk = b"x" * 2**20
        for _ in range(26):  # 26 MiB, past --max-request-mb 24, and the body never ends
            sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        started = time.perf_counter()
        status, body = _read_answer(sock)
    print(f"chunked body, 26 MiB sent and no end: {status} {time.perf_counter() - started:.3f} s after the last chunk")
    assert status == 413 and body["error"]["code"] == "request_too_large"


@pytest.mark.parametrize(
    ("path", "shape"),
    [("/api/chat", "ollama"), ("/v1/messages", "anthropic"), ("/chat/completions", "openai")],
)
def test_the_413_comes_in_each_api_s_own_shape(server: LiveServer, path: str, shape: str) -> None:
    body = b'{"messages": "' + b"x" * (25 * 2**20) + b'"}'
    response = httpx.post(server.url + path, content=body, headers={"Content-Type": "application/json"}, timeout=30)
    assert response.status_code == 413
    error = response.json()
    message = {"ollama": lambda: error["error"], "anthropic": lambda: error["error"]["message"]}.get(
        shape, lambda: error["error"]["message"]
    )()
    assert "--max-request-mb" in message
    if shape == "anthropic":
        assert error["type"] == "error" and error["error"]["type"] == "request_too_large"
    if shape == "openai":
        assert error["error"]["code"] == "request_too_large"


def test_a_body_under_the_limit_without_content_length_still_works(server: LiveServer) -> None:
    payload = json.dumps({"prompt": "Hello", "max_tokens": 2, "temperature": 0}).encode()

    def chunks() -> Iterator[bytes]:
        yield payload[:5]
        yield payload[5:]

    response = httpx.post(
        server.url + "/v1/completions", content=chunks(), headers={"Content-Type": "application/json"}, timeout=60
    )
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] >= 1


def test_a_20_mb_prompt_is_refused_quickly_while_a_small_request_is_served(server: LiveServer) -> None:
    big = {"prompt": "The quick brown fox jumps over the lazy dog. " * (20 * 2**20 // 45), "max_tokens": 4}
    big_body = json.dumps(big).encode()
    results: dict[str, tuple[int, float, dict]] = {}

    def send_big() -> None:
        started = time.perf_counter()
        response = httpx.post(
            server.url + "/v1/completions",
            content=big_body,
            headers={"Content-Type": "application/json"},
            timeout=120,
        )
        results["big"] = (response.status_code, time.perf_counter() - started, response.json())

    def send_small() -> tuple[httpx.Response, float]:
        started = time.perf_counter()
        response = httpx.post(
            server.url + "/v1/completions",
            json={"prompt": "Once upon a time", "max_tokens": 4, "temperature": 0},
            timeout=120,
        )
        return response, time.perf_counter() - started

    _, alone_seconds = send_small()
    thread = threading.Thread(target=send_big)
    thread.start()
    time.sleep(0.05)  # the big one is on its way
    small, small_seconds = send_small()
    thread.join(timeout=120)
    status, big_seconds, body = results["big"]
    print(
        f"20 MB prompt: {status} in {big_seconds:.2f} s; a small request meanwhile {small_seconds:.2f} s "
        f"(alone {alone_seconds:.2f} s)"
    )
    assert status == 400 and body["error"]["code"] == "context_length_exceeded", body
    assert "2048 tokens" in body["error"]["message"]
    assert big_seconds < 30
    assert small.status_code == 200 and small_seconds < 30


def test_the_web_ui_uploads_are_not_held_to_the_api_limit(server: LiveServer) -> None:
    data = b"\0" * (30 * 2**20)  # over --max-request-mb 24
    response = httpx.post(
        server.url + "/gradio_api/upload", files={"files": ("big.bin", data, "application/octet-stream")}, timeout=60
    )
    assert response.status_code == 200, response.text[:500]
    assert response.json()[0].endswith("big.bin")


def test_a_web_ui_upload_over_max_upload_mb_is_refused(server: LiveServer) -> None:
    data = b"\0" * (48 * 2**20)  # over --max-upload-mb 40
    response = httpx.post(
        server.url + "/gradio_api/upload", files={"files": ("huge.bin", data, "application/octet-stream")}, timeout=60
    )
    assert response.status_code == 413, response.text[:500]
    assert "40" in response.text or "size" in response.text.lower()
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200


def test_a_20_mb_chat_message_is_refused_quickly(server: LiveServer) -> None:
    text = "The quick brown fox jumps over the lazy dog. " * (20 * 2**20 // 45)
    history = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": text},
    ]
    started = time.perf_counter()
    response = httpx.post(server.url + "/v1/chat/completions", json={"messages": history, "max_tokens": 4}, timeout=120)
    seconds = time.perf_counter() - started
    print(f"20 MB chat message: {response.status_code} in {seconds:.2f} s")
    assert response.status_code == 400 and response.json()["error"]["code"] == "context_length_exceeded"
    assert seconds < 30
    # an old message that long is dropped to fit, as before: the reply goes on with the newest ones
    history = [
        {"role": "user", "content": text},
        {"role": "assistant", "content": "Noted."},
        {"role": "user", "content": "Hi"},
    ]
    started = time.perf_counter()
    response = httpx.post(server.url + "/v1/chat/completions", json={"messages": history, "max_tokens": 4}, timeout=120)
    seconds = time.perf_counter() - started
    print(f"20 MB old chat message dropped: {response.status_code} in {seconds:.2f} s")
    assert response.status_code == 200, response.text[:300]
    assert response.json()["usage"]["prompt_tokens"] < 100
    assert seconds < 30


def test_the_length_precheck_never_refuses_a_prompt_that_fits(with_default_model) -> None:
    from modules import models
    from modules.errors import InvalidRequest
    from modules.generation.params import GenerationParams
    from modules.generation.pipeline import MIN_CHARS_PER_TOKEN, prepare

    backend = models.load_model(with_default_model.name)
    limit = backend.context_length
    pieces = [backend.token_piece(t) for t in range(backend.metadata.extra["n_vocab"])]
    longest = max(pieces, key=len).decode("utf-8")  # SmolLM2: a newline and 80 spaces
    text = longest * (limit - 16)  # fits: one token per copy
    assert len(text) > limit * MIN_CHARS_PER_TOKEN  # long enough for the precheck to look at it
    prepared = prepare(text, GenerationParams(max_new_tokens=4), backend)
    assert len(prepared.prompt_ids) < limit
    with pytest.raises(InvalidRequest) as info:  # a few more copies than the context holds: refused, by either check
        prepare(longest * (limit + 16), GenerationParams(max_new_tokens=4), backend)
    assert info.value.code == "context_length_exceeded"
    started = time.perf_counter()
    with pytest.raises(InvalidRequest) as info:  # 20 MB: refused from its length, not after tokenizing it all
        prepare("The quick brown fox. " * 1_000_000, GenerationParams(max_new_tokens=4), backend)
    seconds = time.perf_counter() - started
    print(f"prepare() refused a 20 MB prompt in {seconds:.3f} s")
    assert info.value.code == "context_length_exceeded" and seconds < 5


def test_the_logits_route_refuses_a_20_mb_prompt_quickly(server: LiveServer) -> None:
    """/v1/internal/logits tokenized on the event loop, with no precheck (13 s here, every other client waiting).
    (Ollama's fill-in-the-middle path has the same fix, untested: the default model has no FIM tokens.)"""
    text = "The quick brown fox jumps over the lazy dog. " * (20 * 2**20 // 45)
    started = time.perf_counter()
    response = httpx.post(server.url + "/v1/internal/logits", json={"prompt": text}, timeout=120)
    seconds = time.perf_counter() - started
    print(f"20 MB prompt to /v1/internal/logits: {response.status_code} in {seconds:.2f} s")
    assert response.status_code == 400, response.text[:300]
    assert "context" in response.text and seconds < 30
