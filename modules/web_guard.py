"""The web-origin guard: what a web page the user visits may make this server do (nothing it did not ask for).

One plain ASGI middleware, outermost, in front of the web UI and the API alike (HTTP, SSE and websockets):

- **Host allow-list** (DNS rebinding): a request whose ``Host`` is not an IP literal, ``localhost``, a
  ``*.localhost`` name, the ``--listen-host`` name or one of ``--allowed-hosts`` is answered 403, saying which
  flag to set. A page on ``attacker.example`` whose name was rebound to 127.0.0.1 sends ``Host:
  attacker.example``; a reverse proxy that keeps ``Host`` works once its name is declared.
- **Origin check**: a request that can change state or generate (any method but GET, HEAD and OPTIONS, and every
  websocket) whose ``Origin`` is neither the server's own (its scheme-less host and port equal ``Host``) nor one of
  ``--api-cors-origins`` is refused before any handler runs. Browsers send ``Origin`` on every such cross-site
  request, ``mode: "no-cors"`` fetches and HTML forms included, and a page cannot forge it. Clients that send no
  ``Origin`` (SDKs, curl) are not affected.
- **JSON means JSON from a browser**: on the API's JSON routes, a browser's POST (it carries ``Origin`` or
  ``Sec-Fetch-Site``) whose ``Content-Type`` is not JSON is refused unless it carries an API key: such a body needs
  no CORS preflight, so without this an allowed origin's page could be tricked by a form, and a page could send a
  body the server would read as JSON. curl's form default stays accepted from curl (no browser headers), as
  Ollama's examples need.

Preflights themselves are left to the API's PreflightGate and CORSMiddleware (a listed origin is granted).
"""

from __future__ import annotations

import ipaddress
import json
import logging
from collections.abc import Callable, Iterable
from urllib.parse import urlsplit

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

log = logging.getLogger(__name__)

SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
# The API's paths (OpenAI under /v1 and at the root, Anthropic's /messages, Ollama's /api, text-generation-webui's
# /internal): every one takes and gives JSON; the web UI has the rest.
API_PREFIXES = (
    "/v1/", "/chat/", "/completions", "/embeddings", "/models", "/responses", "/messages", "/metrics", "/api/",
    "/internal/",
)  # fmt: skip
_DEFAULT_PORTS = {"http": 80, "https": 443, "ws": 80, "wss": 443}


def split_host(value: str) -> tuple[str, int | None]:
    """``Host``-header form (``name``, ``name:port``, ``[v6]:port``) -> (lower-case name or address, port)."""
    value = value.strip().lower()
    if value.startswith("["):
        end = value.find("]")
        name, rest = value[1:end] if end > 0 else value[1:], value[end + 1 :] if end > 0 else ""
        port = rest[1:] if rest.startswith(":") else ""
    elif value.count(":") == 1:
        name, port = value.split(":")
    else:
        name, port = value, ""  # a bare IPv6 literal, or a name
    return name.rstrip("."), int(port) if port.isdigit() else None


def is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def host_allowed(name: str, declared: Iterable[str]) -> bool:
    """True for an IP literal, ``localhost``, ``*.localhost`` and the declared names (``*`` allows any; a declared
    ``.example.org`` allows that domain and every name under it)."""
    if not name or is_ip(name) or name == "localhost" or name.endswith(".localhost"):
        return True
    for entry in declared:
        entry = entry.strip().lower().rstrip(".")
        if entry == "*" or entry == name:
            return True
        if entry.startswith(".") and (name == entry[1:] or name.endswith(entry)):
            return True
    return False


def same_origin(origin: str, host: str) -> bool:
    """True when the page's ``Origin`` is this server as the request reached it (``Host``)."""
    parts = urlsplit(origin)
    if not parts.hostname:
        return False
    host_name, host_port = split_host(host)
    default = _DEFAULT_PORTS.get(parts.scheme)
    try:
        origin_port = parts.port or default
    except ValueError:
        return False
    return parts.hostname.lower() == host_name and origin_port == (host_port or default)


class WebOriginGuard:
    """The Host allow-list and the Origin and content-type checks (the module docstring has the rules)."""

    def __init__(
        self,
        app: ASGIApp,
        allowed_hosts: Callable[[], list[str]],
        cors_origins: Callable[[], list[str]],
        json_route: Callable[[str], bool],
    ) -> None:
        self.app = app
        self.allowed_hosts = allowed_hosts  # read per request: the settings may change after startup (tests)
        self.cors_origins = cors_origins
        self.json_route = json_route

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        refusal = self.check(scope, headers)
        if refusal is None:
            await self.app(scope, receive, send)
            return
        status, code, message = refusal
        log.warning("Refused %s %s: %s", scope.get("method", "WEBSOCKET"), scope["path"], message)
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008, "reason": message[:120]})
            return
        if scope["path"].startswith("/api/"):  # Ollama's error shape
            body: dict[str, object] = {"error": message}
        else:
            body = {"error": {"message": message, "type": "permission_error", "param": None, "code": code}}
        payload = json.dumps(body).encode()
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())],
            }
        )
        await send({"type": "http.response.body", "body": payload})

    def check(self, scope: Scope, headers: Headers) -> tuple[int, str, str] | None:
        """(status, code, message) when the request is refused, else None."""
        host = headers.get("host", "")
        name, _ = split_host(host)
        if host and not host_allowed(name, self.allowed_hosts()):
            return (
                403,
                "host_not_allowed",
                f"requests for the host name {name!r} are not allowed (a guard against DNS rebinding). If you reach "
                f"textgen by that name, start it with --allowed-hosts {name}",
            )
        method = scope.get("method", "GET") if scope["type"] == "http" else "WEBSOCKET"
        if method in SAFE_METHODS:
            return None
        origin = headers.get("origin")
        origins = self.cors_origins()
        if origin is not None and not (same_origin(origin, host) or "*" in origins or origin in origins):
            return (
                403,
                "cross_origin_request",
                f"a web page on {origin} may not send {method} requests to textgen. To allow that page, start textgen "
                f"with --api-cors-origins {origin}",
            )
        if (
            method == "POST"
            and self.json_route(scope["path"])
            and (origin is not None or "sec-fetch-site" in headers)
            and not _is_json(headers.get("content-type", ""))
            and not ("authorization" in headers or "x-api-key" in headers)
        ):
            return (
                415,
                "json_content_type_required",
                "a browser request to this API must send its body as Content-Type: application/json (or carry an "
                "API key)",
            )
        return None


def _is_json(content_type: str) -> bool:
    kind = content_type.split(";", 1)[0].strip().lower()
    return kind == "application/json" or (kind.startswith("application/") and kind.endswith("+json"))
