"""The real server process: startup, health, a corrupt startup model, --nowebui."""

from __future__ import annotations

import contextlib
from pathlib import Path

import httpx

from tests.conftest import DEFAULT_MODEL, default_model_path


def test_server_starts_with_the_default_model_and_serves_the_ui(live_server_factory, tmp_path: Path) -> None:
    server = live_server_factory("--user-data-dir", str(tmp_path / "ud"))
    health = httpx.get(server.url + "/health").json()
    assert health == {"status": "ok", "model": DEFAULT_MODEL}
    page = httpx.get(server.url + "/")
    assert page.status_code == 200 and "gradio" in page.text.lower()
    log = server.log()
    assert f"http://127.0.0.1:{server.port}" in log
    assert f"Loaded {DEFAULT_MODEL} with llama.cpp in" in log


def test_corrupt_startup_model_keeps_the_server_up(live_server_factory, tmp_path: Path) -> None:
    models = tmp_path / "models"
    models.mkdir()
    data = default_model_path().read_bytes()
    (models / "broken.gguf").write_bytes(data[:1_000_000])
    server = live_server_factory(
        "--model-dir", str(models), "--model", "broken.gguf", "--user-data-dir", str(tmp_path / "ud"), want_model=False
    )
    response = httpx.get(server.url + "/health")
    for _ in range(50):
        if response.json()["status"] != "loading":
            break
        response = httpx.get(server.url + "/health")
    assert response.status_code == 503
    assert "broken.gguf" in response.json()["error"] and "truncated" in response.json()["error"]
    assert httpx.get(server.url + "/").status_code == 200
    assert "Could not load broken.gguf" in server.log() and "Traceback" not in server.log()


def test_nowebui_serves_no_ui(live_server_factory, tmp_path: Path) -> None:
    server = live_server_factory(
        "--nowebui", "--model", "none", "--user-data-dir", str(tmp_path / "ud"), want_model=False
    )
    assert httpx.get(server.url + "/health").json()["status"] == "no model loaded"
    assert httpx.get(server.url + "/").status_code == 404


def test_killing_the_server_while_it_saves_a_history_leaves_the_file_whole(live_server_factory, tmp_path: Path) -> None:
    """kill -9 the real server at the moment it writes a 4 MB history (its temp file is on disk): the history is
    then the old version or the new one, whole, every time."""
    import json
    import os
    import shutil
    import signal
    import threading
    import time

    from gradio_client import Client, handle_file

    from tests.conftest import ROOT

    user_data = tmp_path / "ud"
    shutil.copytree(ROOT / "user_data" / "characters", user_data / "characters")
    big = tmp_path / "big.json"
    messages = [{"role": ("user", "assistant")[i % 2], "content": f"{i} " + "words " * 3300} for i in range(200)]
    big.write_text(json.dumps({"id": "x", "character": "Assistant", "title": "uploaded", "messages": messages}))
    folder = user_data / "logs" / "default" / "Assistant"
    for attempt in range(3):
        server = live_server_factory("--model", "none", "--user-data-dir", str(user_data), want_model=False)
        client = Client(server.url, verbose=False)
        outputs = client.predict(handle_file(str(big)), "Assistant", api_name="/do_upload")
        conv_id = next(o["value"] for o in outputs if isinstance(o, dict) and "value" in o)
        titles = {"uploaded"}
        worker = threading.Thread(target=_rename_until_gone, args=(server, client, titles), daemon=True)
        worker.start()
        deadline, caught = time.monotonic() + 30, False
        while time.monotonic() < deadline and not caught:
            caught = any(p.name.startswith(f".{conv_id}.json.") for p in os.scandir(folder))
        os.kill(server.proc.pid, signal.SIGKILL)
        server.proc.wait()
        worker.join(timeout=30)
        assert caught, f"attempt {attempt}: never saw the server writing"
        saved = json.loads((folder / f"{conv_id}.json").read_text())  # whole JSON: never half a file
        assert saved["title"] in titles and len(saved["messages"]) == 200
        for other in folder.glob("*.json"):
            json.loads(other.read_text())


