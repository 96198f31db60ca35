"""Ollama's API (/api/*), driven with the official ollama client against a live server and the real default model."""

from __future__ import annotations

import json
import math
from pathlib import Path

import httpx
import ollama
import pytest
from fastapi import FastAPI
from pydantic import BaseModel

from tests.conftest import DEFAULT_MODEL, ROOT

SYSTEM = {"role": "system", "content": "You are a helpful AI assistant."}
CAPITAL = [SYSTEM, {"role": "user", "content": "What is the capital of France?"}]
GREEDY = {"temperature": 0, "num_predict": 30}
DOC = (Path(__file__).resolve().parents[2] / "docs" / "api.md").read_text()


@pytest.fixture(scope="module")
def client(shared_server) -> ollama.Client:
    return ollama.Client(host=shared_server.url, timeout=120)


def test_tags_show_ps_and_version(client: ollama.Client, shared_server) -> None:
    listed = client.list().models
    assert listed[0].model == DEFAULT_MODEL  # the loaded model first
    assert listed[0].details.format == "gguf" and listed[0].details.quantization_level == "Q4_1"
    assert listed[0].size == (ROOT / "models" / DEFAULT_MODEL).resolve().stat().st_size
    assert "all-MiniLM-L6-v2" in [m.model for m in listed]
    shown = client.show(DEFAULT_MODEL + ":latest")  # the tag Ollama clients add is ignored
    running = client.ps().models
    assert [m.model for m in running] == [DEFAULT_MODEL]
    context = running[0].context_length
    assert context and shown.modelinfo["llama.context_length"] == context  # the context it runs with
    assert shown.modelinfo["general.architecture"] == "llama" and shown.details.family == "llama"
    assert shown.details.parameter_size == "134.52M" and "completion" in (shown.capabilities or [])
    assert "messages" in (shown.template or "")
    assert client.show("all-MiniLM-L6-v2").capabilities == ["embedding"]
    major, minor, _ = (int(p) for p in httpx.get(shared_server.url + "/api/version").json()["version"].split("."))
    assert (major, minor) >= (0, 6)  # clients such as GitHub Copilot refuse servers older than 0.6.4
    with pytest.raises(ollama.ResponseError) as info:
        client.show("no-such-model")
    assert info.value.status_code == 404 and "no-such-model" in info.value.error


def test_chat_streamed_and_not(client: ollama.Client) -> None:
    reply = client.chat(model=DEFAULT_MODEL, messages=CAPITAL, options=GREEDY, stream=False)
    assert "Paris" in (reply.message.content or "") and reply.message.role == "assistant"
    assert reply.done and reply.done_reason == "stop" and reply.model == DEFAULT_MODEL
    assert reply.prompt_eval_count and reply.prompt_eval_count > 10 and reply.eval_count and reply.eval_count > 0
    for duration in (reply.total_duration, reply.prompt_eval_duration, reply.eval_duration):
        assert duration and duration > 1000  # nanoseconds
    parts = list(client.chat(model=DEFAULT_MODEL, messages=CAPITAL, options=GREEDY, stream=True))
    assert [p.done for p in parts] == [False] * (len(parts) - 1) + [True] and len(parts) >= 3  # 2+ pieces, then done
    assert "".join(p.message.content or "" for p in parts) == reply.message.content
    assert parts[-1].eval_count == reply.eval_count and parts[-1].done_reason == "stop"


def test_options_map_onto_sampling(client: ollama.Client) -> None:
    short = client.chat(model="m", messages=CAPITAL, options={"temperature": 0, "num_predict": 3})
    assert short.eval_count == 3 and short.done_reason == "length"
    stopped = client.chat(model="m", messages=CAPITAL, options={**GREEDY, "stop": ["Paris"]})
    assert "Paris" not in (stopped.message.content or "") and stopped.done_reason == "stop"
    seeded = [
        client.chat(
            model="m", messages=CAPITAL, options={"seed": 7, "temperature": 1.5, "top_k": 50, "num_predict": 12}
        )
        for _ in range(2)
    ]
    assert seeded[0].message.content == seeded[1].message.content  # the same seed, the same reply
    penalised = client.chat(model="m", messages=CAPITAL, options={**GREEDY, "repeat_penalty": 1.3, "min_p": 0.05})
    assert penalised.message.content  # honoured, not refused, on the llama.cpp backend


