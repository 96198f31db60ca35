"""Through the API on a live server: a load that cannot succeed here is refused with an error object and the model
that was loaded keeps answering; an out-of-memory load says the old model is gone and the server goes on; stale temp
files of interrupted writes are gone after startup."""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import DEFAULT_MODEL, ROOT, LiveServer, default_model_path

OOM_EXTENSION = """
from modules.loaders.base import Backend


class OutOfMemory(Backend):
    loader_name = "fake-oom"

    @classmethod
    def load(cls, path, options):
        raise MemoryError()


def register_backends(register):
    register("fake-oom", OutOfMemory)
"""
CAPITAL = [
    {"role": "system", "content": "You are a helpful AI assistant."},
    {"role": "user", "content": "What is the capital of France?"},
]
STALE = "logs/chat/Assistant/.20260101-00-00-00.json.k3x9_q2a.tmp"
FRESH = "logs/chat/Assistant/.20260101-00-00-01.json.b7m2zz0q.tmp"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """A server with the default model, a truncated copy of it, an out-of-memory loader and stale temp files."""
    tmp = tmp_path_factory.mktemp("load-safety")
    models = tmp / "models"
    models.mkdir()
    (models / DEFAULT_MODEL).symlink_to(default_model_path())
    with open(default_model_path(), "rb") as source, open(models / "cut.gguf", "wb") as cut:
        cut.write(source.read(4 * 2**20))  # the first 4 MiB: the whole header, a fraction of the tensors
    user_data = tmp / "user_data"
    shutil.copytree(ROOT / "user_data", user_data, ignore=shutil.ignore_patterns("logs", "settings.yaml"))
    (user_data / "extensions" / "fakeoom").mkdir(parents=True)
    (user_data / "extensions" / "fakeoom" / "script.py").write_text(OOM_EXTENSION)
    stale_card = models / ".README.md.a1b2c3d4.tmp"  # an interrupted model card write (export, publish)
    for path, age in ((user_data / STALE, 3600), (user_data / FRESH, 0), (stale_card, 3600)):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text('{"half": ')
        past = time.time() - age
        os.utime(path, (past, past))
    args = ["--model", DEFAULT_MODEL, "--model-dir", str(models), "--user-data-dir", str(user_data), "--nowebui"]
    live = LiveServer([*args, "--extensions", "fakeoom"], tmp)
    live.user_data = user_data  # type: ignore[attr-defined]
    try:
        live.wait_ready()
        yield live
    finally:
        live.stop()


def load(server: LiveServer, name: str, **args: object) -> httpx.Response:
    return httpx.post(server.url + "/v1/internal/model/load", json={"model_name": name, "args": args}, timeout=120)


def assert_still_answering(server: LiveServer) -> None:
    """The default model is loaded and answers a chat request."""
    assert httpx.get(server.url + "/v1/internal/model/info").json()["model_name"] == DEFAULT_MODEL
    reply = httpx.post(
        server.url + "/v1/chat/completions",
        json={"model": "m", "messages": CAPITAL, "temperature": 0, "max_tokens": 30},
        timeout=60,
    )
    assert reply.status_code == 200 and "Paris" in reply.json()["choices"][0]["message"]["content"]
    assert httpx.get(server.url + "/health").json()["status"] == "ok"


def test_stale_temp_files_are_gone_after_startup(server: LiveServer) -> None:
    user_data: Path = server.user_data  # type: ignore[attr-defined]
    assert not (user_data / STALE).exists()
    assert (user_data / FRESH).exists()  # a write that may still be running is left alone
    assert not list(Path(server.user_data).parent.joinpath("models").glob(".README.md.*.tmp"))  # models/ swept too
    assert (user_data / "presets").is_dir() and any((user_data / "presets").iterdir())


def test_exllamav2_without_cuda_is_refused_and_the_model_keeps_answering(server: LiveServer) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    refused = load(server, DEFAULT_MODEL, loader="exllamav2")
    assert refused.status_code in (400, 503), refused.text
    error = refused.json()["error"]
    assert error["code"] == "model_load_failed" and "exllamav2" in error["message"].lower()
    assert "CUDA" in error["message"] or "pip install exllamav2" in error["message"]
    assert_still_answering(server)


def test_a_truncated_gguf_is_refused_and_the_model_keeps_answering(server: LiveServer) -> None:
    refused = load(server, "cut.gguf")
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert error["code"] == "model_load_failed"
    assert "cut.gguf is truncated" in error["message"]
    assert_still_answering(server)


def test_out_of_memory_says_the_old_model_is_gone_and_the_server_goes_on(server: LiveServer) -> None:
    failed = load(server, DEFAULT_MODEL, loader="fake-oom")
    assert failed.status_code == 400, failed.text
    message = failed.json()["error"]["message"]
    assert message.startswith(f"not enough memory to load {DEFAULT_MODEL} with fake-oom")
    assert f"{DEFAULT_MODEL} was unloaded to make room for it, so no model is loaded now" in message
    health = httpx.get(server.url + "/health")
    assert health.status_code == 503 and health.json()["error"] == message
    assert load(server, DEFAULT_MODEL).status_code == 200
    assert_still_answering(server)
