"""A GGUF model's metadata as the loaders see it (from its header, via ``modules.formats.gguf``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from modules.formats.gguf import GGUFError, data_end, read_header
from modules.loaders.base import ModelMetadata

__all__ = ["SAMPLING_KEYS", "GGUFError", "read_metadata"]

# llama.cpp's recommended-sampling keys (general.sampling.*) -> GenerationParams fields
SAMPLING_KEYS = {
    "temp": "temperature",
    "top_k": "top_k",
    "top_p": "top_p",
    "min_p": "min_p",
    "xtc_probability": "xtc_probability",
    "xtc_threshold": "xtc_threshold",
    "penalty_repeat": "repetition_penalty",
    "penalty_last_n": "repetition_penalty_range",
    "mirostat": "mirostat_mode",
    "mirostat_tau": "mirostat_tau",
    "mirostat_eta": "mirostat_eta",
}


def _plain(value: Any) -> Any:
    """A numpy scalar as the Python number it holds."""
    return value.item() if hasattr(value, "item") else value


def read_metadata(path: Path) -> ModelMetadata:
    """Parse and check a GGUF model; raise GGUFError if it is not complete and well formed."""
    meta, tensors, start = read_header(path)
    if not tensors:
        raise GGUFError(f"{path.name} holds no tensors")
    end = data_end(tensors, start)
    size = path.stat().st_size
    if end > size:
        raise GGUFError(f"{path.name} is truncated: its tensors need {end} bytes, the file has {size}")
    arch = str(meta.get("general.architecture", ""))
    result = ModelMetadata(name=str(meta.get("general.name") or path.stem), architecture=arch)
    ctx = meta.get(f"{arch}.context_length")
    result.context_length = int(ctx) if ctx is not None else None
    template = meta.get("tokenizer.chat_template")
    result.chat_template = str(template) if template else None
    tokens = meta.get("tokenizer.ggml.tokens") or []

    def token_text(token_id: Any) -> str:
        return str(tokens[token_id]) if isinstance(token_id, int) and 0 <= token_id < len(tokens) else ""

    bos, eos = meta.get("tokenizer.ggml.bos_token_id"), meta.get("tokenizer.ggml.eos_token_id")
    result.bos_token_id = int(bos) if bos is not None else None
    result.eos_token_ids = [int(eos)] if eos is not None else []
    result.bos_token, result.eos_token = token_text(bos), token_text(eos)
    add_bos = meta.get("tokenizer.ggml.add_bos_token")
    result.add_bos_token = bool(add_bos) if add_bos is not None else True
    result.extra = {"file_type": meta.get("general.file_type"), "tensors": len(tensors)}
    result.sampling = {
        name: _plain(meta[f"general.sampling.{key}"])
        for key, name in SAMPLING_KEYS.items()
        if f"general.sampling.{key}" in meta
    }
    return result
