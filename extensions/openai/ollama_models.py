"""Ollama's model endpoints: GET /api/tags, POST /api/show, GET /api/ps, GET /api/version.

Names are textgen's model names (``SmolLM2-135M-Instruct.Q4_1.gguf``, a folder name); a trailing ``:latest``, which
some Ollama clients add, is ignored. Details come from the files' headers; nothing is loaded to answer.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import re
import struct
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import anyio

from extensions.openai import core
from extensions.openai.errors import APIError
from extensions.openai.internal import loaded_first
from extensions.openai.protocol import _Base
from modules import models, shared
from modules.embeddings import DIMENSIONS, MAX_TOKENS, MODEL_NAME
from modules.formats.gguf import GGUFError, read_header

# The Ollama version /api/version reports: clients check it before they use newer features (GitHub Copilot and
# Raycast want at least 0.6.4); everything they then send (tools, structured output, /api/embed) is served.
OLLAMA_VERSION = "0.9.0"
_SIZE_LABEL = re.compile(r"(?<![A-Za-z0-9.])(\d+(?:\.\d+)?)([MB])(?![A-Za-z])", re.IGNORECASE)
_QUANT_LABEL = re.compile(r"(?<![A-Za-z0-9])(I?Q\d(?:_[A-Z0-9]+)*|BF16|F16|F32)(?![A-Za-z0-9])", re.IGNORECASE)
_DTYPES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}
_FAR_FUTURE = "2318-01-01T00:00:00Z"  # a model stays loaded until another replaces it (Ollama's keep_alive: -1)


class ShowRequest(_Base):
    """POST /api/show (older clients send ``name``)."""

    model: str | None = None
    name: str | None = None
    verbose: bool = False


def model_name(name: str) -> str:
    """A name as Ollama clients send it, without the default tag ``:latest``."""
    return name.removesuffix(":latest")


def timestamp(when: float | None = None) -> str:
    """RFC 3339 in UTC, as Ollama writes ``created_at`` and ``modified_at``."""
    moment = datetime.fromtimestamp(when, UTC) if when is not None else datetime.now(UTC)
    return moment.isoformat(timespec="microseconds").replace("+00:00", "Z")


def _not_found(name: str) -> APIError:
    return APIError(404, f"model '{name}' not found (the models are the files and folders in models/)")


def _digest(info: models.ModelInfo) -> str:
    """A stable id of the file as it is now (name, size, time); not a hash of the contents, which would read GBs."""
    stat = info.path.stat()
    return hashlib.sha256(f"{info.name}\0{info.size_bytes}\0{stat.st_mtime_ns}".encode()).hexdigest()


def _parameter_size(count: int) -> str:
    return f"{count / 1e9:.1f}B" if count >= 1e9 else f"{count / 1e6:.2f}M"


def _name_details(info: models.ModelInfo) -> dict[str, Any]:
    """What the name says (cheap enough for listing every model)."""
    size = _SIZE_LABEL.search(info.path.name)
    quant = _QUANT_LABEL.search(info.path.name) if info.format == "gguf" else None
    return {
        "parent_model": "",
        "format": "gguf" if info.format == "gguf" else "safetensors",
        "family": "",
        "families": None,
        "parameter_size": (size.group(1) + size.group(2).upper()) if size else "",
        "quantization_level": quant.group(1).upper() if quant else ("EXL2" if info.format == "exl2" else ""),
    }


def _gguf_header(info: models.ModelInfo, verbose: bool) -> tuple[dict[str, Any], dict[str, Any], str]:
    """(details, model_info, chat template) from a GGUF header."""
    from gguf.constants import LlamaFileType

    try:
        meta, tensors, _ = read_header(info.path)
    except GGUFError as exc:
        raise APIError(400, str(exc)) from exc
    details = _name_details(info)
    arch = str(meta.get("general.architecture", ""))
    count = sum(math.prod(t["shape"]) for t in tensors)
    details.update(family=arch, families=[arch] if arch else None, parameter_size=_parameter_size(count))
    with contextlib.suppress(KeyError, ValueError):
        details["quantization_level"] = LlamaFileType(int(meta["general.file_type"])).name.removeprefix("MOSTLY_")
    model_info: dict[str, Any] = {"general.parameter_count": count}
    for key, value in meta.items():
        if key != "tokenizer.chat_template" and value is not None:
            model_info[key] = value if verbose or not isinstance(value, list) else []  # as Ollama: lists on verbose
    return details, model_info, str(meta.get("tokenizer.chat_template") or "")


def _safetensors_parameters(folder: Path) -> int:
    count = 0
    for path in folder.glob("*.safetensors"):
        with open(path, "rb") as handle:
            (length,) = struct.unpack("<Q", handle.read(8))
            header = json.loads(handle.read(length))
        count += sum(math.prod(t["shape"]) for k, t in header.items() if k != "__metadata__")
    return count


def _hf_header(info: models.ModelInfo) -> tuple[dict[str, Any], dict[str, Any], str]:
    """(details, model_info, chat template) from config.json, the tokenizer config and the safetensors headers."""
    details = _name_details(info)
    try:
        config = json.loads((info.path / "config.json").read_text(encoding="utf-8"))
        count = _safetensors_parameters(info.path)
    except (OSError, ValueError, struct.error) as exc:
        raise APIError(400, f"{info.name} cannot be read: {exc}") from exc
    text = config.get("text_config") or config
    arch = str(text.get("model_type") or config.get("model_type") or "")
    details.update(family=arch, families=[arch] if arch else None)
    if count:
        details["parameter_size"] = _parameter_size(count)
    dtype = str(config.get("torch_dtype") or config.get("dtype") or "")
    if info.format == "hf" and dtype in _DTYPES:
        details["quantization_level"] = _DTYPES[dtype]
    model_info: dict[str, Any] = {"general.architecture": arch, "general.parameter_count": count}
    if text.get("max_position_embeddings"):
        model_info[f"{arch}.context_length"] = int(text["max_position_embeddings"])
    return details, model_info, models.inspect_model(info).chat_template or ""


def _find(name: str) -> models.ModelInfo | None:
    local = core._local_match(name)
    return next((m for m in models.list_models() if m.name == local), None) if local else None


def _listing(info: models.ModelInfo) -> dict[str, Any]:
    return {
        "name": info.name,
        "model": info.name,
        "modified_at": timestamp(info.path.stat().st_mtime),
        "size": info.size_bytes,
        "digest": _digest(info),
        "details": _name_details(info),
    }


def _embedding_listing() -> dict[str, Any]:
    details = {"parent_model": "", "format": "safetensors", "family": "bert", "families": ["bert"]}
    return {
        "name": MODEL_NAME,
        "model": MODEL_NAME,
        "modified_at": timestamp(0),
        "size": 0,
        "digest": hashlib.sha256(MODEL_NAME.encode()).hexdigest(),
        "details": {**details, "parameter_size": "22.71M", "quantization_level": "F32"},
    }


def tags() -> dict[str, Any]:
    """GET /api/tags: the local models, the loaded one first, then the embedding model."""
    found = {m.name: m for m in models.list_models()}
    listed = [_listing(found[name]) for name in loaded_first(list(found))]
    return {"models": [*listed, _embedding_listing()]}


def _loaded_info(details: dict[str, Any], model_info: dict[str, Any]) -> list[str]:
    """Update details and model_info with what the loaded backend knows; its capabilities."""
    backend = shared.model
    assert backend is not None
    meta = backend.metadata
    arch = str(model_info.get("general.architecture") or meta.architecture or details.get("family") or "")
    model_info["general.architecture"] = arch
    model_info[f"{arch}.context_length"] = backend.context_length  # the context it runs with, which prompts must fit
    details["family"] = details.get("family") or arch
    capabilities = ["completion", "tools"]
    if backend.fim_tokens() is not None:
        capabilities.append("insert")
    if backend.supports_vision:
        capabilities.append("vision")
    return capabilities


def _show(name: str, verbose: bool) -> dict[str, Any]:
    if name == MODEL_NAME:
        listing = _embedding_listing()
        return {
            "license": "apache-2.0",
            "modelfile": f"FROM {MODEL_NAME}\n",
            "parameters": "",
            "template": "",
            "details": listing["details"],
            "model_info": {
                "general.architecture": "bert",
                "bert.context_length": MAX_TOKENS,
                "bert.embedding_length": DIMENSIONS,
            },
            "capabilities": ["embedding"],
            "modified_at": listing["modified_at"],
        }
    info = _find(name)
    loaded = shared.model is not None and core._is_loaded(name)
    if info is None and not loaded:
        raise _not_found(name)
    capabilities = ["completion", "tools"]  # tools work with any model (see docs/api.md, Tools)
    if info is not None:
        details, model_info, template = _gguf_header(info, verbose) if info.format == "gguf" else _hf_header(info)
        modified = timestamp(info.path.stat().st_mtime)
        if any(k in model_info for k in ("tokenizer.ggml.fim_pre_token_id", "tokenizer.ggml.prefix_token_id")):
            capabilities.append("insert")
    else:  # a model a remote engine serves
        details, model_info, template, modified = {"format": "", "family": ""}, {}, "", timestamp()
    if loaded and shared.model is not None:
        capabilities = _loaded_info(details, model_info)
        template = shared.model.metadata.chat_template or template
    license_ = str(model_info.get("general.license", ""))
    return {
        "license": license_,
        "modelfile": f"# textgen serves models/{name}\nFROM {name}\n",
        "parameters": "",
        "template": template,
        "details": details,
        "model_info": model_info,
        "capabilities": capabilities,
        "modified_at": modified,
    }


async def show(req: ShowRequest) -> dict[str, Any]:
    """POST /api/show: a model's details, model_info (architecture, context length, ...), template, capabilities."""
    name = req.model or req.name
    if not name:
        raise APIError(400, "model is required")
    return await anyio.to_thread.run_sync(_show, model_name(name), req.verbose)


def ps() -> dict[str, Any]:
    """GET /api/ps: the loaded model, with the context it runs with."""
    backend, name = shared.model, shared.model_name
    if backend is None or not name:
        return {"models": []}
    info = _find(name)
    entry = _listing(info) if info is not None else {"name": name, "model": name, "size": 0, "details": {}}
    entry.pop("modified_at", None)
    return {"models": [{**entry, "expires_at": _FAR_FUTURE, "context_length": backend.context_length}]}


def version() -> dict[str, str]:
    """GET /api/version"""
    return {"version": OLLAMA_VERSION}
