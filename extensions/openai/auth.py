"""API keys: --api-key for every endpoint, --admin-key for the admin ones (it never defaults to the API key).

| keys set                    | ordinary endpoints        | admin endpoints                               |
|-----------------------------|---------------------------|-----------------------------------------------|
| none                        | open                      | open (the single-user 127.0.0.1 default)      |
| --api-key only              | the API key               | 403: start the server with --admin-key        |
| --admin-key (+ --api-key)   | either key                | the admin key only                            |

Generations started through the API belong to the key that started them (:func:`caller_id`):
``/v1/internal/stop-generation`` stops only the caller's own, and everyone's with the admin key.
"""

from __future__ import annotations

import hashlib
import hmac
import logging

from fastapi import Request

from extensions.openai.errors import APIError
from modules import shared

log = logging.getLogger(__name__)

NO_ADMIN_KEY = (
    "Admin endpoints are off: the server was started with --api-key but without --admin-key, and the API key does "
    "not grant admin work. Restart it with --admin-key KEY and send that key to load or unload models and LoRAs, "
    "download models or switch the image pipeline."
)


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
    """Admin endpoints: 401 without a valid key, 403 without the admin key (always 403 with --api-key and no
    --admin-key); open when no key is set at all."""
    require_key(request)
    settings = shared.settings
    if settings.admin_key:
        if not _matches(presented_key(request), settings.admin_key):
            raise APIError(
                403,
                "This endpoint needs the admin key (--admin-key).",
                type_="permission_error",
                code="admin_key_required",
            )
    elif settings.api_key:
        raise APIError(403, NO_ADMIN_KEY, type_="permission_error", code="admin_key_not_set")


def is_admin(request: Request) -> bool:
    """True when the request may do admin work: it sends the admin key, or no key is configured at all."""
    settings = shared.settings
    if settings.admin_key:
        return _matches(presented_key(request), settings.admin_key)
    return not settings.api_key


def caller_id(request: Request) -> str:
    """Who a request is, for owning generations: ``api-`` and a hash of the key it sent (``api`` without one).

    With a single --api-key every holder of that key is the same caller; the server cannot tell them apart.
    """
    given = presented_key(request)
    if not given:
        return "api"
    return "api-" + hashlib.sha256(given.encode()).hexdigest()[:16]


def log_startup_notes() -> None:
    """Say once at startup when the admin endpoints are closed for lack of --admin-key, or open to the network."""
    settings = shared.settings
    if settings.exposed and not settings.api_key and not settings.admin_key:
        log.warning(
            "The API listens on %s with no --api-key: anyone on the network can generate, and load, unload and "
            "download models. Start with --api-key KEY --admin-key ADMIN_KEY (see SECURITY.md).",
            settings.host,
        )
    if shared.settings.api_key and not shared.settings.admin_key:
        log.warning(
            "--api-key is set without --admin-key: the API's admin endpoints (model and LoRA load/unload, "
            "downloads, model switching, image pipeline) answer 403. Start with --admin-key KEY to use them."
        )
