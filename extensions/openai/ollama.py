"""Ollama's API: POST /api/chat, /api/generate, /api/embed and the older /api/embeddings, on the serving code.

A request becomes the same chat job as /v1/chat/completions (templates, tools, structured output, images) or, with
``raw`` or ``suffix`` (fill-in-the-middle), the raw-prompt path of /v1/completions. Streaming is NDJSON (one JSON
object a line), Ollama's default; ``"stream": false`` answers one object. Every error is ``{"error": "..."}`` with
the status the OpenAI routes give (400 for a client's mistake, never a 500). The model endpoints (tags, show, ps,
version) are in ollama_models.py.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import anyio
from fastapi import Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from fastapi.routing import APIRoute
from pydantic import BaseModel, Field, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from extensions.openai import core, embeddings
from extensions.openai import tools as tooling
from extensions.openai.auth import caller_id, require_admin
from extensions.openai.completions import fim_prompt
from extensions.openai.errors import APIError, from_exception, validation_message
from extensions.openai.ollama_models import model_name, timestamp
from extensions.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingRequest,
    ResponseFormat,
    _Base,
)
from modules import models, shared
from modules.errors import InvalidRequest
from modules.generation.pipeline import GenerationStats, check_prompt_length
from modules.loaders.base import Backend

log = logging.getLogger(__name__)
M = TypeVar("M", bound=BaseModel)
NDJSON = "application/x-ndjson"

# Ollama's option -> the request field of the same meaning.
OPTION_FIELDS = {
    "temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p", "typical_p": "typical_p",
    "tfs_z": "tfs", "seed": "seed", "stop": "stop", "repeat_penalty": "repetition_penalty",
    "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty", "mirostat": "mirostat_mode",
    "mirostat_tau": "mirostat_tau", "mirostat_eta": "mirostat_eta",
}  # fmt: skip
# Options that say how to load a model, not how to generate: the loaded model's settings apply (logged once).
LOAD_OPTIONS = frozenset(
    {
        "num_ctx", "num_batch", "num_gpu", "main_gpu", "low_vram", "numa", "num_thread", "use_mmap", "use_mlock",
        "vocab_only", "embedding_only", "logits_all", "f16_kv", "num_keep", "penalize_newline",
    }
)  # fmt: skip
# A request field's name in Ollama's request, for error messages.
_THEIRS = {ours: f"options.{theirs}" for theirs, ours in OPTION_FIELDS.items()} | {
    "max_tokens": "options.num_predict",
    "repetition_penalty_range": "options.repeat_last_n",
    "response_format": "format",
}
_logged: set[str] = set()


def _log_once(key: str, message: str, *args: Any) -> None:
    if key not in _logged:
        _logged.add(key)
        log.info(message, *args)


# ------------------------------------------------------------------ errors
def error_response(exc: BaseException) -> JSONResponse:
    """Any failure as Ollama answers one: ``{"error": "..."}`` with the status (4xx for a client's mistake)."""
    if isinstance(exc, RequestValidationError):
        exc = APIError(400, validation_message(exc)[0])
    elif isinstance(exc, StarletteHTTPException):
        exc = APIError(exc.status_code, str(exc.detail))
    err = from_exception(exc)
    return JSONResponse({"error": err.message}, status_code=err.status, headers=err.headers)


def _any_content_type(request: Request) -> bool:
    """True when a POST body is read as JSON whatever its Content-Type, as Ollama does (its curl examples send none).

    Not for a page on an origin ``--api-cors-origins`` does not list: its ``text/plain`` POST needs no preflight, so
    reading it would let any web page run (or unload) models; such a body must say ``application/json``, which
    needs a preflight, which is refused.
    """
    origin = request.headers.get("origin")
    origins = shared.settings.api_cors_origins
    return request.method == "POST" and (origin is None or "*" in origins or origin in origins)


class OllamaRoute(APIRoute):
    """A route whose failures (a body that does not validate, a missing API key, ...) are Ollama-shaped.

    The body is read as JSON whatever its Content-Type (see ``_any_content_type``).
    """

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def route(request: Request) -> Response:
            if _any_content_type(request) and request.headers.get("content-type") != "application/json":
                headers = [(k, v) for k, v in request.scope["headers"] if k != b"content-type"]
                scope = {**request.scope, "headers": [*headers, (b"content-type", b"application/json")]}
                request = Request(scope, request.receive)
            try:
                return await handler(request)
            except Exception as exc:
                return error_response(exc)

        return route


# ------------------------------------------------------------------ request bodies (Ollama's api/types.go)
class Message(_Base):
    role: Literal["system", "user", "assistant", "tool"]
    content: str | None = None
    images: list[str] | None = Field(None, description="Base64 images (or data URLs), for vision models.")
    tool_calls: list[dict[str, Any]] | None = None
    tool_name: str | None = None
    tool_call_id: str | None = None


class _Generation(_Base):
    model: str = Field(min_length=1)
    format: str | dict[str, Any] | None = Field(None, description='"json" or a JSON schema.')
    options: dict[str, Any] | None = None
    stream: bool = True
    keep_alive: float | str | None = None
    think: bool | str | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None


class ChatRequest(_Generation):
    """POST /api/chat"""

    messages: list[Message] = Field(default_factory=list)
    tools: list[dict[str, Any]] | None = None


class GenerateRequest(_Generation):
    """POST /api/generate"""

    prompt: str = ""
    suffix: str | None = None
    images: list[str] | None = None
    system: str | None = None
    template: str | None = None
    context: list[int] | None = None
    raw: bool = False


class EmbedRequest(_Base):
    """POST /api/embed"""

    model: str = Field(min_length=1)
    input: str | list[str]
    truncate: bool = True
    options: dict[str, Any] | None = None
    keep_alive: float | str | None = None
    dimensions: int | None = Field(None, ge=1)


class EmbeddingsRequest(_Base):
    """POST /api/embeddings (superseded by /api/embed)"""

    model: str = Field(min_length=1)
    prompt: str = ""
    options: dict[str, Any] | None = None
    keep_alive: float | str | None = None


# ------------------------------------------------------------------ Ollama's request -> ours
def _integer(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequest(f"options.{name} must be an integer", param=f"options.{name}")
    return value


def _fields(req: _Generation) -> dict[str, Any]:
    """Request fields (chat or completion) from Ollama's ``options`` and ``format``."""
    if req.think:
        raise InvalidRequest(
            "this server does not separate a model's thinking; leave think out or send false", param="think"
        )
    if req.logprobs or req.top_logprobs:
        raise InvalidRequest("logprobs are served by /v1/chat/completions, not the Ollama API", param="logprobs")
    values: dict[str, Any] = {}
    no_penalties = False
    for key, value in (req.options or {}).items():
        if value is None:
            continue
        if key in OPTION_FIELDS:
            values[OPTION_FIELDS[key]] = value
        elif key == "num_predict":
            if _integer(value, key) > 0:  # -1 and -2: until the context is full, which is the default
                values["max_tokens"] = value
        elif key == "repeat_last_n":  # Ollama: 0 switches the penalties off, -1 looks at the whole context
            window = _integer(value, key)
            no_penalties = window == 0
            values["repetition_penalty_range"] = max(window, 0)
        elif key in LOAD_OPTIONS:
            _log_once(f"load:{key}", "Ollama API: option %r is set when a model loads; the loaded model's applies", key)
        else:
            _log_once(f"unknown:{key}", "Ollama API: unknown option %r accepted and not used", key)
    if no_penalties:
        values.update(repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0)
        values.pop("repetition_penalty_range")
    if req.format == "json":
        values["response_format"] = {"type": "json_object"}
    elif isinstance(req.format, dict):  # honoured as response_format's json_object with a schema
        values["response_format"] = {"type": "json_object", "schema": req.format}
    elif req.format:
        raise InvalidRequest('format must be "json" or a JSON schema', param="format")
    return values


def _validated(cls: type[M], values: dict[str, Any]) -> M:
    try:
        return cls.model_validate(values)
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = [str(p) for p in first["loc"]]
        where = ".".join([_THEIRS.get(loc[0], loc[0]), *loc[1:]]) if loc else "request"
        raise InvalidRequest(f"{where}: {first['msg']}", param=where) from exc


def _image(data: str) -> dict[str, Any]:
    url = data if data.startswith("data:") else f"data:image/png;base64,{data}"
    return {"type": "image_url", "image_url": {"url": url}}


def _content(text: str | None, images: list[str] | None) -> str | list[dict[str, Any]]:
    if not images:
        return text or ""
    return [{"type": "text", "text": text or ""}, *(_image(i) for i in images)]


def _openai_call(call: dict[str, Any], where: str) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise InvalidRequest("a tool call needs function.name", param=where)
    arguments = function.get("arguments", {})
    return {
        "id": call.get("id") or f"call_{where.replace('.', '_')}",
        "type": "function",
        "function": {
            "name": function["name"],
            "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False),
        },
    }


def _messages(messages: list[Message]) -> list[dict[str, Any]]:
    result: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        entry: dict[str, Any] = {"role": message.role, "content": _content(message.content, message.images)}
        if message.tool_calls:
            entry["tool_calls"] = [
                _openai_call(c, f"messages.{i}.tool_calls.{j}") for j, c in enumerate(message.tool_calls)
            ]
            entry["content"] = entry["content"] or None
        if message.tool_name:
            entry["name"] = message.tool_name
        if message.tool_call_id:
            entry["tool_call_id"] = message.tool_call_id
        result.append(entry)
    return result


def chat_request(req: ChatRequest) -> ChatCompletionRequest:
    """The chat completion request an Ollama chat request is (a final assistant message is a prefill, as Ollama's)."""
    body = {
        **_fields(req),
        "model": model_name(req.model),
        "messages": _messages(req.messages),
        "continue_final_message": True,
    }
    if req.tools:
        body["tools"] = req.tools
    return _validated(ChatCompletionRequest, body)


def _generate_chat_request(req: GenerateRequest) -> ChatCompletionRequest:
    """A templated (not ``raw``) generate request is one user message, after the system prompt if there is one."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": req.system}] if req.system else []
    messages.append({"role": "user", "content": _content(req.prompt, req.images)})
    return _validated(ChatCompletionRequest, {**_fields(req), "model": model_name(req.model), "messages": messages})


# ------------------------------------------------------------------ answers
@dataclass
class _Timing:
    """When the request started and how long getting its model ready took (nanoseconds, as Ollama reports)."""

    endpoint: str
    started: float
    load_ns: int = 0

    def durations(self, stats: GenerationStats) -> dict[str, int]:
        prompt_ns = int(stats.time_to_first_token * 1e9)
        return {
            "total_duration": int((time.perf_counter() - self.started) * 1e9),
            "load_duration": self.load_ns,
            "prompt_eval_count": stats.prompt_tokens,
            "prompt_eval_duration": prompt_ns,
            "eval_count": stats.new_tokens,
            "eval_duration": max(0, int(stats.total_time * 1e9) - prompt_ns),
        }


async def _backend(request: Request, name: str, endpoint: str) -> tuple[Backend, _Timing]:
    started = time.perf_counter()
    backend = await core.serving_backend(request, name)  # loads a local model that is not the loaded one
    return backend, _Timing(endpoint, started, int((time.perf_counter() - started) * 1e9))


def _piece(model: str, text: str, generate: bool, calls: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    head: dict[str, Any] = {"model": model, "created_at": timestamp()}
    if generate:
        return {**head, "response": text, "done": False}
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if calls:
        message["tool_calls"] = calls
    return {**head, "message": message, "done": False}


def _final(model: str, stats: GenerationStats, timing: _Timing, generate: bool) -> dict[str, Any]:
    core.record(timing.endpoint, [stats], timing.started)
    last = _piece(model, "", generate)
    reason = "length" if stats.finish_reason in ("length", "context") else "stop"
    return {**last, "done": True, "done_reason": reason, **timing.durations(stats)}


def _ollama_call(call: tooling.ToolCall, index: int) -> dict[str, Any]:
    try:
        arguments = json.loads(call.arguments)
    except ValueError:
        arguments = {}
    return {"id": call.id, "function": {"index": index, "name": call.name, "arguments": arguments}}


async def _chat_objects(
    job: core.ChatJob, running: core.Running, model: str, timing: _Timing, generate: bool, request: Request | None
) -> AsyncIterator[dict[str, Any]]:
    calls = 0
    async for event in core.chat_events(job, running, request):
        if event.kind == "error":
            assert event.error is not None
            raise event.error
        if event.kind == "text":
            yield _piece(model, event.text, generate)
        elif event.kind == "call" and event.call is not None:
            yield _piece(model, "", generate, [_ollama_call(event.call, calls)])
            calls += 1
        elif event.kind == "done" and event.stats is not None:
            yield _final(model, event.stats, timing, generate)


async def _raw_objects(
    running: core.Running, model: str, timing: _Timing, request: Request | None
) -> AsyncIterator[dict[str, Any]]:
    async for item in core.merge(running, request):
        if item.error is not None:
            raise item.error
        assert item.delta is not None
        if item.delta.text:
            yield _piece(model, item.delta.text, True)
        if item.delta.stats is not None:
            yield _final(model, item.delta.stats, timing, True)


async def _lines(objects: AsyncIterator[dict[str, Any]]) -> AsyncIterator[str]:
    try:
        async for obj in objects:
            yield json.dumps(obj, ensure_ascii=False) + "\n"
    except Exception as exc:  # after the first line the status is sent: the error is the last line, as Ollama's
        yield json.dumps({"error": from_exception(exc).message}, ensure_ascii=False) + "\n"


async def _collect(objects: AsyncIterator[dict[str, Any]]) -> dict[str, Any]:
    text, calls, final = "", [], {}
    async for obj in objects:
        if obj["done"]:
            final = obj
        elif "message" in obj:
            text += obj["message"]["content"]
            calls += obj["message"].get("tool_calls", [])
        else:
            text += obj["response"]
    if "message" in final:
        final["message"] = {"role": "assistant", "content": text, **({"tool_calls": calls} if calls else {})}
    else:
        final["response"] = text
    return final


async def _answer(stream: bool, objects: AsyncIterator[dict[str, Any]]) -> Response:
    if stream:
        return StreamingResponse(_lines(objects), media_type=NDJSON)
    return JSONResponse(await _collect(objects))


def _is_zero(keep_alive: float | str | None) -> bool:
    if isinstance(keep_alive, str):
        return keep_alive.strip().rstrip("smh") in ("0", "0.0")
    return keep_alive == 0


async def _load_or_unload(req: _Generation, request: Request, empty: dict[str, Any]) -> dict[str, Any]:
    """An empty request loads the model (another local model: admin key); with ``keep_alive: 0`` it unloads it
    (admin key)."""
    name = model_name(req.model)
    if _is_zero(req.keep_alive):
        require_admin(request)
        if shared.model is not None and core._is_loaded(name):
            await anyio.to_thread.run_sync(models.unload_model)
        reason = "unload"
    else:
        await core.serving_backend(request, name)
        reason = "load"
    return {"model": req.model, "created_at": timestamp(), **empty, "done": True, "done_reason": reason}


# ------------------------------------------------------------------ endpoints
async def chat(req: ChatRequest, request: Request) -> Any:
    """POST /api/chat"""
    req.log_unknown_fields("ollama.chat")
    if not req.messages:
        _fields(req)  # 400s before anything loads
        return await _load_or_unload(req, request, {"message": {"role": "assistant", "content": ""}})
    chat_req = chat_request(req)
    _, timing = await _backend(request, chat_req.model or "", "ollama.chat")
    job, running = await core.start_chat(chat_req, request, chat_req.model)
    watch = None if req.stream else request
    return await _answer(req.stream, _chat_objects(job, running, req.model, timing, False, watch))


async def _start_raw(req: GenerateRequest, backend: Backend, owner: str) -> core.Running:
    """A raw or fill-in-the-middle generation: the prompt as it is, the output constrained as ``format`` asks."""
    if req.images or req.system:
        where = "images" if req.images else "system"
        raise InvalidRequest("images and system need raw: false and no suffix", param=where)
    fields = _fields(req)
    fmt = fields.pop("response_format", None)
    completion = _validated(CompletionRequest, {**fields, "max_tokens": fields.get("max_tokens"), "model": req.model})
    params = core.generation_params(completion, max_tokens=completion.max_tokens, default_max=backend.context_length)
    schema = core.response_schema(ResponseFormat.model_validate(fmt)) if fmt else None
    if schema is not None:
        params = params.replace(json_schema=schema)
    core.check_constraints(params, backend)
    if req.suffix:
        check_prompt_length(backend, req.prompt)  # before tokenizing: a huge prompt must not hold the event loop
        check_prompt_length(backend, req.suffix, "suffix")
        prompt: str | list[int] = await anyio.to_thread.run_sync(fim_prompt, backend, req.prompt, req.suffix)
    else:
        prompt = req.prompt
    return await core.start([prompt], [params], backend, owner=owner)


async def generate(req: GenerateRequest, request: Request) -> Any:
    """POST /api/generate"""
    req.log_unknown_fields("ollama.generate")
    if req.template:
        raise InvalidRequest(
            "template (a Go template) is not supported; send raw: true and the whole prompt", param="template"
        )
    if req.context:
        raise InvalidRequest(
            "context (deprecated by Ollama) is not supported; send the conversation to /api/chat", param="context"
        )
    raw = req.raw or bool(req.suffix)
    chat_req = None if raw else _generate_chat_request(req)  # 400s before anything loads
    if not req.prompt and not req.suffix and not req.images:
        return await _load_or_unload(req, request, {"response": ""})
    backend, timing = await _backend(request, model_name(req.model), "ollama.generate")
    watch = None if req.stream else request
    if chat_req is None:
        running = await _start_raw(req, backend, caller_id(request))
        return await _answer(req.stream, _raw_objects(running, req.model, timing, watch))
    job, running = await core.start_chat(chat_req, request, chat_req.model)
    return await _answer(req.stream, _chat_objects(job, running, req.model, timing, True, watch))


async def _embed(texts: list[str], name: str, dimensions: int | None, request: Request) -> tuple[list[Any], int]:
    result = await embeddings.create(EmbeddingRequest(input=texts, model=name, dimensions=dimensions), request)
    return [d["embedding"] for d in result["data"]], int(result["usage"]["prompt_tokens"])


async def embed(req: EmbedRequest, request: Request) -> dict[str, Any]:
    """POST /api/embed: the loaded model's embeddings when it is named and can embed, else all-MiniLM-L6-v2's."""
    started = time.perf_counter()
    req.log_unknown_fields("ollama.embed")
    if not req.truncate:
        raise InvalidRequest(
            "inputs are always truncated to the embedding model's window; send truncate: true", param="truncate"
        )
    texts = [req.input] if isinstance(req.input, str) else list(req.input)
    vectors, tokens = await _embed(texts, model_name(req.model), req.dimensions, request) if texts else ([], 0)
    return {
        "model": req.model,
        "embeddings": vectors,
        "total_duration": int((time.perf_counter() - started) * 1e9),
        "load_duration": 0,
        "prompt_eval_count": tokens,
    }


async def embeddings_legacy(req: EmbeddingsRequest, request: Request) -> dict[str, Any]:
    """POST /api/embeddings: one vector for ``prompt``."""
    req.log_unknown_fields("ollama.embeddings")
    if not req.prompt:
        return {"embedding": []}
    vectors, _ = await _embed([req.prompt], model_name(req.model), None, request)
    return {"embedding": vectors[0]}


# Ollama endpoints served here, by path: their methods.
SERVED = {
    "/api/version": ("GET", "HEAD"), "/api/tags": ("GET", "HEAD"), "/api/ps": ("GET", "HEAD"), "/api/show": ("POST",),
    "/api/chat": ("POST",), "/api/generate": ("POST",), "/api/embed": ("POST",), "/api/embeddings": ("POST",),
}  # fmt: skip


async def not_served(request: Request) -> Any:
    """Any other /api/ path: 405 for a served path with another method, else a 404 that says what is served."""
    path = request.url.path.rstrip("/")
    if path in SERVED:
        raise APIError(405, f"{request.method} {path} is not allowed; use {' or '.join(SERVED[path])}")
    raise APIError(
        404,
        f"{path} is not served. textgen serves {', '.join(SERVED)}; models are the files in models/ "
        "(download them in the Model tab), they are not pulled, pushed, created or deleted through the API",
    )
