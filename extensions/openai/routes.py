"""The API's routes: thin handlers that validate, call a serving module and return its answer.

Every OpenAI route is served under ``/v1`` and also without the prefix (some clients call ``/chat/completions``);
Ollama's are under ``/api``.
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.datastructures import Headers, MutableHeaders
from starlette.routing import Match, Mount
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from extensions.openai import (
    anthropic,
    chat,
    completions,
    downloads,
    embeddings,
    errors,
    internal,
    ollama,
    ollama_models,
    responses,
)
from extensions.openai.auth import require_admin, require_key
from extensions.openai.limits import BodySizeLimit
from extensions.openai.metrics import METRICS
from extensions.openai.protocol import ChatCompletionRequest, CompletionRequest, EmbeddingRequest
from modules import shared
from modules.web_guard import API_PREFIXES


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
    downloads.register(router, admin)  # /internal/model/download (a job), its progress and cancel
    return router


async def _anthropic_body(request: Request) -> dict[str, Any] | JSONResponse:
    """The JSON object a Messages request carries, or the Anthropic-shaped error to answer instead."""
    try:
        require_key(request)
        body = await request.json()
    except errors.APIError as exc:
        return anthropic.anthropic_error(exc)
    except ValueError:
        return anthropic.anthropic_error(errors.APIError(400, "the request body is not valid JSON"))
    if not isinstance(body, dict):
        return anthropic.anthropic_error(errors.APIError(400, "the request body must be a JSON object"))
    return body


def _messages_router() -> APIRouter:
    router = APIRouter()

    @router.post("/messages")
    async def messages_create(request: Request) -> Any:
        body = await _anthropic_body(request)
        return body if isinstance(body, JSONResponse) else await anthropic.create(body, request)

    @router.post("/messages/count_tokens")
    async def messages_count_tokens(request: Request) -> Any:
        body = await _anthropic_body(request)
        return body if isinstance(body, JSONResponse) else await anthropic.count_tokens(body, request)

    return router


def _ollama_router() -> APIRouter:
    """Ollama's API; every answer, errors included, in Ollama's shape."""
    router = APIRouter(route_class=ollama.OllamaRoute, dependencies=[Depends(require_key)])
    for path, endpoint in (
        ("/api/version", ollama_models.version),
        ("/api/tags", ollama_models.tags),
        ("/api/ps", ollama_models.ps),
    ):
        router.add_api_route(path, endpoint, methods=["GET"])
        router.add_api_route(path, endpoint, methods=["HEAD"], include_in_schema=False)  # clients probe with HEAD
    router.add_api_route("/api/show", ollama_models.show, methods=["POST"])
    router.add_api_route("/api/chat", ollama.chat, methods=["POST"])
    router.add_api_route("/api/generate", ollama.generate, methods=["POST"])
    router.add_api_route("/api/embed", ollama.embed, methods=["POST"])
    router.add_api_route("/api/embeddings", ollama.embeddings_legacy, methods=["POST"])
    methods = ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE"]
    router.add_api_route("/api/{path:path}", ollama.not_served, methods=methods, include_in_schema=False)
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


class UnknownApiPath:
    """A ``/v1/...`` request no route serves: the OpenAI error object (404, or 405 for a known path and another
    method), not the web UI mount's ``{"detail": "Not Found"}``. Checked against the app's routes when the request
    comes, so routes that extensions add later count too."""

    def __init__(self, app: ASGIApp, routes: Any) -> None:
        self.app = app
        self.routes = routes  # the FastAPI app's router.routes (the same list, still growing at install time)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1/") and scope["method"] != "OPTIONS":
            partial = False
            for route in self.routes:
                if isinstance(route, Mount) and route.path in ("", "/"):
                    continue  # the web UI, mounted at the root, would take anything
                match, _ = route.matches(scope)
                if match is Match.FULL:
                    break
                partial = partial or match is Match.PARTIAL
            else:
                error = (
                    errors.APIError(
                        405, f"{scope['method']} is not allowed on {scope['path']}", code="method_not_allowed"
                    )
                    if partial
                    else errors.APIError(404, f"no API route {scope['path']}", code="unknown_url")
                )
                await JSONResponse(error.body(), status_code=error.status)(scope, receive, send)
                return
        await self.app(scope, receive, send)


class PreflightGate:
    """CORS preflights to the API from an origin that ``--api-cors-origins`` does not list: 403, granting nothing.

    A preflight from a listed origin goes on to Starlette's CORSMiddleware, which grants it. Browsers treat any
    non-2xx preflight as a refusal, and the 403 with a JSON body says in the network panel (and to curl) which flag
    allows the origin. Without the gate, with no origins configured, the router answered 405 (``--nowebui``) or
    the preflight fell through to the web UI's mount, whose Gradio CORS middleware answered 200 and, for a server
    reached by a non-localhost name (``--listen``), granted any origin; CORSMiddleware answered an unlisted origin
    a bare 400.
    """

    def __init__(self, app: ASGIApp, origins: list[str]) -> None:
        self.app = app
        self.origins = origins

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "OPTIONS" and scope["path"].startswith(API_PREFIXES):
            headers = Headers(scope=scope)
            origin = headers.get("origin")
            if origin and "access-control-request-method" in headers and not self.allows(origin):
                await self.refuse(scope, origin)(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def allows(self, origin: str) -> bool:
        """True when a page on ``origin`` may call the API."""
        return "*" in self.origins or origin in self.origins

    def refuse(self, scope: Scope, origin: str) -> JSONResponse:
        """The 403 for a preflight from ``origin`` (Ollama-shaped on Ollama's paths)."""
        listed = f"; allowed: {', '.join(self.origins)}" if self.origins else ""
        message = (
            f"cross-origin requests from {origin} are not allowed{listed}. "
            f"Start textgen with --api-cors-origins {origin} to allow them."
        )
        error = errors.APIError(403, message, type_="permission_error", code="cors_origin_not_allowed")
        body = {"error": message} if scope["path"].startswith("/api/") else error.body()
        return JSONResponse(body, status_code=403, headers={"Vary": "Origin"})


def install(app: FastAPI) -> None:
    """Add every API route, the error handlers, request metrics and CORS (granted to configured origins) to ``app``."""
    errors.install(app)
    for prefix in ("/v1", ""):
        app.include_router(_router(), prefix=prefix)
        app.include_router(_messages_router(), prefix=prefix)
    app.include_router(_ollama_router())
    app.add_api_route("/metrics", metrics, methods=["GET"], include_in_schema=False)

    app.add_middleware(UnknownApiPath, routes=app.router.routes)
    max_bytes = int(shared.settings.max_request_mb * 2**20)
    app.add_middleware(BodySizeLimit, max_bytes=max_bytes, limited=lambda path: path.startswith(API_PREFIXES))
    app.add_middleware(RequestMetrics)  # outside the size limit: its 413s are counted

    origins = shared.settings.api_cors_origins
    if origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=origins,
            allow_methods=["*"],
            allow_headers=["*"],
            allow_credentials="*" not in origins,
        )
    app.add_middleware(PreflightGate, origins=list(origins))  # outermost: before CORSMiddleware sees a preflight
