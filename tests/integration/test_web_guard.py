"""The web-origin guard on a real server: a foreign Host (DNS rebinding) and a foreign Origin (any web page the
user visits) can neither generate nor change state; same-origin pages, declared names and origins, and clients
that send no Origin (SDKs, curl) keep working."""

from __future__ import annotations

import json
import re
import socket
from pathlib import Path

import httpx
import pytest

from modules.web_guard import WebOriginGuard, host_allowed, same_origin, split_host
from tests.conftest import run_async

CHAT = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4, "temperature": 0}


def completion_tokens(url: str) -> int:
    text = httpx.get(url + "/metrics").text
    return int(re.search(r"^textgen_completion_tokens_total (\d+)", text, re.M).group(1))  # type: ignore[union-attr]


def test_host_names_origins_and_ports_are_read_as_a_browser_sends_them() -> None:
    assert split_host("Example.ORG:8080") == ("example.org", 8080)
    assert split_host("[::1]:7860") == ("::1", 7860) and split_host("::1") == ("::1", None)
    assert split_host("localhost.") == ("localhost", None)
    for name in ("127.0.0.1", "::1", "10.1.2.3", "localhost", "app.localhost", ""):
        assert host_allowed(name, []), name
    assert not host_allowed("attacker.example", []) and not host_allowed("localhost.attacker.example", [])
    assert host_allowed("textgen.lan", ["textgen.lan"]) and host_allowed("a.b.example.org", [".example.org"])
    assert not host_allowed("badexample.org", [".example.org"]) and host_allowed("anything", ["*"])
    assert same_origin("http://127.0.0.1:7860", "127.0.0.1:7860")
    assert same_origin("https://chat.example.org", "chat.example.org") and same_origin("http://h", "h:80")
    assert not same_origin("http://127.0.0.1:9999", "127.0.0.1:7860")
    assert not same_origin("null", "127.0.0.1:7860") and not same_origin("http://[::1]:x", "[::1]:7860")


def test_a_websocket_from_another_origin_is_closed_before_the_app_sees_it() -> None:
    seen: list[str] = []

    async def app(scope: object, receive: object, send: object) -> None:
        seen.append("app")

    guard = WebOriginGuard(app, allowed_hosts=list, cors_origins=list, json_route=lambda path: True)
    sent: list[dict[str, object]] = []

    async def send(message: dict[str, object]) -> None:
        sent.append(message)

    async def receive() -> dict[str, object]:
        return {"type": "websocket.connect"}

    def scope(origin: bytes) -> dict[str, object]:
        headers = [(b"host", b"127.0.0.1:7860"), (b"origin", origin)]
        return {"type": "websocket", "path": "/gradio_api/ws", "headers": headers}

    run_async(guard, scope(b"http://127.0.0.1:9999"), receive, send)
    assert seen == [] and sent[0]["type"] == "websocket.close" and sent[0]["code"] == 1008
    run_async(guard, scope(b"http://127.0.0.1:7860"), receive, send)
    assert seen == ["app"]


