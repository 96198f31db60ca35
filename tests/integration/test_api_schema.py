"""A bounded schemathesis run: requests generated from the server's own OpenAPI document never get a 5xx.

Every operation of the OpenAI, internal, Anthropic and Ollama routes gets a few requests that fit its schema
and a few that do not. Generation lengths are capped in the schema (max_tokens 1..3) and the run has a wall-clock
budget, so it stays well under 90 s on two cores. Each 4xx on an OpenAI route must carry an OpenAI error object,
on the Anthropic routes Anthropic's, on Ollama's Ollama's ``{"error": "..."}``.
"""

from __future__ import annotations

import copy
import json
import time
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode

pytestmark = pytest.mark.slow

BUDGET_S = 45.0  # all operations together; each still gets its first examples after the budget is spent
POSITIVE, NEGATIVE = 10, 5  # examples per operation
TINY = {"type": "integer", "minimum": 1, "maximum": 3}
# Operations left out: they change what every other test sees (load/unload a model) or start background jobs.
LEFT_OUT = {"/v1/internal/model/load", "/v1/internal/model/unload", "/v1/internal/model/download"}

TEXT_PART = {
    "type": "object",
    "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
    "required": ["type", "text"],
}
TOOL_CALL = {
    "type": "object",
    "properties": {
        "id": {"type": "string"},
        "type": {"const": "function"},
        "function": {
            "type": "object",
            "properties": {"name": {"type": "string"}, "arguments": {"type": "string"}},
            "required": ["name", "arguments"],
        },
    },
    "required": ["id", "type", "function"],
}
ANTHROPIC_MESSAGES = {
    "type": "object",
    "properties": {
        "model": {"type": "string"},
        "max_tokens": TINY,
        "messages": {
            "type": "array",
            "minItems": 1,
            "maxItems": 3,
            "items": {
                "type": "object",
                "properties": {"role": {"enum": ["user", "assistant"]}, "content": {"type": "string"}},
                "required": ["role", "content"],
            },
        },
        "system": {"type": "string"},
        "stop_sequences": {"type": "array", "items": {"type": "string"}, "maxItems": 2},
        "temperature": {"type": "number", "minimum": 0, "maximum": 1},
        "top_k": {"type": "integer", "minimum": 0},
        "stream": {"type": "boolean"},
    },
    "required": ["model", "max_tokens", "messages"],
}


def _body(schema: dict[str, Any]) -> dict[str, Any]:
    return {"required": True, "content": {"application/json": {"schema": schema}}}


def bounded(raw: dict[str, Any], model: str) -> dict[str, Any]:
    """The server's document with generation lengths capped, so that every generated request is quick."""
    doc = copy.deepcopy(raw)
    doc["paths"] = {p: v for p, v in doc["paths"].items() if p.startswith(("/v1/", "/api/")) and p not in LEFT_OUT}
    schemas = doc["components"]["schemas"]
    for name in ("ChatCompletionRequest", "CompletionRequest", "ResponsesRequest"):
        props = schemas[name]["properties"]
        length = "max_output_tokens" if name == "ResponsesRequest" else "max_tokens"
        for key in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
            if key in props:
                props[key] = TINY
        for key in ("n", "best_of"):
            if key in props:
                props[key] = {"type": "integer", "minimum": 1, "maximum": 2}
        if "min_tokens" in props:
            props["min_tokens"] = {"type": "integer", "minimum": 0, "maximum": 3}
        schemas[name]["required"] = sorted({*schemas[name].get("required", []), length})
    # typed content parts and tool calls, so that more generated chats get past validation to the model
    message = schemas["ChatMessage"]["properties"]
    message["content"]["anyOf"][1]["items"] = TEXT_PART
    message["tool_calls"]["anyOf"][0]["items"] = TOOL_CALL
    for name in ("ChatRequest", "GenerateRequest", "EmbedRequest", "EmbeddingsRequest"):
        props = schemas[name]["properties"]
        props["model"] = {"enum": [model, "no-such-model"]}
        props.pop("keep_alive", None)  # keep_alive 0 unloads the model (tested in test_ollama_api.py)
        if name in ("ChatRequest", "GenerateRequest"):
            props["options"] = {
                "type": "object",
                "properties": {"num_predict": TINY, "temperature": {"type": "number"}, "seed": {"type": "integer"}},
                "required": ["num_predict"],
            }
            schemas[name]["required"] = ["model", "options"]
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        body = copy.deepcopy(ANTHROPIC_MESSAGES)
        if path.endswith("count_tokens"):
            body["properties"].pop("max_tokens")
            body["required"] = ["model", "messages"]
        doc["paths"][path]["post"]["requestBody"] = _body(body)
    return doc


