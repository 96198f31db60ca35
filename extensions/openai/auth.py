"""API keys: --api-key for every endpoint, --admin-key (default: the API key) for admin ones."""

from __future__ import annotations

import hmac

from fastapi import Request

from extensions.openai.errors import APIError
from modules import shared


def presented_key(request: Request) -> str | None:
    """The key a client sent, as ``Authorization: Bearer K`` or ``x-api-key: K``."""
    header = request.headers.get("authorization", "")
    if header.lower().startswith("bearer "):
        return header[7:].strip()
    return request.headers.get("x-api-key")


def _matches(given: str | None, expected: str) -> bool:
    return given is not None and hmac.compare_digest(given.encode(), expected.encode())


def require_key(request: Request) -> None:
    """401 unless the request carries the API key (or the admin key); open when no key is set."""
    settings = shared.settings
    keys = [k for k in (settings.api_key, settings.admin_key) if k]
    if not keys:
        return
    given = presented_key(request)
    if not any(_matches(given, k) for k in keys):
        raise APIError(
            401,
            "Missing API key: send 'Authorization: Bearer KEY' or 'x-api-key: KEY'"
            if given is None
            else "Incorrect API key provided.",
            type_="authentication_error",
            code="invalid_api_key",
        )


def require_admin(request: Request) -> None:
    """Admin endpoints (load/unload models and LoRAs): 401 without a valid key, 403 without the admin key."""
    require_key(request)
    admin = shared.settings.admin_key or shared.settings.api_key
    if admin and not _matches(presented_key(request), admin):
        raise APIError(
            403, "This endpoint needs the admin key (--admin-key).", type_="permission_error", code="admin_key_required"
        )


def is_admin(request: Request) -> bool:
    """True when the request may do admin work."""
    admin = shared.settings.admin_key or shared.settings.api_key
    return not admin or _matches(presented_key(request), admin)
