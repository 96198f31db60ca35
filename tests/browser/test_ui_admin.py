"""Who may change the server from the web UI: with --gradio-auth only the --gradio-admin users load and unload models
or save settings (the server refuses everyone else, whatever their page sends); --listen without logins is
announced in the log and on the page."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from tests.browser.helpers import open_ui
from tests.browser.test_multi_user import sign_in

pytestmark = pytest.mark.browser

TOAST = "Only an admin can unload the model"


def model_loaded(server) -> bool:
    return httpx.get(server.url + "/health", timeout=10).json().get("status") == "ok"


def wait_status(page, start: str) -> None:
    """Wait until the Model tab's status line starts with ``start`` ("Loaded", "No model loaded")."""
    page.wait_for_function(
        "(start) => (document.querySelector('#model-status')?.innerText || '').trim().startsWith(start)", arg=start
    )


def open_model_tab(page) -> None:
    page.get_by_role("tab", name="Model").click()
    wait_status(page, "Loaded")


def test_a_user_who_is_not_admin_cannot_unload_the_model_and_the_admin_can(
    browser, live_server_factory, user_data: Path
) -> None:
    from gradio_client import Client

    server = live_server_factory(
        "--gradio-auth", "alice:wonder,bob:builder", "--gradio-admin", "alice", "--user-data-dir", str(user_data)
    )
    assert "without --gradio-admin" not in server.log()
    bob_ctx, bob = sign_in(browser, server.url, "bob", "builder")
    notice = bob.locator("#admin-notice")
    notice.get_by_text("not an admin").wait_for()
    assert "bob" in notice.inner_text()
    assert not bob.locator("#exposed-warning").is_visible()  # logins are on: no network warning
    open_model_tab(bob)
    unload = bob.locator("button#model-unload")
    bob.wait_for_function("() => document.querySelector('button#model-unload')?.disabled === true")
    assert bob.locator("button#model-load").is_disabled()

    # A page whose buttons were not greyed out (an old tab, devtools): the server itself refuses.
    bob.evaluate("() => { const b = document.querySelector('button#model-unload'); b.disabled = false; }")
    unload.click()
    bob.get_by_text(TOAST).wait_for(timeout=20_000)
    assert model_loaded(server)
    assert bob.locator("#model-status").inner_text().strip().startswith("Loaded")
    # Straight to the endpoints, no page at all: still refused.
    client = Client(server.url, auth=("bob", "builder"), verbose=False)
    client.predict(api_name="/model_unload")
    client.predict(api_name="/do_save")
    assert model_loaded(server)
    assert not (user_data / "settings.yaml").exists()
    bob_ctx.close()

    alice_ctx, alice = sign_in(browser, server.url, "alice", "wonder")
    assert not alice.locator("#admin-notice").is_visible()
    open_model_tab(alice)
    assert alice.locator("button#model-unload").is_enabled()
    alice.click("button#model-unload")
    wait_status(alice, "No model loaded")
    assert not model_loaded(server)
    alice.click("button#model-load")  # the dropdown still shows the model she unloaded
    wait_status(alice, "Loaded")
    assert model_loaded(server)
    assert alice.get_by_text("Only an admin").count() == 0
    alice_ctx.close()


def test_logins_without_an_admin_are_warned_about_at_startup(browser, live_server_factory, user_data: Path) -> None:
    server = live_server_factory(
        "--gradio-auth", "alice:wonder", "--model", "none", "--user-data-dir", str(user_data), want_model=False
    )
    assert "without --gradio-admin: nobody can load models" in server.log()
    ctx, alice = sign_in(browser, server.url, "alice", "wonder")
    alice.locator("#admin-notice").get_by_text("not an admin").wait_for()
    alice.get_by_role("tab", name="Session").click()
    alice.wait_for_function("() => document.querySelector('button#save-settings')?.disabled === true")
    ctx.close()


def test_listen_without_logins_is_announced_in_the_log_and_on_the_page(
    page, live_server_factory, user_data: Path
) -> None:
    server = live_server_factory("--listen", "--model", "none", "--user-data-dir", str(user_data), want_model=False)
    assert "listens on 0.0.0.0 without --gradio-auth" in server.log()
    open_ui(page, server.url)
    banner = page.locator("#exposed-warning")
    banner.get_by_text("anyone who can reach it on the network can use it and administer it").wait_for()
    assert not page.locator("#admin-notice").is_visible()  # without logins the local user is the admin
    page.get_by_role("tab", name="Model").click()
    assert page.locator("button#model-load").is_enabled()


def test_with_logins_only_an_admin_runs_code_cells(browser, live_server_factory, user_data: Path, tmp_path) -> None:
    """Code cells run with the server's rights: with --gradio-auth, a user who is not admin cannot run one."""
    from tests.browser.test_code_notebook import output_has, type_cell

    server = live_server_factory(
        "--gradio-auth", "alice:wonder,bob:builder", "--gradio-admin", "alice", "--enable-code-execution",
        "--user-data-dir", str(user_data),
    )  # fmt: skip
    marker = tmp_path / "ran.txt"
    code = f"open({str(marker)!r}, 'w').write('x'); print('wrote it')"
    bob_ctx, bob = sign_in(browser, server.url, "bob", "builder")
    bob.get_by_role("tab", name="Code", exact=True).click()
    type_cell(bob, 0, code)
    bob.keyboard.press("Shift+Enter")
    bob.get_by_text("Only an admin can run code").wait_for(timeout=20_000)
    assert not marker.exists()
    bob_ctx.close()

    alice_ctx, alice = sign_in(browser, server.url, "alice", "wonder")
    alice.get_by_role("tab", name="Code", exact=True).click()
    type_cell(alice, 0, code)
    alice.keyboard.press("Shift+Enter")
    output_has(alice, 0, "wrote it", timeout=60_000)
    assert marker.read_text() == "x"
    alice_ctx.close()