def error_shape_problem(path: str, response: httpx.Response | Any) -> str | None:
    """What is wrong with a 4xx body for the API family ``path`` belongs to (None: it is right)."""
    try:
        body = response.json()
    except ValueError:
        return f"a {response.status_code} whose body is not JSON: {response.text[:200]!r}"
    if path.startswith("/api/"):
        ok = isinstance(body, dict) and isinstance(body.get("error"), str) and body["error"]
        return None if ok else f"not an Ollama error: {body!r}"
    if path.startswith("/v1/messages"):
        err = body.get("error") if isinstance(body, dict) else None
        ok = body.get("type") == "error" and isinstance(err, dict) and err.get("type") and err.get("message")
        return None if ok else f"not an Anthropic error: {body!r}"
    err = body.get("error") if isinstance(body, dict) else None
    ok = isinstance(err, dict) and isinstance(err.get("message"), str) and err["message"] and err.get("type")
    return None if ok else f"not an OpenAI error object: {body!r}"


def test_generated_requests_never_get_a_5xx(shared_server) -> None:
    raw = httpx.get(shared_server.url + "/openapi.json", timeout=30).json()
    model = httpx.get(shared_server.url + "/v1/models", timeout=30).json()["data"][0]["id"]
    schema = schemathesis.openapi.from_dict(bounded(raw, model))
    problems: list[str] = []
    sent: dict[str, int] = {}
    statuses: dict[int, int] = {}
    started = time.monotonic()
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 25, [op.label for op in operations]

    def fuzz(operation: Any, mode: GenerationMode, examples: int) -> None:
        label = operation.label

        @settings(
            max_examples=examples,
            deadline=None,
            database=None,
            derandomize=True,
            phases=[Phase.generate],
            suppress_health_check=list(HealthCheck),
        )
        @given(case=operation.as_strategy(generation_mode=mode))
        def check(case: Any) -> None:
            if sent.get(label, 0) >= 2 and time.monotonic() - started > BUDGET_S:
                return
            sent[label] = sent.get(label, 0) + 1
            response = case.call(base_url=shared_server.url, timeout=60)
            statuses[response.status_code // 100] = statuses.get(response.status_code // 100, 0) + 1
            request = f"{case.method} {case.formatted_path} body={json.dumps(case.body, default=str)[:400]}"
            if response.status_code >= 500:
                problems.append(f"{response.status_code} for {request}: {response.text[:300]}")
            elif response.status_code >= 400:
                problem = error_shape_problem(case.path, response)
                if problem:
                    problems.append(f"{request}: {problem}")

        try:
            check()
        except Unsatisfiable:  # nothing to make invalid (an operation without parameters or body)
            pass
        except Exception as exc:  # a schema the generator cannot satisfy is a finding too, not a crash
            problems.append(f"{label} ({mode}): {type(exc).__name__}: {exc}"[:400])

    for operation in operations:
        fuzz(operation, GenerationMode.POSITIVE, POSITIVE)
        fuzz(operation, GenerationMode.NEGATIVE, NEGATIVE)

    elapsed = time.monotonic() - started
    tally = ", ".join(f"{k}xx: {v}" for k, v in sorted(statuses.items()))
    print(f"schemathesis: {sum(sent.values())} requests ({tally}) over {len(sent)} operations in {elapsed:.1f} s")
    assert not problems, "\n".join(problems)
    assert len(sent) == len(operations)
    assert statuses.get(2, 0) >= 20 and statuses.get(4, 0) >= 20, statuses  # it generated, and it was refused
    # the server still answers normally after the fuzzing
    reply = httpx.post(
        shared_server.url + "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
        timeout=60,
    )
    assert reply.status_code == 200 and reply.json()["choices"][0]["message"]["role"] == "assistant"
