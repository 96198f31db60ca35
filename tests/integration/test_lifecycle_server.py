"""The server and the Hub (on 127.0.0.1): `--model ORG/NAME` downloads on first use, then loads; the admin API runs
downloads as jobs whose progress can be read while they run, cancelled, and resumed."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import DEFAULT_MODEL, default_model_path
from tests.fixtures.fake_hub import FakeHub

ADMIN = {"Authorization": "Bearer sk-admin"}
MiB = 1 << 20


@pytest.fixture
def fake_hub() -> Iterator[FakeHub]:
    server = FakeHub(tokens={"hf_ok": {"org/gated"}}).start()
    server.add_repo("org/smol-GGUF", {DEFAULT_MODEL: default_model_path(), "README.md": b"# smol"})
    server.add_repo("org/slow", {"config.json": b"{}", "model.safetensors": os.urandom(24 * MiB)})
    server.add_repo("org/gated", {"config.json": b"{}", "model.safetensors": os.urandom(4096)}, gated=True)
    # 7 s in all: time to look and cancel (progress may show only after several MiB)
    server.slow[("org/slow", "model.safetensors")] = 0.3
    yield server
    server.stop()


def poll(url: str, until: set[str], timeout: float = 60) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        body = httpx.get(url, headers=ADMIN).json()
        if body["state"] in until:
            return body
        time.sleep(0.2)
    raise TimeoutError(f"{url} stayed {body['state']}")


def test_first_use_download_and_download_jobs(live_server_factory, fake_hub: FakeHub, tmp_path: Path) -> None:
    models = tmp_path / "models"
    env = {"HF_ENDPOINT": fake_hub.url, "HF_HUB_OFFLINE": "0"}
    server = live_server_factory(
        "--model", "org/smol-GGUF", "--model-dir", str(models), "--user-data-dir", str(tmp_path / "ud"),
        "--admin-key", "sk-admin", env=env,
    )  # fmt: skip
    downloaded = models / DEFAULT_MODEL
    assert downloaded.is_file() and not downloaded.is_symlink()
    assert downloaded.stat().st_size == default_model_path().stat().st_size
    info = httpx.get(server.url + "/v1/internal/model/info", headers=ADMIN).json()
    assert info["model_name"] == DEFAULT_MODEL and info["loader"] == "llama.cpp"
    assert "Downloading org/smol-GGUF" in server.log()

    url = server.url + "/v1/internal/model/download"
    assert httpx.post(url, json={"repo": "org/slow"}).status_code == 401
    gated = httpx.post(url, json={"repo": "org/gated"}, headers=ADMIN)
    assert gated.status_code == 403 and gated.json()["error"]["code"] == "gated_repo"
    missing = httpx.post(url, json={"repo": "org/nope"}, headers=ADMIN)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "repo_not_found"
    bad = httpx.post(url, json={"repo": "org/slow", "quant": 4}, headers=ADMIN)
    assert bad.status_code == 400

    started = httpx.post(url, json={"repo": "org/slow"}, headers=ADMIN)
    assert started.status_code == 202, started.text
    job = started.json()
    assert job["name"] == "org_slow" and job["total_bytes"] == 24 * MiB + 2
    progress = server.url + job["progress"]
    deadline = time.monotonic() + 30
    while (running := httpx.get(progress, headers=ADMIN).json())["done"] < MiB and time.monotonic() < deadline:
        time.sleep(0.1)
    assert running["state"] == "running" and 0 < running["done"] < running["total"] == 24 * MiB + 2
    assert running["message"].startswith("model.safetensors")
    same = httpx.post(url, json={"repo": "org/slow"}, headers=ADMIN)
    assert same.status_code == 202 and same.json()["job_id"] == job["job_id"]  # joins the running job
    busy = httpx.post(url, json={"repo": "org/slow", "include": ["config.json"]}, headers=ADMIN)
    assert busy.status_code == 409  # one download at a time
    cancelled = httpx.post(progress + "/cancel", headers=ADMIN).json()
    assert cancelled["state"] == "cancelled"
    assert not (models / "org_slow").exists()

    fake_hub.slow.clear()
    again = httpx.post(url, json={"repo": "org/slow"}, headers=ADMIN).json()
    done = poll(server.url + again["progress"], {"done", "failed"})
    assert done["state"] == "done", done["error"]
    assert (
        done["result"]["name"] == "org_slow" and (models / "org_slow" / "model.safetensors").stat().st_size == 24 * MiB
    )
    gets = fake_hub.file_gets("org/slow", "model.safetensors")
    assert gets[-1]["range_start"] > 0  # the second job went on from where the cancelled one stopped
    assert httpx.get(server.url + "/v1/internal/model/list", headers=ADMIN).json()["model_names"].count("org_slow") == 1
    assert httpx.get(server.url + "/v1/internal/model/download/nope", headers=ADMIN).status_code == 404
