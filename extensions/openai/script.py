"""The OpenAI-compatible API, as an extension: it adds its routes through the ``api_routes`` hook."""

from __future__ import annotations

from typing import Any

params = {"display_name": "OpenAI API", "is_tab": False}


def setup() -> None:
    """At startup: warn when --api-key is set without --admin-key (the admin endpoints then answer 403)."""
    from extensions.openai.auth import log_startup_notes

    log_startup_notes()


def api_routes(app: Any) -> None:
    """Serve /v1/chat/completions, /v1/completions, /v1/models, /v1/embeddings, /v1/responses, /v1/messages,
    text-generation-webui's /v1/internal/* and /metrics on the server's port."""
    from extensions.openai.routes import install

    install(app)
