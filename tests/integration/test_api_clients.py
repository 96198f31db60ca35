"""The API as real clients use it: the loaded model first in /v1/models, Anthropic's count_tokens, instructor and
response_format's json_object with a schema, streamed logprobs as llama.cpp's server test reads them, CORS
preflights. Live servers, the real default model."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anthropic
import httpx
import instructor
import jsonschema
import openai
import pytest
from pydantic import BaseModel

from tests.conftest import DEFAULT_MODEL, default_model_path

SYSTEM = "You are a helpful AI assistant."
CAPITAL = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is the capital of France?"}]
CITY_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "population": {"type": "integer", "minimum": 0}},
    "required": ["city", "population"],
    "additionalProperties": False,
}
PREFLIGHT = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization,content-type"}


@pytest.fixture(scope="module")
def client(shared_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=shared_server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_models_list_puts_the_loaded_model_first_and_marks_it(live_server_factory, tmp_path: Path) -> None:
    models = tmp_path / "models"
    models.mkdir()
    (models / DEFAULT_MODEL).symlink_to(default_model_path())
    (models / "aaa-sorts-first.gguf").write_bytes(b"GGUF" + b"\x00" * 64)  # listed, never loaded
    server = live_server_factory(
        "--model-dir", str(models), "--model", DEFAULT_MODEL, "--user-data-dir", str(tmp_path / "ud")
    )
    data = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0).models.list().data
    assert [m.id for m in data] == [DEFAULT_MODEL, "aaa-sorts-first.gguf", "all-MiniLM-L6-v2"]
    assert [getattr(m, "loaded", None) for m in data] == [True, False, None]
    assert data[0].object == "model" and data[0].owned_by == "textgen"  # OpenAI's shape otherwise


def test_anthropic_count_tokens_equals_the_input_tokens_of_create(shared_server) -> None:
    claude = anthropic.Anthropic(base_url=shared_server.url, api_key="unused", max_retries=0, timeout=120)
    weather = {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    }
    turns = [
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": [{"type": "text", "text": "And of Italy?"}]},
    ]
    requests: list[dict[str, Any]] = [
        {"messages": turns[:1]},
        {"system": SYSTEM, "messages": turns},
        {"system": SYSTEM, "messages": turns[:1], "tools": [weather]},
    ]
    counts = []
    for body in requests:
        counted = claude.messages.count_tokens(model="claude-x", **body).input_tokens
        created = claude.messages.create(model="claude-x", max_tokens=5, **body)
        assert counted == created.usage.input_tokens, body
        counts.append(counted)
    assert counts[0] < counts[1] and counts[0] < counts[2]  # the system prompt, the turns and the tools count
    with pytest.raises(anthropic.BadRequestError) as info:
        claude.messages.count_tokens(model="claude-x", messages=[])
    assert info.value.body["type"] == "error" and info.value.body["error"]["type"] == "invalid_request_error"


def test_json_object_with_a_schema_is_constrained_to_the_schema(client: openai.OpenAI) -> None:
    """llama-cpp-python's and Together's form: without the schema a 135M model writes free JSON and never closes it."""
    reply = client.chat.completions.create(
        model="m",
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Describe a city."}],
        response_format={"type": "json_object", "schema": CITY_SCHEMA},  # type: ignore[typeddict-unknown-key]
        temperature=0,
        max_tokens=60,
    )
    assert reply.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(reply.choices[0].message.content or ""), CITY_SCHEMA)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model="m",
            messages=CAPITAL,
            response_format={"type": "json_object", "schema": {"type": "nope"}},  # type: ignore[typeddict-unknown-key]
        )
    assert info.value.body["param"] == "response_format.schema"


class City(BaseModel):
    city: str
    population: int


def test_instructor_json_schema_mode_gets_a_valid_object(shared_server) -> None:
    sent: list[dict[str, Any]] = []

    def record(request: httpx.Request) -> None:
        sent.append(json.loads(request.content))

    http = httpx.Client(event_hooks={"request": [record]}, timeout=120)
    raw = openai.OpenAI(base_url=shared_server.url + "/v1", api_key="unused", max_retries=0, http_client=http)
    patched = instructor.from_openai(raw, mode=instructor.Mode.JSON_SCHEMA)
    city = patched.chat.completions.create(
        model="m",
        response_model=City,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Describe Paris."}],
        max_tokens=60,
        temperature=0,
        max_retries=0,
    )
    assert isinstance(city, City) and city.city
    fmt = sent[0]["response_format"]  # instructor 1.17 sends json_schema; older ones json_object with a schema
    assert (fmt.get("json_schema") or fmt)["schema"]["required"] == ["city", "population"]


def test_streamed_logprobs_every_chunk_before_the_last_has_a_list(client: openai.OpenAI) -> None:
    """llama.cpp's server test_logprobs_stream, which reads choice.logprobs.content on every chunk."""
    chunks = list(
        client.chat.completions.create(
            model="m", messages=CAPITAL, temperature=0, max_tokens=5, logprobs=True, top_logprobs=3, stream=True
        )
    )
    first = chunks[0].choices[0]
    assert first.delta.role == "assistant" and first.logprobs is not None and first.logprobs.content == []
    text = tokens = ""
    for chunk in chunks:
        choice = chunk.choices[0]
        if choice.finish_reason is None:
            text += choice.delta.content or ""
            assert choice.logprobs is not None and choice.logprobs.content is not None
            for token in choice.logprobs.content:
                tokens += token.token
                assert token.logprob <= 0 and token.bytes is not None and len(token.top_logprobs) == 3
    assert text and tokens == text


def test_cors_preflight_grants_only_the_configured_origins(live_server_factory, tmp_path: Path) -> None:
    server = live_server_factory(
        "--api-cors-origins",
        "http://app.example",
        "--api-key",
        "sk-test",
        "--model",
        "none",
        "--user-data-dir",
        str(tmp_path / "ud"),
        want_model=False,
    )
    for path in ("/v1/chat/completions", "/v1/messages/count_tokens", "/api/chat"):
        granted = httpx.options(server.url + path, headers={"Origin": "http://app.example", **PREFLIGHT})
        assert granted.status_code == 200, path  # no API key on a preflight: browsers never send one
        assert granted.headers["access-control-allow-origin"] == "http://app.example"
        assert "authorization" in granted.headers["access-control-allow-headers"].lower()
        refused = httpx.options(server.url + path, headers={"Origin": "http://evil.example", **PREFLIGHT})
        assert refused.status_code == 403 and "access-control-allow-origin" not in refused.headers, path
        assert "http://evil.example" in refused.text and "--api-cors-origins" in refused.text
    allowed = httpx.get(
        server.url + "/v1/models", headers={"Origin": "http://app.example", "Authorization": "Bearer sk-test"}
    )
    assert allowed.status_code == 200 and allowed.headers["access-control-allow-origin"] == "http://app.example"


def test_cors_preflight_without_configured_origins_is_refused_clearly(shared_server) -> None:
    headers = {"Origin": "http://app.example", **PREFLIGHT}
    refused = httpx.options(shared_server.url + "/v1/chat/completions", headers=headers)
    assert refused.status_code == 403 and not any(h.startswith("access-control-") for h in refused.headers)
    error = refused.json()["error"]
    assert error["code"] == "cors_origin_not_allowed" and "--api-cors-origins http://app.example" in error["message"]
    ollama_shaped = httpx.options(shared_server.url + "/api/tags", headers=headers)
    assert ollama_shaped.status_code == 403 and isinstance(ollama_shaped.json()["error"], str)
    assert httpx.get(shared_server.url + "/v1/models").status_code == 200  # same-origin and non-browser calls
