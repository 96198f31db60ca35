"""Images sent with chat messages: decoded from data URLs, fetched from http(s) URLs, or read from files."""

from __future__ import annotations

import base64
import binascii
import io
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


def load_image(source: str, param: str = "image") -> Any:
    """A PIL image from a data URL, an http(s) URL (10 s, 20 MiB at most) or a file path."""
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
    path = Path(source)
    if path.is_file():
        return _open(path.read_bytes(), param)
    raise InvalidRequest("an image must be a data URL, an http(s) URL or a file", param=param)
