"""Text-to-image with a local diffusers pipeline folder from models/ (loaded once, kept until another is asked for)."""

from __future__ import annotations

import json
import logging
import re
import threading
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from modules import shared
from modules.errors import InvalidRequest, ModelNotFound
from modules.fileio import atomic_write_bytes
from modules.paths import UnsafePath, safe_child

log = logging.getLogger(__name__)
_lock = threading.Lock()
_loaded: tuple[str, Path, Any] | None = None  # name, folder, pipeline
# Bounds for every caller (API, chat trigger, tab): a request beyond them is a 400 naming the field.
MAX_N = 8  # images per request
MAX_STEPS = 150  # denoising steps
MAX_SIDE = 1024  # pixels, width or height
MAX_PIXELS = 1024 * 1024  # width x height


@dataclass
class Picture:
    """A generated image saved under user_data/cache/chat-images/generated."""

    id: str
    path: Path
    png: bytes


def pipelines() -> list[str]:
    """Folders in models/ that are diffusers pipelines (they have a model_index.json)."""
    root = shared.models_dir()
    return sorted(p.parent.name for p in root.glob("*/model_index.json")) if root.is_dir() else []


def images_dir() -> Path:
    """Where generated images are kept: beside the chat's pictures, so the web UI shows them through its own file
    route (which --gradio-auth guards) and the API's /v1/images/files needs the API key."""
    from modules.chat.history import images_dir as chat_images

    return chat_images() / "generated"


def image_path(name: str) -> Path:
    """A generated image's file by name (``ID.png``); nothing outside the folder."""
    if not re.fullmatch(r"[0-9a-f]{32}\.png", name):
        raise ModelNotFound(f"no image named {name!r}")
    try:
        return safe_child(images_dir(), name)
    except UnsafePath as exc:
        raise ModelNotFound(str(exc)) from exc


def _pipeline(name: str) -> Any:
    global _loaded
    try:
        folder = safe_child(shared.models_dir(), name)
    except UnsafePath as exc:
        raise InvalidRequest(f"invalid image model name: {exc}", param="model") from exc
    if _loaded is not None and _loaded[:2] == (name, folder):
        return _loaded[2]
    if not (folder / "model_index.json").is_file():
        available = ", ".join(pipelines()) or "none"
        raise ModelNotFound(f"no diffusers pipeline named {name!r} in {shared.models_dir()} (available: {available})")
    try:
        json.loads((folder / "model_index.json").read_text())
    except ValueError as exc:
        raise InvalidRequest(f"{name}/model_index.json is not valid JSON", param="model") from exc
    import torch
    from diffusers import DiffusionPipeline

    _loaded = None  # free the previous pipeline first
    pipe = DiffusionPipeline.from_pretrained(str(folder), local_files_only=True, dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    _loaded = (name, folder, pipe)
    log.info("Loaded image pipeline %s (%s)", name, type(pipe).__name__)
    return pipe


def current_pipeline() -> str | None:
    """The name of the pipeline in memory, if one is (and it is from the models folder in use)."""
    if _loaded is None:
        return None
    try:
        return _loaded[0] if safe_child(shared.models_dir(), _loaded[0]) == _loaded[1] else None
    except UnsafePath:
        return None


def check_size(width: int, height: int, param: str = "size") -> None:
    """Width and height: multiples of 8, each 8..MAX_SIDE, together at most MAX_PIXELS."""
    if (
        width % 8
        or height % 8
        or not 8 <= width <= MAX_SIDE
        or not 8 <= height <= MAX_SIDE
        or width * height > MAX_PIXELS
    ):
        raise InvalidRequest(
            f"width and height must be multiples of 8 between 8 and {MAX_SIDE}, at most {MAX_SIDE}x{MAX_SIDE} "
            f"pixels (got {width}x{height})",
            param=param,
        )


def parse_size(size: Any, default: tuple[int, int]) -> tuple[int, int]:
    """'WIDTHxHEIGHT' -> (width, height), multiples of 8, at most 1024x1024."""
    if size is None or size == "" or size == "auto":
        return default
    match = re.fullmatch(r"(\d+)x(\d+)", size.strip()) if isinstance(size, str) else None
    if not match:
        raise InvalidRequest("size must look like 512x512", param="size")
    width, height = int(match.group(1)), int(match.group(2))
    check_size(width, height)
    return width, height


def bounded_int(value: Any, name: str, low: int, high: int | None = None) -> int:
    """A request's integer field: an int (or a string of digits) within ``low..high``, else a 400 naming it."""
    if isinstance(value, str) and re.fullmatch(r"\s*-?\d+\s*", value):
        value = int(value)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequest(f"{name} must be an integer, not {value!r}", param=name)
    if value < low or (high is not None and value > high):
        where = f"between {low} and {high}" if high is not None else f"at least {low}"
        raise InvalidRequest(f"{name} must be {where} (got {value})", param=name)
    return value


def generate(
    prompt: str,
    model: str,
    *,
    n: int = 1,
    width: int = 512,
    height: int = 512,
    steps: int = 20,
    seed: int | None = None,
    negative_prompt: str | None = None,
) -> list[Picture]:
    """Generate ``n`` images and save them as PNG files."""
    import io

    import torch

    if not prompt.strip():
        raise InvalidRequest("prompt must not be empty", param="prompt")
    bounded_int(n, "n", 1, MAX_N)
    bounded_int(steps, "steps", 1, MAX_STEPS)
    check_size(width, height, "size")
    with _lock:
        pipe = _pipeline(model)
        generator = torch.Generator("cpu").manual_seed(seed) if seed is not None and seed >= 0 else None
        result = pipe(
            prompt=prompt,
            negative_prompt=negative_prompt or None,
            num_images_per_prompt=n,
            width=width,
            height=height,
            num_inference_steps=steps,
            generator=generator,
        )
    pictures = []
    for image in result.images:
        buffer = io.BytesIO()
        image.save(buffer, format="PNG")
        picture_id = uuid.uuid4().hex
        path = images_dir() / f"{picture_id}.png"
        atomic_write_bytes(path, buffer.getvalue())
        pictures.append(Picture(picture_id, path, buffer.getvalue()))
    return pictures
