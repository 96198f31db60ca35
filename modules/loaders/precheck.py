"""Cheap checks of a model's files that backends run in ``Backend.check``, before the current model is unloaded.

They read headers only (a GGUF's tensor table, a safetensors file's JSON header) and compare the sizes those
headers declare with the files' real sizes, so a truncated download or a missing shard is refused in milliseconds
with a message that names the file, instead of failing inside the engine after the working model is gone.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from modules.errors import ModelLoadError
from modules.formats import gguf, safetensors

_SHARD = re.compile(r"^(?P<stem>.+)-(?P<index>\d{5})-of-(?P<count>\d{5})\.gguf$", re.IGNORECASE)
INCOMPLETE = "download it again (an interrupted download or copy leaves a file like this)"


def _check_gguf_one(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ModelLoadError(f"{path.name} is missing")
    try:
        meta, tensors, start = gguf.read_header(path)
        if not tensors and int(meta.get("split.count", 1) or 1) <= 1:
            raise gguf.GGUFError(f"{path.name} holds no tensors")
        end = gguf.data_end(tensors, start)
    except gguf.GGUFError as exc:
        raise ModelLoadError(f"{exc}; {INCOMPLETE}") from exc
    size = path.stat().st_size
    if end > size:
        raise ModelLoadError(
            f"{path.name} is truncated: its header declares {end:,} bytes of tensor data, the file has {size:,}; "
            + INCOMPLETE
        )
    return meta


def gguf_file(path: Path) -> None:
    """Refuse a GGUF file that is missing, not GGUF, truncated, or split with a shard missing or truncated."""
    if path.is_dir():
        raise ModelLoadError(
            f"{path.name} is a folder; this loader reads a .gguf file (a Hugging Face folder loads with transformers)"
        )
    if not path.exists():
        raise ModelLoadError(f"{path} does not exist")
    meta = _check_gguf_one(path)
    count = int(meta.get("split.count", 1) or 1)
    shard = _SHARD.match(path.name)
    if count <= 1 or shard is None:
        return
    for index in range(2, count + 1):
        part = path.with_name(f"{shard['stem']}-{index:05d}-of-{count:05d}.gguf")
        if not part.is_file():
            raise ModelLoadError(f"{path.name} is split in {count} files and {part.name} is missing")
        _check_gguf_one(part)


def _safetensors(path: Path) -> None:
    try:
        header, start = safetensors.read_header(path)
    except safetensors.SafetensorsError as exc:
        raise ModelLoadError(f"{exc}; {INCOMPLETE}") from exc
    need, size = safetensors.data_end(header, start), path.stat().st_size
    if need > size:
        raise ModelLoadError(
            f"{path.name} is truncated: its header declares {need:,} bytes, the file has {size:,}; {INCOMPLETE}"
        )


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{path.parent.name}/{path.name} cannot be read: {exc}") from exc
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path.parent.name}/{path.name} is not a JSON object")
    return data


def folder_config(path: Path) -> dict[str, Any]:
    """A model folder's config.json; ModelLoadError when ``path`` is not a folder or the file is unreadable."""
    if path.is_file():
        raise ModelLoadError(f"{path.name} is a file; this loader reads a model folder (a .gguf loads with llama.cpp)")
    if not path.is_dir():
        raise ModelLoadError(f"{path} does not exist")
    return _read_json(path / "config.json")


def hf_folder(path: Path) -> None:
    """Refuse a model folder without a readable config.json, without weights, or with a shard missing/truncated."""
    folder_config(path)
    shards: set[str] = set()
    for index in sorted(path.glob("*.index.json")):
        weight_map = _read_json(index).get("weight_map")
        if isinstance(weight_map, dict):
            shards.update(str(v) for v in weight_map.values())
    for name in sorted(shards):
        if not (path / name).is_file():
            raise ModelLoadError(f"{path.name}/{name} is missing (the index lists it); {INCOMPLETE}")
    tensors = sorted(path.glob("*.safetensors"))
    if not tensors and not any(path.glob("*.bin")) and not any(path.glob("*.pt")):
        raise ModelLoadError(f"{path.name} holds no weights (*.safetensors or *.bin)")
    for file in tensors:
        _safetensors(file)