def test_requests_a_hostile_page_can_send_are_refused_and_change_nothing(shared_server) -> None:
    url = shared_server.url
    port = shared_server.port
    before = completion_tokens(url)
    other = {"Origin": f"http://127.0.0.1:{port + 1}"}  # another port is another origin: a hostile site
    body = json.dumps({"model": "x", **CHAT})
    attacks = [
        ("/v1/internal/model/unload", {}, ""),
        ("/internal/model/unload", {}, ""),  # text-generation-webui's root paths too
        ("/v1/chat/completions", {}, body),  # fetch(url, {mode: "no-cors", body: new Blob([json])}): no type
        ("/v1/chat/completions", {"Content-Type": "text/plain"}, body),
        ("/chat/completions", {"Content-Type": "application/x-www-form-urlencoded"}, "a=1"),  # an HTML form
        ("/v1/messages", {"Content-Type": "text/plain"}, body),
        ("/api/chat", {"Content-Type": "text/plain"}, body),
        ("/gradio_api/queue/join", {"Content-Type": "text/plain"}, "{}"),  # the web UI's own API
    ]
    for path, headers, content in attacks:
        refused = httpx.post(url + path, headers={**other, **headers}, content=content)
        assert refused.status_code == 403, (path, refused.text)
        assert f"--api-cors-origins http://127.0.0.1:{port + 1}" in refused.text, path
    # DNS rebinding: the page's own name, resolved to 127.0.0.1, arrives as the Host
    for path in ("/", "/v1/models", "/health"):
        rebound = httpx.get(url + path, headers={"Host": f"attacker.example:{port}"})
        assert rebound.status_code == 403 and "--allowed-hosts attacker.example" in rebound.text, path
    posted = httpx.post(url + "/v1/chat/completions", json=CHAT, headers={"Host": f"attacker.example:{port}"})
    assert posted.status_code == 403
    info = httpx.get(url + "/v1/internal/model/info").json()
    assert info["model_name"] != "None"  # the model is still loaded
    assert completion_tokens(url) == before  # and nothing was generated
    # what must keep working: the server's own pages, localhost names, and clients without an Origin
    own = httpx.post(url + "/v1/chat/completions", json=CHAT, headers={"Origin": url}, timeout=60)
    assert own.status_code == 200
    for host in (f"localhost:{port}", f"app.localhost:{port}", f"127.0.0.1:{port}"):
        assert httpx.get(url + "/v1/models", headers={"Host": host}).status_code == 200, host
    sdk = httpx.post(url + "/api/chat", content=json.dumps({"model": "x", "messages": []}), timeout=60)
    assert sdk.status_code == 200  # Ollama's curl examples send no JSON content type
    assert completion_tokens(url) > before


def test_declared_hosts_and_origins_are_let_through(live_server_factory, tmp_path: Path) -> None:
    server = live_server_factory(
        "--model", "none", "--user-data-dir", str(tmp_path / "ud"), "--allowed-hosts", "textgen.lan",
        "--api-cors-origins", "http://app.example", want_model=False,
    )  # fmt: skip
    assert httpx.get(server.url + "/v1/models", headers={"Host": "textgen.lan"}).status_code == 200
    assert httpx.get(server.url + "/v1/models", headers={"Host": "other.lan"}).status_code == 403
    allowed = {"Origin": "http://app.example"}
    listed = httpx.post(server.url + "/v1/internal/model/unload", headers=allowed, json={})
    assert listed.status_code == 200, listed.text  # a listed origin's JSON request reaches the route
    form = httpx.post(server.url + "/v1/internal/model/unload", headers=allowed, data={"a": "1"})
    assert form.status_code == 415 and "application/json" in form.text  # but not as a form, which skips preflight
    keyed = httpx.post(
        server.url + "/v1/internal/model/unload", headers={**allowed, "Authorization": "Bearer x"}, data={"a": "1"}
    )
    assert keyed.status_code != 415  # a page that sends a key went through a preflight
    refused = httpx.post(server.url + "/v1/internal/model/unload", headers={"Origin": "http://evil.example"})
    assert refused.status_code == 403


@pytest.mark.parametrize("path", ["/internal/model/info", "/v1/internal/model/info"])
def test_the_internal_api_at_the_root_is_under_the_api_s_rules(shared_server, path: str) -> None:
    url = shared_server.url
    assert httpx.get(url + path).status_code == 200
    preflight = httpx.options(
        url + path, headers={"Origin": "http://evil.example", "Access-Control-Request-Method": "POST"}
    )
    assert preflight.status_code == 403  # the preflight gate covers it
    assert f'endpoint="{path.removeprefix("/v1")}"' in httpx.get(url + "/metrics").text  # and the metrics
    with socket.create_connection(("127.0.0.1", shared_server.port), timeout=10) as sock:  # 1 GiB declared, not sent
        head = f"POST {path.replace('info', 'load')} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: {2**30}\r\n\r\n"
        sock.sendall(head.encode())
        answer = sock.recv(65536)
    assert answer.split()[1] == b"413"  # and the body-size limit
