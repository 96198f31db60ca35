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
