"""API keys, admin endpoints, model load/unload, 503s, disconnects, CORS, Responses, Messages and internal API."""

from __future__ import annotations

import json
import shutil
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.conftest import DEFAULT_MODEL, default_model_path

CAPITAL = [
    {"role": "system", "content": "You are a helpful AI assistant."},
    {"role": "user", "content": "What is the capital of France?"},
]


def test_api_key_and_admin_key(live_server_factory, tmp_path: Path) -> None:
    server = live_server_factory(
        "--api-key", "sk-user", "--admin-key", "sk-admin", "--user-data-dir", str(tmp_path / "ud")
    )
    url = server.url
    assert httpx.get(url + "/health").status_code == 200  # public
    no_key = httpx.get(url + "/v1/models")
    assert no_key.status_code == 401 and no_key.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(url + "/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert httpx.get(url + "/v1/models", headers={"Authorization": "Bearer sk-user"}).status_code == 200
    assert httpx.get(url + "/v1/models", headers={"x-api-key": "sk-user"}).status_code == 200
    user = openai.OpenAI(base_url=url + "/v1", api_key="sk-user", max_retries=0)
    assert (
        "Paris"
        in user.chat.completions.create(model="m", messages=CAPITAL, temperature=0, max_tokens=30)
        .choices[0]
        .message.content
    )
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url + "/v1", api_key="nope", max_retries=0).models.list()
    forbidden = httpx.post(url + "/v1/internal/model/unload", headers={"Authorization": "Bearer sk-user"})
    assert forbidden.status_code == 403 and forbidden.json()["error"]["type"] == "permission_error"
    assert httpx.post(url + "/v1/internal/model/unload").status_code == 401
    assert (
        httpx.post(url + "/v1/internal/model/unload", headers={"Authorization": "Bearer sk-admin"}).status_code == 200
    )
    metrics = httpx.get(url + "/metrics", headers={"x-api-key": "sk-user"}).text
    assert 'textgen_requests_total{endpoint="/models",status="401"}' in metrics


def test_model_load_unload_and_503_without_a_model(live_server_factory, tmp_path: Path) -> None:
    models = tmp_path / "models"
    models.mkdir()
    (models / DEFAULT_MODEL).symlink_to(default_model_path())
    (models / "broken.gguf").write_bytes(b"GGUF" + b"\x00" * 64)
    server = live_server_factory(
        "--model", "none", "--model-dir", str(models), "--user-data-dir", str(tmp_path / "ud"), want_model=False
    )
    url = server.url
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    assert httpx.get(url + "/health").status_code == 503
    with pytest.raises(openai.InternalServerError) as info:
        client.chat.completions.create(model="gpt-4o", messages=CAPITAL)
    assert info.value.status_code == 503 and info.value.body["code"] == "model_not_loaded"
    assert httpx.post(url + "/v1/internal/model/load", json={"model_name": "nope.gguf"}).status_code == 404
    broken = httpx.post(url + "/v1/internal/model/load", json={"model_name": "broken.gguf"})
    assert broken.status_code == 400 and "broken.gguf" in broken.json()["error"]["message"]
    assert httpx.post(url + "/v1/internal/model/load", json={}).status_code == 400
    loaded = httpx.post(
        url + "/v1/internal/model/load", json={"model_name": DEFAULT_MODEL, "args": {"n_ctx": 1024}}, timeout=60
    )
    assert loaded.status_code == 200, loaded.text
    info_body = httpx.get(url + "/v1/internal/model/info").json()
    assert (
        info_body["model_name"] == DEFAULT_MODEL
        and info_body["loader"] == "llama.cpp"
        and info_body["context_length"] == 1024
    )
    assert httpx.get(url + "/v1/internal/model/list").json() == {"model_names": ["broken.gguf", DEFAULT_MODEL]}
    assert (
        "Paris"
        in client.chat.completions.create(model="gpt-4o", messages=CAPITAL, temperature=0, max_tokens=30)
        .choices[0]
        .message.content
    )
    assert httpx.post(url + "/v1/internal/model/unload").status_code == 200
    assert httpx.get(url + "/health").status_code == 503
    # a request naming a local model loads it
    reply = client.chat.completions.create(
        model=DEFAULT_MODEL.removesuffix(".gguf"), messages=CAPITAL, temperature=0, max_tokens=30
    )
    assert "Paris" in reply.choices[0].message.content and httpx.get(url + "/health").status_code == 200


