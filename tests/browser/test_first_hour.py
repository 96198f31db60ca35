"""A newcomer's first minutes in a real browser: Enter sends, the first answer is sensible, the Model tab is right."""

from __future__ import annotations

import pytest

from tests.browser.helpers import bot_messages, choose, new_chat, open_ui, status, user_messages, wait_reply
from tests.conftest import DEFAULT_MODEL

pytestmark = pytest.mark.browser
BOX = "#chat-input textarea"


def test_enter_sends_and_shift_enter_adds_a_line(page, shared_server) -> None:
    open_ui(page, shared_server.url)
    new_chat(page)
    page.click(BOX)
    page.keyboard.type("Say hello")
    page.keyboard.press("Shift+Enter")
    page.keyboard.type("in French.")
    page.wait_for_timeout(500)
    assert page.input_value(BOX) == "Say hello\nin French."
    assert user_messages(page) == [], "Shift+Enter sent the message"
    before = status(page)
    page.keyboard.press("Enter")
    wait_reply(page, before)
    assert user_messages(page) == ["Say hello\nin French."]
    assert bot_messages(page)[-1].strip()
    assert page.input_value(BOX) == ""


def test_the_first_answer_at_the_default_settings_mentions_paris(page, shared_server) -> None:
    open_ui(page, shared_server.url)
    new_chat(page)
    page.get_by_role("tab", name="Parameters").click()
    page.wait_for_function("() => document.querySelector('#param-temperature input[type=number]')?.value === '0.1'")
    assert page.input_value("#preset-dropdown input") == "Model's recommendation"
    shown = page.inner_text("#params-sampling")
    assert "models_settings.yaml" in shown and "temperature" in shown
    page.get_by_role("tab", name="Chat").click()
    page.fill(BOX, "What is the capital of France?")
    before = status(page)
    page.press(BOX, "Enter")
    wait_reply(page, before)
    assert "Paris" in bot_messages(page)[-1]


def test_the_model_tab_shows_the_loaded_model_and_its_loader_options(page, shared_server) -> None:
    open_ui(page, shared_server.url)
    page.get_by_role("tab", name="Model").click()
    page.wait_for_function(f"() => document.querySelector('#model-dropdown input')?.value === {DEFAULT_MODEL!r}")
    assert page.locator("#opt-n_ctx").is_visible() and page.locator("#opt-prompt_cache").is_visible()
    assert not page.locator("#opt-dtype").is_visible(), "a transformers option is shown for a GGUF model"
    choose(page, "#loader-dropdown", "transformers")
    page.wait_for_function("() => document.querySelector('#opt-dtype')?.checkVisibility()")
    assert not page.locator("#opt-prompt_cache").is_visible()