def test_generate_templated_raw_and_streamed(client: ollama.Client) -> None:
    templated = client.generate(
        model="m", system=SYSTEM["content"], prompt="What is the capital of France?", options=GREEDY
    )
    assert "Paris" in templated.response and templated.done_reason == "stop"
    raw = client.generate(model="m", prompt="The capital of France is", raw=True, options={**GREEDY, "num_predict": 4})
    assert (
        raw.response.strip().startswith("Paris")
        and 0 < (raw.prompt_eval_count or 0) < 10
        and raw.done_reason == "length"
    )
    parts = list(
        client.generate(
            model="m", prompt="The capital of France is", raw=True, options={**GREEDY, "num_predict": 4}, stream=True
        )
    )
    assert "".join(p.response for p in parts) == raw.response and parts[-1].done


class City(BaseModel):
    city: str
    population: int


def test_format_schema_and_json(client: ollama.Client) -> None:
    messages = [SYSTEM, {"role": "user", "content": "Describe a city."}]
    reply = client.chat(
        model="m", messages=messages, format=City.model_json_schema(), options={**GREEDY, "num_predict": 60}
    )
    assert City.model_validate_json(reply.message.content or "").city
    free = client.generate(
        model="m", prompt="Describe a city as JSON.", format="json", options={**GREEDY, "num_predict": 60}
    )
    assert isinstance(json.loads(free.response), dict)


def test_embed_and_the_older_embeddings(client: ollama.Client) -> None:
    result = client.embed(model="all-minilm", input=["a cat", "a kitten", "a truck"])
    cat, kitten, truck = result.embeddings
    assert len(cat) == 384 and result.prompt_eval_count and result.prompt_eval_count > 3

    def cosine(a: list[float], b: list[float]) -> float:
        return sum(x * y for x, y in zip(a, b, strict=True)) / math.sqrt(sum(x * x for x in a) * sum(y * y for y in b))

    assert cosine(cat, kitten) > cosine(cat, truck)
    assert client.embeddings(model="all-minilm", prompt="a cat").embedding == pytest.approx(cat, abs=1e-5)


def test_a_tool_result_turn_is_answered_from_the_result(client: ollama.Client) -> None:
    tool = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the current weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
    messages = [
        SYSTEM,
        {"role": "user", "content": "What is the weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}],
        },
        {"role": "tool", "tool_name": "get_weather", "content": "Snowing, -3 degrees"},
    ]
    reply = client.chat(model="m", messages=messages, tools=[tool], options={**GREEDY, "num_predict": 40})
    assert "-3" in (reply.message.content or "")


