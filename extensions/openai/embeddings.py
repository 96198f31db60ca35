"""POST /v1/embeddings: all-MiniLM-L6-v2 (offline), or the loaded model when it is named and can embed."""

from __future__ import annotations

import base64
import struct
from typing import Any

import anyio
from fastapi import Request

from extensions.openai.protocol import EmbeddingRequest
from modules import shared
from modules.embeddings import DIMENSIONS, ENCODER, MODEL_NAME
from modules.errors import InvalidRequest


def _texts(value: Any) -> list[str]:
    if isinstance(value, str):
        texts = [value]
    elif isinstance(value, list) and all(isinstance(v, str) for v in value):
        texts = list(value)
    else:
        raise InvalidRequest(
            "input must be a string or a list of strings (token arrays are not accepted)", param="input"
        )
    if not texts or len(texts) > 2048:
        raise InvalidRequest("input must hold between 1 and 2048 strings", param="input")
    if any(not t for t in texts):
        raise InvalidRequest("input must not contain empty strings", param="input")
    return texts


def _encode_vector(vector: list[float], fmt: str) -> list[float] | str:
    if fmt == "base64":
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
    return vector


async def create(req: EmbeddingRequest, request: Request) -> dict[str, Any]:
    """Embed the input strings."""
    req.log_unknown_fields("embeddings")
    texts = _texts(req.input)
    backend = shared.model
    use_loaded = (
        bool(req.model) and req.model == shared.model_name and backend is not None and backend.supports_embeddings
    )
    if use_loaded:
        assert backend is not None

        def embed() -> tuple[list[list[float]], int]:  # tokenizing a big input too: never on the event loop
            return backend.embed(texts), sum(len(backend.encode(t)) for t in texts)

        vectors, tokens = await anyio.to_thread.run_sync(embed)
        name = shared.model_name or ""
    else:
        result = await anyio.to_thread.run_sync(ENCODER.encode, texts)
        vectors, tokens, name = result.vectors, result.tokens, req.model or MODEL_NAME
    size = len(vectors[0]) if vectors else DIMENSIONS
    if req.dimensions is not None and req.dimensions != size:
        raise InvalidRequest(f"this embedding model has {size} dimensions and cannot be shortened", param="dimensions")
    return {
        "object": "list",
        "data": [
            {"object": "embedding", "index": i, "embedding": _encode_vector(v, req.encoding_format)}
            for i, v in enumerate(vectors)
        ],
        "model": name,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }
