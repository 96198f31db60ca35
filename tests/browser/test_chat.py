"""The chat in a real browser: a streamed answer, and Stop ending a reply at once."""

from __future__ import annotations

import time

import pytest

from tests.browser.helpers import bot_messages, choose, new_chat, open_ui, set_deterministic, status
from tests.conftest import ARTIFACTS

pytestmark = pytest.mark.browser


def test_capital_question_streams_paris(page, shared_server) -> None:
    open_ui(page, shared_server.url)
    new_chat(page)
    set_deterministic(page)
    # a paragraph, not a one-line answer: on a quiet machine 7 tokens arrive in 0.16 s, too fast to see stream
    page.fill("#chat-input textarea", "What is the capital of France? Describe it in a short paragraph.")
    page.click("#send")
    snapshots: list[str] = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        texts = bot_messages(page)
        text = texts[-1] if texts else ""
        if text and (not snapshots or text != snapshots[-1]):
            snapshots.append(text)
        if "finish:" in status(page):
            break
        time.sleep(0.02)
    final = bot_messages(page)[-1]
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "chat-paris.png"), full_page=True)
    assert "Paris" in final
    assert len(snapshots) >= 2, f"the reply did not stream: {snapshots}"
    assert "tokens/s" in status(page)
    assert "Context:" in page.inner_text("#context-usage")
    assert page.input_value("#chat-input textarea") == ""


def test_stop_ends_a_long_reply(page, shared_server) -> None:
    open_ui(page, shared_server.url)
    new_chat(page)
    page.get_by_role("tab", name="Parameters").click()
    choose(page, "#preset-dropdown", "Creative")
    page.wait_for_function("() => document.querySelector('#param-temperature input[type=number]')?.value === '1.3'")
    # a sampled reply could end on its own before Stop lands: it may not end here
    page.check("#param-ban_eos input[type=checkbox]")
    page.get_by_role("tab", name="Chat").click()
    page.locator("#chat-input textarea").fill("Write a very long story about a dragon and a knight.")
    page.click("#send")
    # the reply to this message, not an older one still on a slow page: Stop must land while it streams
    page.wait_for_function(
        "() => { const all = [...document.querySelectorAll('#chatbot [data-testid=user], #chatbot [data-testid=bot]')];"
        " const asked = all.findLastIndex(m => m.dataset.testid === 'user' && m.innerText.includes('dragon'));"
        " const reply = asked < 0 ? null : all.slice(asked + 1).find(m => m.dataset.testid === 'bot');"
        " return !!reply && reply.innerText.length > 80; }"
    )
    page.click("#stop")
    page.wait_for_function(
        "() => (document.querySelector('#chat-status [data-testid=markdown]')?.innerText || '').includes('finish:')"
    )
    assert "finish: cancelled" in status(page)
    stopped_at = bot_messages(page)[-1]
    time.sleep(1.0)
    assert bot_messages(page)[-1] == stopped_at, "text kept arriving after Stop"
    assert len(stopped_at) > 20
