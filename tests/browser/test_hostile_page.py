"""A hostile web page, in a real chromium, against the server on its defaults (127.0.0.1, no keys): it sends the
requests that need no CORS preflight (no-cors fetches of a JSON Blob and of text/plain, HTML forms) and gets
nothing done: the model stays loaded and nothing is generated. The server's own page keeps working."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from tests.integration.test_web_guard import completion_tokens

pytestmark = pytest.mark.browser


def hostile_page(target: str) -> str:
    chat = json.dumps({"model": "x", "messages": [{"role": "user", "content": "Write a poem."}], "max_tokens": 64})
    return f"""<!doctype html><html><body>
<form id="unload" method="POST" action="{target}/v1/internal/model/unload" target="sink">
  <input name="a" value="1"></form>
<form id="chat" method="POST" action="{target}/v1/chat/completions" enctype="text/plain" target="sink">
  <input name='{chat[:-1]}, "x": "' value='"}}'></form>
<iframe name="sink"></iframe>
<script>
window.results = [];
async function attack() {{
  const chat = {json.dumps(chat)};
  const sends = [
    ["{target}/v1/internal/model/unload", {{method: "POST", mode: "no-cors", body: new Blob(["{{}}"])}}],
    ["{target}/internal/model/unload", {{method: "POST", mode: "no-cors", body: "{{}}"}}],
    ["{target}/v1/chat/completions", {{method: "POST", mode: "no-cors", body: new Blob([chat])}}],
    ["{target}/v1/chat/completions", {{method: "POST", mode: "no-cors", headers: {{"Content-Type": "text/plain"}},
      body: chat}}],
    ["{target}/api/chat", {{method: "POST", mode: "no-cors", body: chat}}],
    ["{target}/gradio_api/queue/join", {{method: "POST", mode: "no-cors", body: "{{}}"}}],
    ["{target}/gradio_api/upload", {{method: "POST", mode: "no-cors", body: new FormData()}}],
    ["{target}/v1/chat/completions", {{method: "POST", headers: {{"Content-Type": "application/json"}}, body: chat}}],
  ];
  for (const [url, init] of sends) {{
    try {{ const r = await fetch(url, init); window.results.push(r.type + " " + r.status); }}
    catch (e) {{ window.results.push("error " + e.message); }}
  }}
  document.getElementById("unload").submit();
  await new Promise(r => setTimeout(r, 500));
  document.getElementById("chat").submit();
  await new Promise(r => setTimeout(r, 500));
  window.done = true;
}}
attack();
</script></body></html>"""


def user_data_of(server: object) -> Path:
    args = list(server.proc.args)  # type: ignore[attr-defined]
    return Path(args[args.index("--user-data-dir") + 1])


def snapshot(folder: Path) -> dict[str, tuple[int, int]]:
    return {str(p): (p.stat().st_size, p.stat().st_mtime_ns) for p in folder.rglob("*") if p.is_file()}


def test_a_page_on_another_origin_cannot_unload_or_generate(page, shared_server) -> None:
    url = shared_server.url
    html = hostile_page(url).encode()

    class Page(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(html)))
            self.end_headers()
            self.wfile.write(html)

        def log_message(self, *args: object) -> None:
            pass

    site = ThreadingHTTPServer(("127.0.0.1", 0), Page)  # another port of 127.0.0.1: another origin
    threading.Thread(target=site.serve_forever, daemon=True).start()
    files = snapshot(user_data_of(shared_server))
    try:
        before = completion_tokens(url)
        page.goto(f"http://127.0.0.1:{site.server_address[1]}/", wait_until="domcontentloaded")
        page.wait_for_function("() => window.done === true", timeout=60_000)
        results = page.evaluate("window.results")
        page.wait_for_timeout(1000)
    finally:
        site.shutdown()
        site.server_close()
    assert len(results) == 8 and results[-1].startswith("error"), results  # the preflighted one was refused
    info = httpx.get(url + "/v1/internal/model/info").json()
    assert info["model_name"] != "None", "a web page unloaded the model"
    assert completion_tokens(url) == before, "a web page made the server generate"
    assert "Refused POST /v1/internal/model/unload" in shared_server.log()
    assert snapshot(user_data_of(shared_server)) == files, "a web page changed a file"
    # the server's own page, in the same browser, still chats
    page.goto(url + "/", wait_until="domcontentloaded")
    reply = page.evaluate(
        """async () => (await fetch('/v1/chat/completions', {method: 'POST', headers: {'Content-Type':
        'application/json'}, body: JSON.stringify({messages: [{role: 'user', content: 'Hi'}], max_tokens: 4})})).status"""
    )
    assert reply == 200


def test_a_rebinding_name_gets_nothing_unless_declared(browser, live_server_factory, tmp_path: Path) -> None:
    """The browser resolves attacker.test to 127.0.0.1 (as a rebound DNS answer would): the page, same-origin with
    the server by its name, is refused the UI and the API; declared with --allowed-hosts, the same name works."""
    from tests.browser.conftest import ARGS, CHROMIUM

    plain = live_server_factory("--model", "none", "--user-data-dir", str(tmp_path / "a"), want_model=False)
    declared = live_server_factory(
        "--model", "none", "--user-data-dir", str(tmp_path / "b"), "--allowed-hosts", "attacker.test",
        want_model=False,
    )  # fmt: skip
    fetch = """async () => { const r = await fetch('/v1/internal/model/unload', {method: 'POST',
        headers: {'Content-Type': 'application/json'}, body: '{}'}); return r.status + ' ' + await r.text(); }"""
    rebinding = browser.browser_type.launch(  # a browser of its own: one rule resolves attacker.test
        executable_path=CHROMIUM, headless=True, args=[*ARGS, "--host-resolver-rules=MAP attacker.test 127.0.0.1"]
    )
    try:
        page = rebinding.new_page()
        answer = page.goto(f"http://attacker.test:{plain.port}/", wait_until="domcontentloaded")
        assert answer is not None and answer.status == 403
        assert "--allowed-hosts attacker.test" in page.inner_text("body")
        status, _, text = page.evaluate(fetch).partition(" ")
        assert status == "403" and "host_not_allowed" in text
        answer = page.goto(f"http://attacker.test:{declared.port}/", wait_until="domcontentloaded")
        assert answer is not None and answer.status == 200  # the web UI, by its declared name
        status, _, text = page.evaluate(fetch).partition(" ")
        assert status == "200", text  # same-origin by that name: the page's own API calls work
    finally:
        rebinding.close()
    assert "Refused GET /" in plain.log()
