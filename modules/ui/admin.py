"""Who may change the server from the web UI, in one rule, and the guard every such handler goes through.

The rule (:func:`is_ui_admin`): without ``--gradio-auth`` the one local user is the admin (the server listens on
127.0.0.1 unless told otherwise); with it, only the users named in ``--gradio-admin`` are. Everyone else may chat,
generate in the notebooks and use presets in their own page, but not load models, apply LoRAs, download, export,
train, switch extensions or save settings: those handlers are wrapped in :func:`admin_only`, which refuses on the
server (a warning, and nothing changes), whatever the page sends. The page also greys those controls out for
non-admins (:func:`admin_control`, :func:`page_load`).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import typing
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import gradio as gr

from modules import shared
from modules.settings import Settings

F = TypeVar("F", bound=Callable[..., Any])
C = TypeVar("C")

NOT_ADMIN = "Only an admin can {action}: {user} is not one (the admins are the users named in --gradio-admin)."


def auth_enabled(settings: Settings | None = None) -> bool:
    """True when the web UI asks for a login (--gradio-auth or --gradio-auth-path)."""
    settings = settings or shared.settings
    return bool(settings.gradio_auth or settings.gradio_auth_path) and bool(settings.auth_pairs())


def username(request: gr.Request | None) -> str | None:
    """The signed-in user of a request, or None without logins."""
    name = getattr(request, "username", None) if request is not None else None
    return str(name) if name else None


def is_ui_admin(request: gr.Request | None) -> bool:
    """May this request change the server for everyone? Without logins: yes; with them: only --gradio-admin users."""
    settings = shared.settings
    if not auth_enabled(settings):
        return True
    name = username(request)
    return name is not None and name in settings.gradio_admin


def _refuse(action: str, request: gr.Request | None) -> None:
    """Tell the user why nothing happened: a warning toast in a queued event, an error where there is no queue."""
    from gradio.context import LocalContext

    user = username(request)
    message = NOT_ADMIN.format(action=action, user=user if user else "a user who is not signed in")
    if LocalContext.event_id.get(None) is None:  # queue=False events cannot show a warning
        raise gr.Error(message, title="Admin only", print_exception=False)
    gr.Warning(message, title="Admin only")


def _with_request(fn: Callable[..., Any]) -> tuple[inspect.Signature, dict[str, Any], int | None]:
    """The signature Gradio should see (a gr.Request first unless ``fn`` takes one), and the index of fn's own.

    Its annotations are the resolved classes: Gradio finds the gr.Request (and gr.EventData) parameters by them, and
    would resolve strings against this module's globals, not ``fn``'s (a closure's hints may not resolve at all).
    """
    signature = inspect.signature(fn)
    try:
        hints = typing.get_type_hints(fn)
    except (NameError, TypeError):
        hints = {}
    params, own = [], None
    for index, param in enumerate(signature.parameters.values()):
        annotation = hints.get(param.name, param.annotation)
        if annotation in (gr.Request, gr.Request | None, "gr.Request", "gr.Request | None"):
            annotation, own = gr.Request, index if own is None else own
        elif isinstance(annotation, str):
            annotation = inspect.Parameter.empty
        params.append(param.replace(annotation=annotation))
    if own is None:
        params.insert(0, inspect.Parameter("request", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=gr.Request))
    shown = signature.replace(parameters=params, return_annotation=inspect.Signature.empty)
    annotations = {p.name: p.annotation for p in params if p.annotation is not inspect.Parameter.empty}
    return shown, annotations, own


def admin_only(action: str) -> Callable[[F], F]:
    """Wrap an event handler so that a non-admin's call changes nothing and says so; ``action`` completes
    "Only an admin can ...". Works for plain functions and generators, with or without their own gr.Request."""

    def decorate(fn: F) -> F:
        signature, annotations, own = _with_request(fn)

        def split(args: tuple[Any, ...]) -> tuple[Any, tuple[Any, ...]]:
            if own is None:
                return args[0], args[1:]
            return args[own], args

        if inspect.isgeneratorfunction(fn):

            @functools.wraps(fn)
            def stream(*args: Any) -> Iterator[Any]:
                request, passed = split(args)
                if not is_ui_admin(request):
                    _refuse(action, request)
                    yield gr.skip()
                    return
                yield from fn(*passed)

            wrapper: Any = stream
        else:

            @functools.wraps(fn)
            def call(*args: Any) -> Any:
                request, passed = split(args)
                if not is_ui_admin(request):
                    _refuse(action, request)
                    return gr.skip()
                return fn(*passed)

            wrapper = call
        wrapper.__signature__ = signature
        wrapper.__annotations__ = annotations
        del wrapper.__wrapped__  # Gradio must see the signature above, with the request
        return wrapper  # type: ignore[no-any-return]

    return decorate


_collectors: list[list[Any]] = []


@contextlib.contextmanager
def collecting() -> Iterator[list[Any]]:
    """Gather the components marked with :func:`admin_control` while the UI is built inside this block."""
    found: list[Any] = []
    _collectors.append(found)
    try:
        yield found
    finally:
        _collectors.pop()


def admin_control(component: C) -> C:
    """Mark a control that only admins can use: it is greyed out when a non-admin opens the page."""
    if _collectors:
        _collectors[-1].append(component)
    return component


def notice_text(request: gr.Request | None) -> str:
    """What a signed-in non-admin is told at the top of the page ('' for an admin)."""
    if is_ui_admin(request):
        return ""
    return (
        f"Signed in as **{username(request) or 'unknown'}** (not an admin): you can chat, generate in the notebooks "
        "and pick presets for your page. Loading models, LoRAs, downloads, exports, training, extensions and "
        "saving settings are for the users named in --gradio-admin."
    )


def page_load(controls: list[Any]) -> Callable[[gr.Request], Any]:
    """The page-load event: for a non-admin, show the notice and grey out ``controls`` (the notice is output 0)."""

    def on_load(request: gr.Request) -> Any:
        text = notice_text(request)
        if not text:
            return gr.skip()
        return [gr.update(value=text, visible=True), *[gr.update(interactive=False) for _ in controls]]

    return on_load


def is_exposed(settings: Settings) -> bool:
    """True when the server listens beyond this machine (--listen or a non-loopback --listen-host)."""
    return settings.exposed


def exposure_text(settings: Settings | None = None) -> str:
    """The warning for a server anyone on the network can use and administer, or '' when it is not one."""
    settings = settings or shared.settings
    if not is_exposed(settings) or auth_enabled(settings):
        return ""
    return (
        f"**Warning:** this server listens on {settings.host} without --gradio-auth: anyone who can reach it on the "
        "network can use it and administer it (load models, enable extensions, train, change settings). Restart it "
        "with --gradio-auth USER:PASSWORD --gradio-admin USER, or without --listen."
    )


def startup_warnings(settings: Settings) -> list[str]:
    """Warnings for the log when the web UI starts: open to the network, nobody an admin, unknown admin names."""
    found = []
    exposed = exposure_text(settings)
    if exposed:
        found.append(exposed.replace("**", ""))
    if auth_enabled(settings):
        users = {user for user, _ in settings.auth_pairs()}
        if not settings.gradio_admin:
            found.append(
                "--gradio-auth is set without --gradio-admin: nobody can load models, train, switch extensions or "
                "save settings from the web UI (name the admins with --gradio-admin USER ...)."
            )
        unknown = [name for name in settings.gradio_admin if name not in users]
        if unknown:
            found.append(f"--gradio-admin names users that have no login in --gradio-auth: {', '.join(unknown)}.")
    elif settings.gradio_admin:
        found.append("--gradio-admin has no effect without --gradio-auth: the local user is the admin.")
    return found
