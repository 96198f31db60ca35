"""The web UI's admin rule: who may change the server, the guard on the handlers, and the startup warnings."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from types import SimpleNamespace

import gradio as gr
import pytest

from modules import shared
from modules.settings import load_settings
from modules.ui import admin


@pytest.fixture
def started() -> Iterator[Callable[..., None]]:
    """Start the hub with these flags (as server.py does); reset afterwards."""

    def start(*flags: str) -> None:
        shared.init(load_settings(["--model", "none", *flags], env={}))

    yield start
    shared.init()


def signed_in(name: str | None) -> SimpleNamespace:
    return SimpleNamespace(username=name)  # what gr.Request carries for a login


def test_without_logins_the_local_user_is_admin(started) -> None:
    started()
    assert admin.is_ui_admin(None) and admin.is_ui_admin(signed_in(None))
    assert admin.notice_text(None) == ""


def test_with_logins_only_the_named_admins_may_and_others_change_nothing(started) -> None:
    started("--gradio-auth", "alice:a,bob:b", "--gradio-admin", "alice")
    done: list[str] = []

    def unload(what: str) -> str:
        done.append(what)
        return f"unloaded {what}"

    guarded = admin.admin_only("unload the model")(unload)
    assert list(inspect.signature(guarded).parameters) == ["request", "what"]  # Gradio passes the request first
    assert guarded(signed_in("alice"), "m") == "unloaded m"
    with pytest.raises(gr.Error, match="Only an admin can unload the model: bob is not one"):
        guarded(signed_in("bob"), "m")  # outside a queued event the refusal is an error toast
    with pytest.raises(gr.Error):
        guarded(signed_in(None), "m")
    assert done == ["m"]
    assert "bob" in admin.notice_text(signed_in("bob")) and admin.notice_text(signed_in("alice")) == ""


def test_a_guarded_generator_still_streams(started) -> None:
    started("--gradio-auth", "alice:a", "--gradio-admin", "alice")

    def count(request: gr.Request, n: int) -> Iterator[int]:
        yield from range(int(n))

    guarded = admin.admin_only("count")(count)
    assert inspect.isgeneratorfunction(guarded)  # Gradio streams only generator functions
    assert list(inspect.signature(guarded).parameters) == ["request", "n"]  # its own request is not doubled
    assert list(guarded(signed_in("alice"), 3)) == [0, 1, 2]
    with pytest.raises(gr.Error):
        list(guarded(signed_in("eve"), 3))


@pytest.mark.parametrize(
    ("flags", "exposed"),
    [
        ((), False),
        (("--listen",), True),
        (("--listen-host", "127.0.0.2"), False),
        (("--listen-host", "::1"), False),
        (("--listen-host", "localhost"), False),
        (("--listen-host", "192.168.1.5"), True),
        (("--listen-host", "myhost.lan"), True),
        (("--listen", "--gradio-auth", "alice:a"), False),  # logins: nobody unknown gets in
    ],
)
def test_the_network_warning(started, flags: tuple[str, ...], exposed: bool) -> None:
    started(*flags)
    text = admin.exposure_text()
    assert bool(text) is exposed
    assert any("anyone who can reach it" in w for w in admin.startup_warnings(shared.settings)) is exposed


def test_startup_warnings_about_admins(started) -> None:
    started("--gradio-auth", "alice:a")
    assert any("nobody can load models" in w for w in admin.startup_warnings(shared.settings))
    started("--gradio-auth", "alice:a", "--gradio-admin", "alcie")
    assert any("no login in --gradio-auth: alcie" in w for w in admin.startup_warnings(shared.settings))
    started("--gradio-auth", "alice:a,bob:b", "--gradio-admin", "alice", "--enable-code-execution")
    assert admin.startup_warnings(shared.settings) == []  # running code cells is admin work: nothing to warn about
    started("--gradio-auth", "alice:a,bob:b", "--gradio-admin", "alice", "bob")
    assert admin.startup_warnings(shared.settings) == []


@pytest.mark.parametrize(("extension", "param", "value"), [("character_bias", "bias_string", "*evil*"),
                                                          ("long_replies", "min_length", 999),
                                                          ("example", "activate", False)])  # fmt: skip
def test_bundled_extension_controls_are_admin_work(started, extension: str, param: str, value: object) -> None:
    """An extension's params apply to every user's replies: a user who is not admin cannot change them."""
    import importlib

    started("--gradio-auth", "alice:a,bob:b", "--gradio-admin", "alice")
    script = importlib.import_module(f"extensions.{extension}.script")
    before = dict(script.params)
    with gr.Blocks() as demo:
        script.ui()
    handlers = [f.fn for f in demo.fns.values() if f.fn is not None]
    assert handlers
    for fn in handlers:
        with pytest.raises(gr.Error, match="Only an admin can"):
            fn(signed_in("bob"), value)
    assert script.params == before
    for fn in handlers:
        fn(signed_in("alice"), value)
    assert script.params[param] == value
    script.params.clear()
    script.params.update(before)
