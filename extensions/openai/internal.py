"""Model listing and text-generation-webui's internal API (same paths and bodies, so its clients work)."""

from __future__ import annotations

import time
from typing import Any

import anyio
from fastapi import Request
from pydantic import Field

from extensions.openai import core
from extensions.openai.auth import caller_id, is_admin
from extensions.openai.errors import APIError
from extensions.openai.protocol import ChatCompletionRequest, _Base
from modules import models, models_settings, shared
from modules.embeddings import MODEL_NAME
from modules.errors import InvalidRequest

_CREATED = int(time.time())


def _model_card(name: str, owned_by: str = "textgen") -> dict[str, Any]:
    card: dict[str, Any] = {"id": name, "object": "model", "created": _CREATED, "owned_by": owned_by}
    if owned_by == "textgen":
        card["loaded"] = shared.model is not None and name == shared.model_name
    return card


def loaded_first(names: list[str]) -> list[str]:
    """``names`` with the loaded model first (many clients take the first model), the others in their order."""
    loaded = shared.model_name if shared.model is not None else None
    return sorted(names, key=lambda name: name != loaded)


def list_models() -> dict[str, Any]:
    """GET /v1/models: the loaded model (``"loaded": true``), the other local models (and a remote engine's),
    then the embedding model."""
    names = models.model_names()
    if shared.model is not None:
        names += [n for n in shared.model.served_models() if n not in names]
    if shared.model_name and shared.model_name not in names:
        names.insert(0, shared.model_name)
    data = [_model_card(n) for n in loaded_first(names)] + [_model_card(MODEL_NAME, "sentence-transformers")]
    return {"object": "list", "data": data}


def get_model(model_id: str) -> dict[str, Any]:
    """GET /v1/models/{id}: 404 when there is no such model."""
    if model_id == MODEL_NAME:
        return _model_card(MODEL_NAME, "sentence-transformers")
    served = shared.model.served_models() if shared.model is not None else []
    if (
        model_id == shared.model_name
        or model_id in models.model_names()
        or model_id in served
        or core._local_match(model_id)
    ):
        return _model_card(model_id)
    raise APIError(
        404,
        f"The model '{model_id}' does not exist",
        type_="invalid_request_error",
        param="model",
        code="model_not_found",
    )


def model_info() -> dict[str, Any]:
    """GET /v1/internal/model/info"""
    backend = shared.model
    meta = backend.metadata if backend else None
    return {
        "model_name": shared.model_name or "None",
        "lora_names": list(shared.loras),
        "loader": shared.model_options.get("loader") if backend else None,
        "context_length": backend.context_length if backend else None,
        "chat_template": meta.chat_template if meta else None,
        "bos_token": meta.bos_token if meta else None,
        "eos_token": meta.eos_token if meta else None,
        "add_bos_token": meta.add_bos_token if meta else None,
    }


def model_list() -> dict[str, Any]:
    """GET /v1/internal/model/list"""
    return {"model_names": models.model_names()}


class LoadModelRequest(_Base):
    model_name: str = Field(min_length=1)
    args: dict[str, Any] | None = None
    settings: dict[str, Any] | None = None


async def load_model(req: LoadModelRequest) -> dict[str, str]:
    """POST /v1/internal/model/load: unload the current model, load this one with optional per-load settings.

    ``args`` or ``settings`` naming a security setting (``trust_remote_code``, ``remote_url``, keys, paths, ...)
    is a 400: those come only from the command line, the environment and settings.yaml.
    """
    overrides = dict(req.args or {})
    models_settings.check_request_overrides(overrides)
    models_settings.check_request_overrides(req.settings, "settings")
    from modules.lifecycle import hub

    if not (hub.looks_like_repo(req.model_name) and hub.local_name(req.model_name) is None):
        models.find_model(req.model_name)  # 404 before anything is unloaded; a repo not here is downloaded first
    await anyio.to_thread.run_sync(lambda: models.load_model(req.model_name, overrides))
    if req.settings:
        shared.ui_defaults.update(req.settings)
    return {"status": "OK", "model_name": shared.model_name or ""}


async def unload_model() -> dict[str, str]:
    """POST /v1/internal/model/unload"""
    await anyio.to_thread.run_sync(models.unload_model)
    return {"status": "OK"}


def lora_list() -> dict[str, Any]:
    """GET /v1/internal/lora/list"""
    return {"lora_names": models.list_loras()}


class LoraRequest(_Base):
    lora_names: list[str] = Field(min_length=1)
    lora_weights: list[float] | None = None


async def lora_load(req: LoraRequest) -> dict[str, str]:
    """POST /v1/internal/lora/load: apply these adapters (replacing the current ones)."""
    await anyio.to_thread.run_sync(models.apply_loras, req.lora_names, req.lora_weights)
    return {"status": "OK"}


async def lora_unload() -> dict[str, str]:
    """POST /v1/internal/lora/unload"""
    await anyio.to_thread.run_sync(models.apply_loras, [])
    return {"status": "OK"}


class TextRequest(_Base):
    text: str


class TokensRequest(_Base):
    tokens: list[int]


def encode(req: TextRequest) -> dict[str, Any]:
    """POST /v1/internal/encode"""
    tokens = core.current_model().encode(req.text)
    return {"tokens": tokens, "length": len(tokens)}


def decode(req: TokensRequest) -> dict[str, str]:
    """POST /v1/internal/decode"""
    backend = core.current_model()
    vocab = backend.metadata.extra.get("n_vocab")
    if vocab and any(not 0 <= t < vocab for t in req.tokens):
        raise InvalidRequest(f"token ids must be between 0 and {vocab - 1}", param="tokens")
    return {"text": backend.decode(req.tokens)}


def token_count(req: TextRequest) -> dict[str, int]:
    """POST /v1/internal/token-count"""
    return {"length": len(core.current_model().encode(req.text))}


def stop_generation(request: Request) -> dict[str, Any]:
    """POST /v1/internal/stop-generation: cancel the caller's own running generations (those it started with the
    key it sends now); with the admin key, or when no key is configured (single user), every generation, the web
    UI's included. ``stopped`` says how many were signalled."""
    if is_admin(request):
        stopped = shared.stop_generation()
    else:
        stopped = shared.stop_generation(prefix=caller_id(request) + "/")
    return {"status": "OK", "stopped": stopped}


class LogitsRequest(_Base):
    prompt: str
    top_logits: int = Field(50, ge=1, le=1000)
    use_samplers: bool = False


async def logits(req: LogitsRequest) -> dict[str, float]:
    """POST /v1/internal/logits: the most likely next tokens and their probabilities."""
    if req.use_samplers:
        raise InvalidRequest(
            "use_samplers is not supported; the raw model distribution is returned", param="use_samplers"
        )
    import math

    from modules.generation.pipeline import check_prompt_length, encode_prompt

    backend = core.current_model()
    check_prompt_length(backend, req.prompt)  # before tokenizing; then off the event loop
    ids = await anyio.to_thread.run_sync(encode_prompt, backend, req.prompt)
    pairs = await anyio.to_thread.run_sync(backend.next_token_logprobs, ids, req.top_logits)
    return {backend.decode([t]): math.exp(lp) for t, lp in pairs}


async def chat_prompt(req: ChatCompletionRequest, request: Request) -> dict[str, str]:
    """POST /v1/internal/chat-prompt: the prompt a chat completion request would be given."""
    backend = await core.serving_backend(request, None)
    job = await anyio.to_thread.run_sync(core.prepare_chat, req, backend)
    return {"prompt": job.prompt}