def test_internal_endpoints(shared_server) -> None:
    url = shared_server.url + "/v1/internal"
    encoded = httpx.post(url + "/encode", json={"text": "Hello world"}).json()
    assert encoded["length"] == len(encoded["tokens"]) > 0
    assert httpx.post(url + "/decode", json={"tokens": encoded["tokens"]}).json() == {"text": "Hello world"}
    assert httpx.post(url + "/decode", json={"tokens": [10**9]}).status_code == 400
    assert httpx.post(url + "/token-count", json={"text": "Hello world"}).json() == {"length": encoded["length"]}
    logits = httpx.post(url + "/logits", json={"prompt": "The capital of France is", "top_logits": 5}).json()
    assert len(logits) == 5 and 0 < sum(logits.values()) <= 1.0001
    assert max(logits, key=logits.get).strip() == "Paris"
    assert httpx.post(url + "/stop-generation").json() == {"status": "OK", "stopped": 0}
    assert httpx.get(url + "/lora/list").json() == {"lora_names": []}


def test_disconnect_stops_generation(shared_server) -> None:
    body = {
        "messages": [{"role": "user", "content": "Write a very long story."}],
        "max_tokens": 2000,
        "stream": True,
        "ban_eos": True,
    }
    with httpx.stream("POST", shared_server.url + "/v1/chat/completions", json=body, timeout=60) as response:
        for n, _ in enumerate(response.iter_lines()):
            if n > 5:
                break
    busy = _wait_idle(shared_server, 5)
    assert busy.endswith(" 0"), busy
    assert "finish: cancelled" in shared_server.log()


def _wait_idle(server, seconds: float, busy_slots: int = 0) -> str:
    """The /metrics line of busy slots once it shows `busy_slots` (or the last one seen after `seconds`)."""
    deadline = time.monotonic() + seconds
    busy = ""
    while time.monotonic() < deadline:
        metrics = httpx.get(server.url + "/metrics").text
        busy = next(line for line in metrics.splitlines() if line.startswith("textgen_busy_slots"))
        if busy.endswith(f" {busy_slots}"):
            break
        time.sleep(0.1)
    return busy


def test_disconnect_stops_a_non_streaming_generation(shared_server) -> None:
    """A client that gives up on a non-streaming request (while tokens keep coming) stops its generation."""
    before = shared_server.log().count("client disconnected")
    body = {"messages": [{"role": "user", "content": "Write a very long story."}], "max_tokens": 3000, "ban_eos": True}
    with pytest.raises(httpx.TimeoutException):
        httpx.post(shared_server.url + "/v1/chat/completions", json=body, timeout=1.5)
    busy = _wait_idle(shared_server, 5)
    assert busy.endswith(" 0"), busy  # 3000 tokens would take far longer than 5 s here
    time.sleep(0.6)  # a loop that kept polling the gone client would log again
    assert shared_server.log().count("client disconnected") == before + 1


