"""--multi-user with --gradio-auth: each signed-in user sees only their own chat histories."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.browser.helpers import new_chat, send, set_deterministic, user_messages, wait_page_loaded

pytestmark = pytest.mark.browser


def sign_in(browser, url: str, user: str, password: str):
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    page = context.new_page()
    page.set_default_timeout(60_000)
    page.goto(url, wait_until="domcontentloaded")
    page.locator("input[type=text], input[name=username]").first.fill(user)
    page.locator("input[type=password]").first.fill(password)
    page.get_by_role("button", name="Login").click()
    wait_page_loaded(page)
    return context, page


def test_each_user_has_their_own_histories(browser, live_server_factory, user_data: Path) -> None:
    server = live_server_factory(
        "--multi-user", "--gradio-auth", "alice:wonder,bob:builder", "--user-data-dir", str(user_data)
    )
    alice_ctx, alice = sign_in(browser, server.url, "alice", "wonder")
    new_chat(alice)
    set_deterministic(alice)
    send(alice, "Alice's secret is MARMALADE-77.")
    alice.reload(wait_until="domcontentloaded")
    alice.wait_for_function("() => document.querySelector('#chatbot')?.innerText.includes('MARMALADE-77')")
    bob_ctx, bob = sign_in(browser, server.url, "bob", "builder")
    assert not any("MARMALADE-77" in m for m in user_messages(bob))
    bob.locator("#chat-list input").first.click()
    assert bob.get_by_role("option").count() == 0
    logs = user_data / "logs"
    assert (logs / "alice").is_dir() and not (logs / "bob").exists()
    alice_ctx.close()
    bob_ctx.close()