def _rename_until_gone(server, client, titles: set[str]) -> None:
    """Rename the session's chat again and again (each rename rewrites the whole file) until the server dies."""
    n = 0
    while server.proc.poll() is None:
        n += 1
        titles.add(f"title {n}")
        try:
            client.predict(f"title {n}", api_name="/do_rename")
        except Exception:
            return


CRASHER = '''
"""Test extension: a native crash (segmentation fault) while a reply is produced."""
import ctypes


def custom_generate_reply(question, original_question, state, stopping_strings, is_chat):
    if "CRASH" not in question:
        return None

    def reply():
        ctypes.string_at(0)  # reads address 0: SIGSEGV, as a crash inside llama.cpp would
        yield ""

    return reply()
'''


def test_a_native_crash_prints_the_stack_and_the_log_names_model_and_request(
    live_server_factory, tmp_path: Path
) -> None:
    user_data = tmp_path / "ud"
    (user_data / "extensions" / "crasher").mkdir(parents=True)
    (user_data / "extensions" / "crasher" / "script.py").write_text(CRASHER)
    server = live_server_factory("--user-data-dir", str(user_data), "--nowebui", "--extensions", "openai", "crasher")
    chat = server.url + "/v1/chat/completions"
    ok = httpx.post(chat, json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}, timeout=60)
    assert ok.status_code == 200
    with contextlib.suppress(httpx.HTTPError):  # the server dies mid-request
        httpx.post(chat, json={"messages": [{"role": "user", "content": "CRASH please"}], "max_tokens": 4}, timeout=60)
    assert server.proc.wait(timeout=30) != 0
    log = server.log()
    assert "Fatal Python error: Segmentation fault" in log and "crasher/script.py" in log  # the stack, to the line
    before = log[: log.index("Fatal Python error")]
    last = before.rstrip().splitlines()[-1]
    assert f"extension reply on {DEFAULT_MODEL} (llama.cpp)" in last, last  # the request that was running
    request_id = last.split("Request ", 1)[1].split(":", 1)[0]
    assert f"Request {request_id}: generated" not in log
    assert f"Loading {DEFAULT_MODEL} with llama.cpp" in log


def test_a_text_generation_webui_launch_line_serves_the_api(live_server_factory, tmp_path: Path) -> None:
    """`python server.py --api --listen --api-port 5000 --n_ctx 2048`, with CMD_FLAGS.txt and --extensions example."""
    from tests.conftest import free_port

    user_data = tmp_path / "ud"
    user_data.mkdir()
    (user_data / "CMD_FLAGS.txt").write_text("--extensions example\n")
    api_port = free_port()
    args = ("--user-data-dir", str(user_data), "--api", "--listen", "--api-port", str(api_port), "--n_ctx", "2048")
    server = live_server_factory(*args)
    api = f"http://127.0.0.1:{api_port}"
    info = httpx.get(api + "/v1/internal/model/info").json()
    assert info["model_name"] == DEFAULT_MODEL and info["context_length"] == 2048
    reply = httpx.post(
        api + "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8},
        timeout=60,
    )
    assert reply.status_code == 200 and reply.json()["choices"][0]["message"]["content"]
    log = server.log()
    assert "Loaded extension example" in log and "Loaded extension openai" in log  # --extensions kept the API
    assert "--api: ignored, the API is on by default" in log and f"http://127.0.0.1:{api_port}" in log


def test_the_idle_ui_queue_does_not_poll_every_millisecond(tiny: Path) -> None:
    """Gradio's queue looked for work every 1 ms while it had none: 6.5% of a core for an idle server on 2 cores.
    If Gradio renames what modules/ui/app.py:quiet_queue sets, the setting silently does nothing: this says so."""
    from modules.ui.app import QUEUE_IDLE_POLL_S, build_ui

    demo = build_ui()
    assert demo._queue.sleep_when_free >= QUEUE_IDLE_POLL_S