def test_full_queue_answers_503_with_retry_after(live_server_factory, tmp_path: Path) -> None:
    server = live_server_factory("--parallel", "1", "--max-queue", "0", "--user-data-dir", str(tmp_path / "ud"))
    # the first request holds the one slot until the second has been answered (it streams, and hangs up after), and the
    # second goes in only once the first is seen generating: a fixed sleep was too short on a loaded machine and too
    # long on a fast one
    body = {"messages": [{"role": "user", "content": "Write a long story."}], "max_tokens": 3000, "ban_eos": True}
    answered = threading.Event()
    results: list[int] = []

    def first_request() -> None:
        with httpx.stream("POST", server.url + "/v1/chat/completions", json={**body, "stream": True}, timeout=120) as r:
            results.append(r.status_code)
            for _ in r.iter_lines():
                if answered.is_set():
                    break

    first = threading.Thread(target=first_request)
    first.start()
    try:
        assert _wait_idle(server, 60, busy_slots=1).endswith(" 1")
        busy = httpx.post(server.url + "/v1/chat/completions", json={**body, "max_tokens": 5}, timeout=60)
    finally:
        answered.set()
        first.join(60)
    assert results == [200]
    assert busy.status_code == 503 and busy.headers["Retry-After"] == "1"
    assert busy.json()["error"]["code"] == "server_busy"


def test_cors(live_server_factory, tmp_path: Path) -> None:
    server = live_server_factory(
        "--api-cors-origins",
        "http://app.example",
        "--model",
        "none",
        "--user-data-dir",
        str(tmp_path / "ud"),
        want_model=False,
    )
    preflight = httpx.options(
        server.url + "/v1/chat/completions",
        headers={
            "Origin": "http://app.example",
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization,content-type",
        },
    )
    assert preflight.headers.get("access-control-allow-origin") == "http://app.example"
    other = httpx.get(server.url + "/v1/models", headers={"Origin": "http://evil.example"})
    assert "access-control-allow-origin" not in other.headers


def test_responses_api(shared_server) -> None:
    client = openai.OpenAI(base_url=shared_server.url + "/v1", api_key="x", max_retries=0)
    reply = client.responses.create(
        model="m",
        instructions="You are a helpful AI assistant.",
        input="What is the capital of France?",
        temperature=0,
        max_output_tokens=30,
    )
    assert "Paris" in reply.output_text and reply.status == "completed" and reply.usage.output_tokens > 0
    events = list(client.responses.create(model="m", input="Say hello.", max_output_tokens=10, stream=True))
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] in ("response.completed", "response.incomplete")
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas and deltas == events[-1].response.output_text
    tool = {
        "type": "function",
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    }
    called = client.responses.create(
        model="m", input="Weather in Rome?", tools=[tool], tool_choice="required", max_output_tokens=60
    )
    call = next(item for item in called.output if item.type == "function_call")
    assert call.name == "get_weather" and "city" in json.loads(call.arguments)
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model="m", input="hi", previous_response_id="resp_123")


def test_anthropic_messages(shared_server) -> None:
    url = shared_server.url + "/v1/messages"
    body = {
        "model": "claude-x",
        "max_tokens": 30,
        "system": "You are a helpful AI assistant.",
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "temperature": 0,
    }
    reply = httpx.post(url, json=body, timeout=60).json()
    assert reply["type"] == "message" and reply["model"] == "claude-x" and reply["stop_reason"] == "end_turn"
    assert "Paris" in reply["content"][0]["text"] and reply["usage"]["output_tokens"] > 0
    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=60) as response:
        events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: ")]
    assert [e["type"] for e in events][:2] == ["message_start", "content_block_start"] and events[-1][
        "type"
    ] == "message_stop"
    text = "".join(e["delta"]["text"] for e in events if e["type"] == "content_block_delta")
    assert text == reply["content"][0]["text"]
    tool = {
        "name": "get_weather",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    }
    used = httpx.post(
        url, json={**body, "tools": [tool], "tool_choice": {"type": "any"}, "max_tokens": 60}, timeout=60
    ).json()
    assert used["stop_reason"] == "tool_use" and used["content"][-1]["name"] == "get_weather"
    bad = httpx.post(url, json={"model": "x", "messages": []}, timeout=60)
    assert (
        bad.status_code == 400
        and bad.json()["type"] == "error"
        and bad.json()["error"]["type"] == "invalid_request_error"
    )
    prefill = httpx.post(
        url,
        json={**body, "messages": [*body["messages"], {"role": "assistant", "content": "The capital of France is"}]},
        timeout=60,
    ).json()
    assert "Paris" in prefill["content"][0]["text"]


