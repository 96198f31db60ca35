"""The API's routes: thin handlers that validate, call a serving module and return its answer.

Every route is served under ``/v1`` and also without the prefix (some clients call ``/chat/completions``).
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import PlainTextResponse
from starlette.datastructures import MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from extensions.openai import anthropic, chat, completions, embeddings, errors, internal, responses
from extensions.openai.auth import require_admin, require_key
from extensions.openai.metrics import METRICS
from extensions.openai.protocol import ChatCompletionRequest, CompletionRequest, EmbeddingRequest
from modules import shared

API_PREFIXES = ("/v1/", "/chat/", "/completions", "/embeddings", "/models", "/responses", "/messages", "/metrics")


def _router() -> APIRouter:
    router = APIRouter(dependencies=[Depends(require_key)])
    admin = [Depends(require_admin)]

    @router.post("/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, request: Request) -> Any:
        return await chat.create(req, request)

    @router.post("/completions")
    async def text_completions(req: CompletionRequest, request: Request) -> Any:
        return await completions.create(req, request)

    @router.get("/models")
    async def models_list() -> Any:
        return internal.list_models()

    @router.get("/models/{model_id:path}")
    async def models_get(model_id: str) -> Any:
        return internal.get_model(model_id)

    @router.post("/embeddings")
    async def embeddings_create(req: EmbeddingRequest, request: Request) -> Any:
        return await embeddings.create(req, request)

    @router.post("/responses")
    async def responses_create(req: responses.ResponsesRequest, request: Request) -> Any:
        return await responses.create(req, request)

    @router.get("/responses/{response_id}")
    async def responses_get(response_id: str) -> Any:
        responses.not_found(response_id)

    router.add_api_route("/internal/model/info", internal.model_info, methods=["GET"])
    router.add_api_route("/internal/model/list", internal.model_list, methods=["GET"])
    router.add_api_route("/internal/model/load", internal.load_model, methods=["POST"], dependencies=admin)
    router.add_api_route("/internal/model/unload", internal.unload_model, methods=["POST"], dependencies=admin)
    router.add_api_route("/internal/lora/list", internal.lora_list, methods=["GET"])
    router.add_api_route("/internal/lora/load", internal.lora_load, methods=["POST"], dependencies=admin)
    router.add_api_route("/internal/lora/unload", internal.lora_unload, methods=["POST"], dependencies=admin)
    router.add_api_route("/internal/encode", internal.encode, methods=["POST"])
    router.add_api_route("/internal/decode", internal.decode, methods=["POST"])
    router.add_api_route("/internal/token-count", internal.token_count, methods=["POST"])
    router.add_api_route("/internal/stop-generation", internal.stop_generation, methods=["POST"])
    router.add_api_route("/internal/logits", internal.logits, methods=["POST"])
    router.add_api_route("/internal/chat-prompt", internal.chat_prompt, methods=["POST"])
    return router


def _messages_router() -> APIRouter:
    router = APIRouter()

    @router.post("/messages")
    async def messages_create(request: Request) -> Any:
        try:
            require_key(request)
            body = await request.json()
        except errors.APIError as exc:
            return anthropic.anthropic_error(exc)
        except ValueError:
            return anthropic.anthropic_error(errors.APIError(400, "the request body is not valid JSON"))
        if not isinstance(body, dict):
            return anthropic.anthropic_error(errors.APIError(400, "the request body must be a JSON object"))
        return await anthropic.create(body, request)

    return router


def metrics(request: Request) -> PlainTextResponse:
    """GET /metrics in Prometheus' text format."""
    require_key(request)
    backend = shared.model
    text = METRICS.render(backend.stats() if backend else {}, shared.model_name, shared.running_generations())
    return PlainTextResponse(text, media_type="text/plain; version=0.0.4")


class RequestMetrics:
    """Count API requests by route and status, and add X-Process-Time.

    Plain ASGI on purpose: Starlette's ``@app.middleware("http")`` wraps ``receive`` so that
    ``request.is_disconnected()`` never turns true, and a non-streaming request would outlive its client.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(API_PREFIXES):
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 500

        async def timed_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                MutableHeaders(scope=message).setdefault("X-Process-Time", f"{time.perf_counter() - started:.4f}")
            await send(message)

        try:
            await self.app(scope, receive, timed_send)
        finally:
            route = scope.get("route")
            path = str(getattr(route, "path", None) or scope["path"])
            METRICS.observe_request(path.removeprefix("/v1"), status)


def install(app: FastAPI) -> None:
    """Add every API route, the error handlers, request metrics and (if configured) CORS to ``app``."""
    errors.install(app)
    for prefix in ("/v1", ""):
        app.include_router(_router(), prefix=prefix)
        app.include_router(_messages_router(), prefix=prefix)
    app.add_api_route("/metrics", metrics, methods=["GET"], include_in_schema=False)

    app.add_middleware(RequestMetrics)

    origins = shared.settings.api_cors_origins
    if origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=origins,
            allow_methods=["*"],
            allow_headers=["*"],
            allow_credentials="*" not in origins,
        )