@pytest.mark.parametrize(
    ("method", "path", "body", "status", "says"),
    [
        (
            "POST",
            "/api/chat",
            {"model": "m", "messages": [{"role": "user", "content": "hi"}], "options": {"num_predict": "x"}},
            400,
            "num_predict",
        ),
        (
            "POST",
            "/api/chat",
            {"model": "m", "messages": [{"role": "user", "content": "hi"}], "options": {"temperature": 9}},
            400,
            "options.temperature",
        ),
        (
            "POST",
            "/api/chat",
            {"model": "m", "messages": [{"role": "user", "content": "hi", "images": ["iVBORw0KGgo="]}]},
            400,
            "cannot see images",
        ),
        (
            "POST",
            "/api/chat",
            {"model": "m", "messages": [{"role": "user", "content": "hi"}], "think": True},
            400,
            "thinking",
        ),
        (
            "POST",
            "/api/chat",
            {"model": "m", "messages": [{"role": "user", "content": "hi"}], "format": "yaml"},
            400,
            "format",
        ),
        ("POST", "/api/chat", {"messages": [{"role": "user", "content": "hi"}]}, 400, "model"),
        ("POST", "/api/chat", {"model": "m", "messages": [{"role": "robot", "content": "hi"}]}, 400, "role"),
        ("POST", "/api/generate", {"model": "m", "prompt": "hi", "template": "{{ .Prompt }}"}, 400, "template"),
        ("POST", "/api/generate", {"model": "m", "prompt": "x", "raw": True, "system": "s"}, 400, "raw"),
        ("POST", "/api/embed", {"model": "m", "input": 5}, 400, "input"),
        ("POST", "/api/show", {}, 400, "model is required"),
        ("GET", "/api/chat", None, 405, "POST"),
        ("POST", "/api/pull", {"model": "llama3"}, 404, "models/"),
    ],
)
def test_client_mistakes_are_ollama_shaped_4xx(
    shared_server, method: str, path: str, body, status: int, says: str
) -> None:
    response = httpx.request(method, shared_server.url + path, json=body, timeout=60)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert isinstance(error, str) and says in error


def test_bodies_without_a_content_type_load_requests_and_ndjson(shared_server) -> None:
    url = shared_server.url
    body = json.dumps({"model": "m", "messages": CAPITAL, "options": GREEDY})
    with httpx.stream("POST", url + "/api/chat", content=body, timeout=60) as response:  # as Ollama's curl examples
        assert response.headers["content-type"] == "application/x-ndjson"
        lines = [json.loads(line) for line in response.iter_lines() if line]
    assert lines[-1]["done"] and "Paris" in "".join(line["message"]["content"] for line in lines)
    for kind in (None, "text/plain"):  # fetch(url, {mode: "no-cors", body: blob}) sends none; a text body text/plain
        other_site = {"Origin": "http://evil.example", **({"Content-Type": kind} if kind else {})}
        refused = httpx.post(url + "/api/generate", content=json.dumps({"model": DEFAULT_MODEL}), headers=other_site)
        assert refused.request.headers.get("content-type") == kind
        assert refused.status_code == 403, kind  # refused before it is read: run, it would load (or unload) a model
    loaded = httpx.post(url + "/api/chat", json={"model": DEFAULT_MODEL, "messages": []}, timeout=60).json()
    assert loaded["done"] and loaded["done_reason"] == "load"
    assert httpx.post(url + "/api/generate", json={"model": DEFAULT_MODEL}, timeout=60).json()["done_reason"] == "load"


def test_the_api_key_protects_the_ollama_routes(live_server_factory, tmp_path: Path) -> None:
    server = live_server_factory(
        "--api-key", "sk-test", "--model", "none", "--user-data-dir", str(tmp_path / "ud"), want_model=False
    )
    for path in ("/api/tags", "/api/version", "/api/ps"):
        refused = httpx.get(server.url + path)
        assert refused.status_code == 401 and isinstance(refused.json()["error"], str), path
    with pytest.raises(ollama.ResponseError) as info:
        ollama.Client(host=server.url).chat(model="m", messages=CAPITAL)
    assert info.value.status_code == 401
    keyed = ollama.Client(host=server.url, headers={"Authorization": "Bearer sk-test"})
    assert DEFAULT_MODEL in [m.model for m in keyed.list().models]
    with pytest.raises(ollama.ResponseError) as info:
        keyed.chat(model="gpt-4o", messages=CAPITAL)  # authorised, but no model is loaded
    assert info.value.status_code == 503


def test_every_ollama_route_is_documented() -> None:
    from extensions.openai.routes import install

    app = FastAPI()
    install(app)
    paths = {p for p in app.openapi()["paths"] if p.startswith("/api/")}
    assert len(paths) == 8
    for path in paths:
        assert f"`{path}`" in DOC or f" {path}" in DOC, path
