"""Images fetched from URLs: off by default, public addresses only (redirects included), a size cap and a deadline.

The servers here are real HTTP servers on 127.0.0.x. To have an "allowed" server on this machine, the tests put
exactly 127.0.0.1 in ``images.EXTRA_ALLOWED`` (the module's test seam); every other local address stays refused.
"""

from __future__ import annotations

import base64
import contextlib
import io
import ipaddress
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from modules import images, shared
from modules.errors import InvalidRequest
from modules.settings import Settings


def _png() -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (3, 2), (200, 10, 10)).save(buffer, format="PNG")
    return buffer.getvalue()


PNG = _png()


class Server:
    """A threaded HTTP server on ``host`` whose GET handler is ``handle(handler)``; records the paths it served."""

    def __init__(self, host: str, handle: Callable[[BaseHTTPRequestHandler], None]) -> None:
        self.paths: list[str] = []
        self.sent = 0  # body bytes written
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                outer.paths.append(self.path)
                with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                    handle(self)

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = ThreadingHTTPServer((host, 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://{host}:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def serve_png(handler: BaseHTTPRequestHandler) -> None:
    handler.send_response(200)
    handler.send_header("Content-Type", "image/png")
    handler.send_header("Content-Length", str(len(PNG)))
    handler.end_headers()
    handler.wfile.write(PNG)


@pytest.fixture
def servers() -> Iterator[Callable[..., Server]]:
    started: list[Server] = []

    def start(handle: Callable[[BaseHTTPRequestHandler], None], host: str = "127.0.0.1") -> Server:
        server = Server(host, handle)
        started.append(server)
        return server

    yield start
    for server in started:
        server.close()


@pytest.fixture
def remote_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """--allow-remote-images, and 127.0.0.1 (only) let through as if it were public."""
    monkeypatch.setattr(shared, "settings", Settings(allow_remote_images=True))
    monkeypatch.setattr(images, "EXTRA_ALLOWED", frozenset({ipaddress.ip_address("127.0.0.1")}))


def test_remote_images_are_off_by_default_and_data_urls_still_work(servers, monkeypatch) -> None:
    monkeypatch.setattr(shared, "settings", Settings())
    monkeypatch.setattr(images, "EXTRA_ALLOWED", frozenset({ipaddress.ip_address("127.0.0.1")}))
    server = servers(serve_png)
    with pytest.raises(InvalidRequest, match="--allow-remote-images") as info:
        images.load_image(server.url + "/a.png", "messages")
    assert info.value.param == "messages" and server.paths == []  # never connected
    image = images.load_image("data:image/png;base64," + base64.b64encode(PNG).decode())
    assert image.size == (3, 2)


def test_an_allowed_address_is_fetched_following_redirects(servers, remote_on) -> None:
    def handle(handler: BaseHTTPRequestHandler) -> None:
        if handler.path == "/a.png":
            serve_png(handler)
            return
        handler.send_response(302)
        handler.send_header("Location", "/a.png")
        handler.send_header("Content-Length", "0")
        handler.end_headers()

    server = servers(handle)
    image = images.load_image(server.url + "/start", "messages")
    assert image.size == (3, 2) and image.getpixel((0, 0)) == (200, 10, 10)
    assert server.paths == ["/start", "/a.png"]


@pytest.mark.parametrize(
    "host",
    [
        "127.0.0.2",  # loopback other than the one address the seam allows
        "10.1.2.3",
        "192.168.1.1",
        "172.16.0.1",
        "169.254.169.254",  # cloud metadata
        "100.64.0.1",  # carrier-grade NAT
        "0.0.0.0",
        "[::1]",
        "[::ffff:127.0.0.1]",
        "[::ffff:169.254.169.254]",
        "[fe80::1]",
        "[fd00:ec2::254]",
        "[2002:7f00:1::]",  # 6to4 around 127.0.0.1
        "[64:ff9b::7f00:1]",  # NAT64 around 127.0.0.1
        "[64:ff9b::a9fe:a9fe]",  # NAT64 around the cloud metadata address
        "[64:ff9b:1::a00:1]",  # local-use NAT64 around 10.0.0.1
        "224.0.0.1",
    ],
)
def test_local_and_private_addresses_are_refused(host: str, remote_on) -> None:
    started = time.perf_counter()
    with pytest.raises(InvalidRequest, match="public addresses") as info:
        images.load_image(f"http://{host}:9/a.png", "messages")
    assert info.value.code == "image_url_not_allowed"
    assert time.perf_counter() - started < 5  # refused before any connection attempt


def test_a_real_local_server_is_not_reached_without_the_seam(servers, monkeypatch) -> None:
    monkeypatch.setattr(shared, "settings", Settings(allow_remote_images=True))
    server = servers(serve_png)
    port = server.url.rsplit(":", 1)[1]
    for url in (server.url, f"http://localhost:{port}", f"http://2130706433:{port}"):
        with pytest.raises(InvalidRequest, match="public addresses"):
            images.load_image(url + "/a.png")
    assert server.paths == []


def test_a_redirect_from_an_allowed_server_to_loopback_is_refused(servers, remote_on) -> None:
    inner = servers(serve_png, host="127.0.0.2")  # would serve the picture if it were reached

    def redirect(handler: BaseHTTPRequestHandler) -> None:
        handler.send_response(302)
        handler.send_header("Location", inner.url + "/a.png")
        handler.send_header("Content-Length", "0")
        handler.end_headers()

    outer = servers(redirect)
    with pytest.raises(InvalidRequest, match="public addresses"):
        images.load_image(outer.url + "/start")
    assert outer.paths == ["/start"] and inner.paths == []


def test_endless_redirects_stop(servers, remote_on) -> None:
    def loop(handler: BaseHTTPRequestHandler) -> None:
        handler.send_response(307)
        handler.send_header("Location", "/again")
        handler.send_header("Content-Length", "0")
        handler.end_headers()

    server = servers(loop)
    with pytest.raises(InvalidRequest, match="redirects"):
        images.load_image(server.url + "/start")
    assert len(server.paths) == images.MAX_REDIRECTS + 1


def test_a_declared_body_over_the_cap_is_refused_before_reading(servers, remote_on, monkeypatch) -> None:
    monkeypatch.setattr(images, "MAX_BYTES", 2**20)

    def huge(handler: BaseHTTPRequestHandler) -> None:
        handler.send_response(200)
        handler.send_header("Content-Length", str(2**30))
        handler.end_headers()
        handler.wfile.flush()
        time.sleep(5)  # the body would come later; the header alone must be enough to refuse
        handler.wfile.write(b"\0" * 2**16)
        server.sent += 2**16

    server = servers(huge)
    started = time.perf_counter()
    with pytest.raises(InvalidRequest, match="larger than 1 MiB"):
        images.load_image(server.url + "/big.png")
    assert time.perf_counter() - started < 3 and server.sent == 0


def test_an_undeclared_body_over_the_cap_stops_being_read(servers, remote_on, monkeypatch) -> None:
    monkeypatch.setattr(images, "MAX_BYTES", 2**20)

    def endless(handler: BaseHTTPRequestHandler) -> None:
        handler.send_response(200)
        handler.send_header("Content-Type", "image/png")
        handler.send_header("Connection", "close")  # no Content-Length: the body ends when the connection does
        handler.end_headers()
        chunk = b"\0" * 2**16
        for _ in range(2**14):  # 1 GiB
            handler.wfile.write(chunk)
            server.sent += len(chunk)

    server = servers(endless)
    started = time.perf_counter()
    with pytest.raises(InvalidRequest, match="larger than 1 MiB"):
        images.load_image(server.url + "/big.png")
    seconds = time.perf_counter() - started
    time.sleep(0.2)
    assert server.sent < 64 * 2**20, f"{server.sent >> 20} MiB written"
    assert seconds < 5


def test_a_dribbling_server_hits_the_total_deadline(servers, remote_on, monkeypatch) -> None:
    monkeypatch.setattr(images, "FETCH_DEADLINE", 1.5)

    def dribble(handler: BaseHTTPRequestHandler) -> None:
        handler.send_response(200)
        handler.send_header("Content-Length", "1000")
        handler.end_headers()
        for _ in range(1000):  # one byte every 0.1 s: each read is quick, the whole body takes 100 s
            handler.wfile.write(b"\0")
            handler.wfile.flush()
            time.sleep(0.1)

    server = servers(dribble)
    started = time.perf_counter()
    with pytest.raises(InvalidRequest, match=r"within 1\.5 s"):
        images.load_image(server.url + "/slow.png")
    assert time.perf_counter() - started < 4


def test_a_silent_server_hits_the_total_deadline_across_redirects(servers, remote_on, monkeypatch) -> None:
    monkeypatch.setattr(images, "FETCH_DEADLINE", 1.5)

    def slow_redirects(handler: BaseHTTPRequestHandler) -> None:
        time.sleep(0.6)  # each hop is well within a per-request timeout; three of them are not
        handler.send_response(302)
        handler.send_header("Location", f"/hop{len(server.paths)}")
        handler.send_header("Content-Length", "0")
        handler.end_headers()

    server = servers(slow_redirects)
    started = time.perf_counter()
    with pytest.raises(InvalidRequest, match=r"within 1\.5 s"):
        images.load_image(server.url + "/start")
    assert time.perf_counter() - started < 4


def test_https_goes_to_the_checked_address_and_verifies_the_name(servers, remote_on, monkeypatch, tmp_path) -> None:
    import socket
    import ssl
    import subprocess

    if {info[4][0] for info in socket.getaddrinfo("localhost", 443, type=socket.SOCK_STREAM)} != {"127.0.0.1"}:
        pytest.skip("localhost does not resolve to 127.0.0.1 alone here")
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
         "-addext", "subjectAltName=DNS:localhost", "-addext", "basicConstraints=critical,CA:TRUE",
         "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )  # fmt: skip
    hosts: list[str] = []

    def handle(handler: BaseHTTPRequestHandler) -> None:
        hosts.append(handler.headers.get("Host", ""))
        serve_png(handler)

    server = servers(handle)
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    server.httpd.socket = context.wrap_socket(server.httpd.socket, server_side=True)
    monkeypatch.setattr(images, "TLS_VERIFY", ssl.create_default_context(cafile=str(cert)))
    port = server.url.rsplit(":", 1)[1]
    image = images.load_image(f"https://localhost:{port}/a.png")  # the certificate names localhost, not 127.0.0.1
    assert image.size == (3, 2) and hosts == [f"localhost:{port}"]
    with pytest.raises(InvalidRequest, match="could not fetch"):  # the name is still verified
        images.load_image(f"https://127.0.0.1:{port}/a.png")


def test_an_image_of_too_many_pixels_is_refused_before_it_is_decoded() -> None:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("1", (12_000, 12_000)).save(buffer, format="PNG")  # 144 M pixels in a few kB
    data = base64.b64encode(buffer.getvalue()).decode()
    assert len(data) < 100_000
    with pytest.raises(InvalidRequest, match="12000x12000 pixels"):
        images.load_image(f"data:image/png;base64,{data}", "messages")
    small = io.BytesIO()
    Image.new("RGB", (64, 48)).save(small, format="PNG")
    image = images.load_image("data:image/png;base64," + base64.b64encode(small.getvalue()).decode(), "messages")
    assert image.size == (64, 48)