# ------------------------------------------------------------------ security: admin key, settings, stop, images
def _app_with(flags: list[str], user_data: Path, models_dir: Path, exts: tuple[str, ...] = ("openai",)):  # type: ignore[no-untyped-def]
    """The API in-process (no web UI) with these flags, as server.py would start it."""
    from fastapi.testclient import TestClient

    from modules import extensions, shared
    from modules.settings import load_settings
    from server import create_app

    base = ["--user-data-dir", str(user_data), "--model-dir", str(models_dir), "--model", "none", "--nowebui"]
    shared.init(load_settings([*base, *flags], env={}))
    extensions.load_extensions(list(exts))
    return TestClient(create_app(), base_url="http://127.0.0.1")


USER = {"Authorization": "Bearer sk-user"}
ADMIN = {"Authorization": "Bearer sk-admin"}


def test_the_api_key_alone_grants_no_admin_work(
    hub: object, user_data: Path, with_default_model: Path, models_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level("WARNING", logger="extensions.openai.auth"):
        client = _app_with(["--api-key", "sk-user"], user_data, models_dir)
    assert caplog.text.count("--api-key is set without --admin-key") == 1  # said once, at startup
    for path, body in (
        ("/v1/internal/model/load", {"model_name": DEFAULT_MODEL}),
        ("/v1/internal/model/unload", None),
        ("/v1/internal/lora/load", {"lora_names": ["x"]}),
        ("/v1/internal/model/download", {"repo": "org/x"}),
    ):
        refused = client.post(path, json=body, headers=USER)
        assert refused.status_code == 403, path
        error = refused.json()["error"]
        assert error["type"] == "permission_error" and error["code"] == "admin_key_not_set"
        assert "--admin-key" in error["message"], path
    switch = client.post("/v1/chat/completions", json={"model": DEFAULT_MODEL, "messages": CAPITAL}, headers=USER)
    assert switch.status_code == 403 and switch.json()["error"]["param"] == "model"  # no load through `model`
    assert client.get("/v1/internal/model/list", headers=USER).status_code == 200  # ordinary endpoints work


def test_without_any_key_admin_endpoints_stay_open(hub: object, user_data: Path, models_dir: Path) -> None:
    client = _app_with([], user_data, models_dir)
    assert client.post("/v1/internal/model/unload").status_code == 200
    assert client.post("/v1/internal/stop-generation").json() == {"status": "OK", "stopped": 0}


MARKER_CODE = """
from pathlib import Path
Path(MARKER).write_text("the model's own Python ran")  # transformers runs a copy elsewhere: an absolute path
from transformers import LlamaConfig, LlamaForCausalLM
class MarkerConfig(LlamaConfig):
    model_type = "llama"
class MarkerModel(LlamaForCausalLM):
    config_class = MarkerConfig
"""


def test_a_model_folder_cannot_make_the_load_route_trust_its_code(
    hub: object, user_data: Path, models_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A downloaded folder whose textgen.yaml says trust_remote_code: true loads without running its code; a load
    request asking for trust_remote_code is a 400 naming the field."""
    from modules import shared
    from tests.conftest import hf_default_model
    from tests.fixtures.tiny_hf import build_tiny_llama

    folder = build_tiny_llama(models_dir / "shipped-code", hf_default_model())
    config = json.loads((folder / "config.json").read_text())
    config["auto_map"] = {"AutoConfig": "marker.MarkerConfig", "AutoModelForCausalLM": "marker.MarkerModel"}
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "marker.py").write_text(f"MARKER = {str(folder / 'REMOTE_CODE_RAN')!r}\n" + MARKER_CODE)
    (folder / "textgen.yaml").write_text("trust_remote_code: true\nn_ctx: 512\n")
    client = _app_with(["--admin-key", "sk-admin"], user_data, models_dir)

    with caplog.at_level("WARNING", logger="modules.models_settings"):
        loaded = client.post("/v1/internal/model/load", json={"model_name": "shipped-code"}, headers=ADMIN)
    assert loaded.status_code == 200, loaded.text
    assert not (folder / "REMOTE_CODE_RAN").exists()  # the model's Python never ran
    assert shared.model_options["trust_remote_code"] is False and shared.model_options["n_ctx"] == 512
    assert "textgen.yaml: trust_remote_code ignored" in caplog.text
    info = client.get("/v1/internal/model/info", headers=ADMIN).json()
    assert info["model_name"] == "shipped-code" and info["loader"] == "transformers"

    for args in ({"trust_remote_code": True}, {"n_ctx": 256, "remote_url": "http://x"}, {"model_dir": "/"}):
        refused = client.post(
            "/v1/internal/model/load", json={"model_name": "shipped-code", "args": args}, headers=ADMIN
        )
        key = next(k for k in args if k != "n_ctx")
        assert refused.status_code == 400, refused.text
        assert refused.json()["error"]["param"] == f"args.{key}" and key in refused.json()["error"]["message"]
    refused = client.post(
        "/v1/internal/model/load", json={"model_name": "shipped-code", "settings": {"api_key": "x"}}, headers=ADMIN
    )
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "settings.api_key"
    assert shared.model_name == "shipped-code" and not (folder / "REMOTE_CODE_RAN").exists()  # nothing unloaded


def _stream(url: str, headers: dict[str, str], seen: list[str], done: threading.Event) -> None:
    body = {"messages": [{"role": "user", "content": "Write a very long story."}], "max_tokens": 3000,
            "stream": True, "ban_eos": True}  # fmt: skip
    try:
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, headers=headers, timeout=120) as reply:
            for line in reply.iter_lines():
                if line.startswith("data: {"):
                    seen.append(line)
    finally:
        done.set()


def _wait(predicate, seconds: float) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def test_stop_generation_stops_only_the_callers_own(live_server_factory, tmp_path: Path) -> None:
    """Two streams with different keys: the API-key holder's stop ends only its own; the admin key's ends all."""
    server = live_server_factory(
        "--api-key", "sk-user", "--admin-key", "sk-admin", "--user-data-dir", str(tmp_path / "ud")
    )
    url = server.url
    mine: list[str] = []
    theirs: list[str] = []
    mine_done, theirs_done = threading.Event(), threading.Event()
    threads = [
        threading.Thread(target=_stream, args=(url, USER, mine, mine_done), daemon=True),
        threading.Thread(target=_stream, args=(url, ADMIN, theirs, theirs_done), daemon=True),
    ]
    for thread in threads:
        thread.start()
    assert _wait(lambda: len(mine) > 3 and len(theirs) > 3, 60), (len(mine), len(theirs))

    stopped = httpx.post(url + "/v1/internal/stop-generation", headers=USER).json()
    assert stopped == {"status": "OK", "stopped": 1}
    assert mine_done.wait(10) and len(mine) < 3000  # the caller's own stream ended early
    at_stop = len(theirs)
    assert _wait(lambda: len(theirs) > at_stop + 5, 20) and not theirs_done.is_set()  # the other one goes on

    assert httpx.post(url + "/v1/internal/stop-generation", headers=USER).json()["stopped"] == 0
    stopped = httpx.post(url + "/v1/internal/stop-generation", headers=ADMIN).json()
    assert stopped == {"status": "OK", "stopped": 1}
    assert theirs_done.wait(10) and len(theirs) < 3000
    for thread in threads:
        thread.join(5)


def test_image_generation_bounds_and_pipeline_switch(hub: object, user_data: Path, models_dir: Path) -> None:
    from tests.fixtures.tiny_diffusers import build_tiny_pipeline

    build_tiny_pipeline(models_dir / "tiny-a")
    shutil.copytree(models_dir / "tiny-a", models_dir / "tiny-b")
    client = _app_with(
        ["--api-key", "sk-user", "--admin-key", "sk-admin"], user_data, models_dir, ("openai", "image_generation")
    )
    url = "/v1/images/generations"
    body = {"prompt": "a lighthouse", "size": "32x32", "steps": 2, "response_format": "b64_json"}
    for field, value in (
        ("n", 9), ("n", 0), ("n", 1.5), ("n", "many"), ("steps", 151), ("steps", 0), ("size", "2048x512"),
        ("size", "1032x1024"), ("size", 512), ("seed", "x"),
    ):  # fmt: skip
        refused = client.post(url, json={**body, field: value}, headers=USER)
        assert refused.status_code == 400, (field, value, refused.text)
        assert refused.json()["error"]["param"] == field, (field, value)
    assert len(client.post(url, json={**body, "n": 2}, headers=USER).json()["data"]) == 2  # tiny-a, the default
    assert client.post(url, json={**body, "model": "tiny-a"}, headers=USER).status_code == 200  # the one in use
    assert client.post(url, json={**body, "model": "dall-e-3"}, headers=USER).status_code == 200
    switch = client.post(url, json={**body, "model": "tiny-b"}, headers=USER)
    assert switch.status_code == 403 and switch.json()["error"]["param"] == "model"
    assert "--admin-key" in switch.json()["error"]["message"]
    assert client.post(url, json={**body, "model": "no-such"}, headers=USER).status_code == 403
    assert client.post(url, json={**body, "model": "tiny-b"}, headers=ADMIN).status_code == 200
    assert client.post(url, json={**body, "model": "tiny-b"}, headers=USER).status_code == 200  # now in use
    made = client.post(url, json={**body, "response_format": "url"}, headers=USER).json()["data"][0]["url"]
    path = "/v1/images/files/" + made.rsplit("/", 1)[1]
    assert client.get(path).status_code == 401  # the picture needs the key like the request that made it
    assert client.get(path, headers=USER).headers["content-type"] == "image/png"


def test_extension_routes_under_v1_take_the_api_key(hub: object, user_data: Path, models_dir: Path) -> None:
    client = _app_with(["--api-key", "sk-user"], user_data, models_dir, ("openai", "example"))
    assert client.get("/v1/example/hooks").status_code == 401
    assert client.get("/v1/example/hooks", headers=USER).status_code == 200


def test_an_api_open_to_the_network_without_a_key_is_announced(
    hub: object, user_data: Path, models_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """--listen (or a non-loopback --listen-host) and no --api-key: anyone on the LAN may load models; say so."""
    with caplog.at_level("WARNING", logger="extensions.openai.auth"):
        _app_with(["--listen"], user_data, models_dir)
    assert caplog.text.count("with no --api-key: anyone on the network") == 1
    for quiet in (["--listen", "--api-key", "k", "--admin-key", "a"], ["--listen-host", "127.0.0.1"], []):
        caplog.clear()
        with caplog.at_level("WARNING", logger="extensions.openai.auth"):
            _app_with(quiet, user_data, models_dir)
        assert "anyone on the network" not in caplog.text, quiet


def test_embeddings_with_the_loaded_model_tokenize_off_the_event_loop(
    hub: object, user_data: Path, with_default_model: Path, models_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import asyncio

    from modules import models, shared

    client = _app_with([], user_data, models_dir)
    models.load_model(DEFAULT_MODEL)
    backend = shared.model
    assert backend is not None
    on_loop: list[bool] = []
    encode = backend.encode

    def watched(text: str) -> list[int]:
        try:
            asyncio.get_running_loop()
            on_loop.append(True)  # every stream would wait for this
        except RuntimeError:
            on_loop.append(False)
        return encode(text)

    monkeypatch.setattr(backend, "encode", watched)
    answer = client.post("/v1/embeddings", json={"model": DEFAULT_MODEL, "input": ["one text", "another"]})
    assert answer.status_code == 200 and answer.json()["usage"]["prompt_tokens"] > 0
    assert on_loop and not any(on_loop)
