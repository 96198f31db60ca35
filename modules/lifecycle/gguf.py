"""Read and check GGUF files without loading them: header, metadata and tensor table, in milliseconds."""

from __future__ import annotations

import mmap
import struct
from pathlib import Path
from typing import Any

from modules.loaders.base import ModelMetadata

GGUF_MAGIC = b"GGUF"
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_MAX_STRING = 1 << 30


class GGUFError(ValueError):
    """The file is not a readable GGUF model."""


class _Cursor:
    def __init__(self, data: Any, name: str) -> None:
        self.data, self.pos, self.name = data, 0, name

    def take(self, n: int) -> bytes:
        if n < 0 or self.pos + n > len(self.data):
            raise GGUFError(f"{self.name} is truncated or corrupt (header runs past the end of the file)")
        chunk = self.data[self.pos : self.pos + n]
        self.pos += n
        return bytes(chunk)

    def unpack(self, fmt: str) -> Any:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        length = self.unpack("<Q")
        if length > _MAX_STRING:
            raise GGUFError(f"{self.name} is corrupt (a string claims {length} bytes)")
        return self.take(length).decode("utf-8", errors="replace")

    def value(self, kind: int, keep: bool = True) -> Any:
        if kind in _SCALARS:
            return self.unpack(_SCALARS[kind])
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item_kind, count = self.unpack("<I"), self.unpack("<Q")
            if item_kind in _SCALARS:
                size = struct.calcsize(_SCALARS[item_kind])
                raw = self.take(size * count)
                if not keep:
                    return None
                return list(struct.unpack(f"<{count}{_SCALARS[item_kind][1]}", raw))
            if item_kind == _STRING:
                strings = [self.string() for _ in range(count)]
                return strings if keep else None
            if item_kind == _ARRAY:
                return [self.value(_ARRAY, keep) for _ in range(count)]
        raise GGUFError(f"{self.name} is corrupt (unknown value type {kind})")


def read_header(path: Path) -> tuple[dict[str, Any], list[dict[str, Any]], int]:
    """(metadata, tensor infos, data start offset); raises GGUFError for anything malformed or truncated."""
    try:
        handle = open(path, "rb")
    except OSError as exc:
        raise GGUFError(f"cannot read {path.name}: {exc.strerror or exc}") from exc
    with handle:
        size = path.stat().st_size
        if size < 24:
            raise GGUFError(f"{path.name} is not a GGUF file (only {size} bytes)")
        with mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as data:
            cur = _Cursor(data, path.name)
            if cur.take(4) != GGUF_MAGIC:
                raise GGUFError(f"{path.name} is not a GGUF file (it does not start with 'GGUF')")
            version = cur.unpack("<I")
            if version not in (2, 3):
                raise GGUFError(f"{path.name}: unsupported GGUF version {version}")
            n_tensors, n_kv = cur.unpack("<Q"), cur.unpack("<Q")
            if n_tensors > 1 << 24 or n_kv > 1 << 24:
                raise GGUFError(f"{path.name} is corrupt (claims {n_tensors} tensors and {n_kv} keys)")
            meta: dict[str, Any] = {}
            for _ in range(n_kv):
                key = cur.string()
                kind = cur.unpack("<I")
                meta[key] = cur.value(kind, keep=key != "tokenizer.ggml.merges")
            tensors = []
            for _ in range(n_tensors):
                name = cur.string()
                n_dims = cur.unpack("<I")
                if n_dims > 8:
                    raise GGUFError(f"{path.name} is corrupt (tensor {name!r} has {n_dims} dimensions)")
                dims = [cur.unpack("<Q") for _ in range(n_dims)]
                tensors.append({"name": name, "shape": dims, "type": cur.unpack("<I"), "offset": cur.unpack("<Q")})
            alignment = int(meta.get("general.alignment", 32)) or 32
            start = (cur.pos + alignment - 1) // alignment * alignment
    return meta, tensors, start


def _tensor_bytes(info: dict[str, Any]) -> int:
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(info["type"])]
    except (ValueError, KeyError) as exc:
        raise GGUFError(f"tensor {info['name']!r} has an unknown type {info['type']}") from exc
    count = 1
    for dim in info["shape"]:
        count *= dim
    return count // block * type_size


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
    end = start + max(int(t["offset"]) + _tensor_bytes(t) for t in tensors)
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


def requantize(source: Path, target: Path, ftype: int, allow_requantize: bool = True) -> Path:
    """Write ``source`` in another llama.cpp file type (1 = F16, 7 = Q8_0, ...) with llama_model_quantize."""
    import ctypes

    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.allow_requantize = allow_requantize
    tmp = target.with_name(f".{target.name}.writing")
    code = llama_cpp.llama_model_quantize(str(source).encode(), str(tmp).encode(), ctypes.byref(params))
    if code != 0 or not tmp.is_file():
        tmp.unlink(missing_ok=True)
        raise GGUFError(f"llama.cpp could not write {target.name} (code {code})")
    tmp.replace(target)
    return target
