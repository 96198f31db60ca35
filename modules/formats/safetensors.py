"""A safetensors file's JSON header (names, dtypes, shapes, data offsets), read without touching tensor data."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

MAX_HEADER = 100 * 2**20  # the format's own limit


class SafetensorsError(ValueError):
    """The file is not a complete, readable safetensors file."""


def read_header(path: Path) -> tuple[dict[str, Any], int]:
    """(the header, the offset where tensor data starts); SafetensorsError when unreadable or not safetensors."""
    try:
        with open(path, "rb") as handle:
            raw = handle.read(8)
            if len(raw) != 8:
                raise SafetensorsError(f"{path.name} is empty or truncated (no safetensors header)")
            (length,) = struct.unpack("<Q", raw)
            if length > MAX_HEADER or 8 + length > path.stat().st_size:
                raise SafetensorsError(f"{path.name} is not a complete safetensors file (header of {length} bytes)")
            header = json.loads(handle.read(length))
    except OSError as exc:
        raise SafetensorsError(f"cannot read {path.name}: {exc.strerror or exc}") from exc
    except ValueError as exc:
        if isinstance(exc, SafetensorsError):
            raise
        raise SafetensorsError(f"{path.name} has a corrupt safetensors header") from exc
    if not isinstance(header, dict):
        raise SafetensorsError(f"{path.name} has a corrupt safetensors header")
    return header, 8 + length


def data_end(header: dict[str, Any], start: int) -> int:
    """The byte offset where the file's last tensor ends, as its header declares."""
    ends = [
        int(info["data_offsets"][1])
        for name, info in header.items()
        if name != "__metadata__" and isinstance(info, dict) and isinstance(info.get("data_offsets"), list)
    ]
    return start + max(ends, default=0)
