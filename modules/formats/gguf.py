"""A GGUF file's metadata and tensor table, read from its header in milliseconds.

The value and tensor type codes, their block sizes and the default alignment are gguf-py's (``gguf.constants``,
the package llama.cpp keeps). Its ``GGUFReader`` is what quantize and the tests use to look at tensor data; the
header here is read by this small cursor instead because ``GGUFReader`` builds a numpy view for every element of
every array field (each of a vocabulary's 49k tokens and merges): 20x slower on the default model, and model lists,
loads and ``/api/show`` read headers often. ``tests/unit/test_formats.py`` checks that both readers agree.
"""

from __future__ import annotations

import mmap
import struct
from pathlib import Path
from typing import Any

_MAGIC = b"GGUF"
_MAX_STRING = 1 << 30
_SKIPPED = {"tokenizer.ggml.merges"}  # read past, not kept: nothing here needs them and they are the largest field


class GGUFError(ValueError):
    """The file is not a readable GGUF model."""


def _scalar_formats() -> dict[int, str]:
    from gguf.constants import GGUFValueType as T

    return {
        T.UINT8: "<B",
        T.INT8: "<b",
        T.UINT16: "<H",
        T.INT16: "<h",
        T.UINT32: "<I",
        T.INT32: "<i",
        T.FLOAT32: "<f",
        T.BOOL: "<?",
        T.UINT64: "<Q",
        T.INT64: "<q",
        T.FLOAT64: "<d",
    }


class _Cursor:
    def __init__(self, data: Any, name: str) -> None:
        from gguf.constants import GGUFValueType

        self.data, self.pos, self.name = data, 0, name
        self.scalars = _scalar_formats()
        self.string_type, self.array_type = int(GGUFValueType.STRING), int(GGUFValueType.ARRAY)

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
        if kind in self.scalars:
            return self.unpack(self.scalars[kind])
        if kind == self.string_type:
            return self.string()
        if kind == self.array_type:
            item_kind, count = self.unpack("<I"), self.unpack("<Q")
            if item_kind in self.scalars:
                size = struct.calcsize(self.scalars[item_kind])
                raw = self.take(size * count)
                if not keep:
                    return None
                return list(struct.unpack(f"<{count}{self.scalars[item_kind][1]}", raw))
            if item_kind == self.string_type:
                strings = [self.string() for _ in range(count)]
                return strings if keep else None
            if item_kind == self.array_type:
                return [self.value(self.array_type, keep) for _ in range(count)]
        raise GGUFError(f"{self.name} is corrupt (unknown value type {kind})")


def read_header(path: Path) -> tuple[dict[str, Any], list[dict[str, Any]], int]:
    """(metadata, tensor infos, data start offset); raises GGUFError for anything malformed or truncated.

    A tensor info is ``{"name", "shape", "type", "offset"}`` (shape innermost first, as in the file; offset from
    the data start). ``tokenizer.ggml.merges`` is read past and left out of the metadata.
    """
    from gguf.constants import GGUF_DEFAULT_ALIGNMENT

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
            if cur.take(4) != _MAGIC:
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
                value = cur.value(kind, keep=key not in _SKIPPED)
                if key not in _SKIPPED:
                    meta[key] = value
            tensors = []
            for _ in range(n_tensors):
                name = cur.string()
                n_dims = cur.unpack("<I")
                if n_dims > 8:
                    raise GGUFError(f"{path.name} is corrupt (tensor {name!r} has {n_dims} dimensions)")
                dims = [cur.unpack("<Q") for _ in range(n_dims)]
                tensors.append({"name": name, "shape": dims, "type": cur.unpack("<I"), "offset": cur.unpack("<Q")})
            alignment = meta.get("general.alignment", GGUF_DEFAULT_ALIGNMENT)
            if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
                raise GGUFError(f"{path.name} is corrupt (alignment {alignment!r} is not a power of two)")
            start = (cur.pos + alignment - 1) // alignment * alignment
    return meta, tensors, start


def tensor_bytes(info: dict[str, Any]) -> int:
    """How many bytes a tensor of the table takes (its GGML type's block size and bytes per block)."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(info["type"])]
    except (ValueError, KeyError) as exc:
        raise GGUFError(
            f"tensor {info['name']!r} has type {info['type']}, which this llama.cpp (gguf-py) does not know"
        ) from exc
    count = 1
    for dim in info["shape"]:
        count *= int(dim)
    return count // block * type_size


def data_end(tensors: list[dict[str, Any]], start: int) -> int:
    """The byte offset where the file's last tensor ends (``start`` when the table is empty)."""
    return max((start + int(t["offset"]) + tensor_bytes(t) for t in tensors), default=start)
