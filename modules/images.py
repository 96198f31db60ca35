"""Images sent with chat messages: decoded from data URLs, fetched from http(s) URLs, or read from files."""

from __future__ import annotations

import base64
import binascii
import io
import os
from pathlib import Path
from typing import Any

from modules.errors import InvalidRequest

MAX_BYTES = 20 * 2**20


def _open(data: bytes, param: str) -> Any:
    from PIL import Image, UnidentifiedImageError

    if len(data) > MAX_BYTES:
        raise InvalidRequest(f"the image is larger than {MAX_BYTES // 2**20} MiB", param=param)
    try:
        image = Image.open(io.BytesIO(data))
        image.load()
    except (UnidentifiedImageError, OSError) as exc:
        raise InvalidRequest(f"not an image: {exc}", param=param) from exc
    return image.convert("RGB")


def load_image(source: str, param: str = "image", files_in: Path | None = None) -> Any:
    """A PIL image from a data URL, an http(s) URL (10 s, 20 MiB at most) or, given ``files_in``, a file there.

    File paths come only from textgen itself (pictures stored with chat messages); a path from a client or an
    uploaded history is refused, so nobody can make the server read its other files.
    """
    if source.startswith("data:"):
        header, _, payload = source.partition(",")
        if ";base64" not in header:
            raise InvalidRequest("image data URLs must be base64", param=param)
        try:
            return _open(base64.b64decode(payload, validate=True), param)
        except binascii.Error as exc:
            raise InvalidRequest(f"the image's base64 is invalid: {exc}", param=param) from exc
    if source.startswith(("http://", "https://")):
        import httpx

        try:
            response = httpx.get(source, timeout=10, follow_redirects=True)
            response.raise_for_status()
        except httpx.HTTPError as exc:
            raise InvalidRequest(f"could not fetch the image: {exc}", param=param) from exc
        return _open(response.content, param)
    if files_in is not None and in_folder(source, files_in):
        path = Path(source)
        if path.is_file():
            return _open(path.read_bytes(), param)
        raise InvalidRequest(f"the picture {path.name} is no longer stored", param=param)
    raise InvalidRequest("an image must be a data URL or an http(s) URL", param=param)


def in_folder(source: str, folder: Path) -> bool:
    """True when the path ``source`` lies inside ``folder`` (lexically, after resolving ``..``)."""
    base = os.path.abspath(folder)
    target = os.path.abspath(source)
    return os.path.commonpath([base, target]) == base and target != base
