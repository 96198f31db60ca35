"""The real server process: startup, health, a corrupt startup model, --nowebui."""

from __future__ import annotations

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
