"""The chat in a real browser: a streamed answer, and Stop ending a reply at once."""

from __future__ import annotations

import time

import pytest

from tests.conftest import ARTIFACTS

pytestmark = pytest.mark.browser


def open_chat(page, url: str, preset: str) -> None:
    page.goto(url, wait_until="domcontentloaded")
    page.wait_for_selector("#chat-input textarea")
    page.get_by_text("Generation", exact=True).click()
    page.locator("#chat-preset input").fill(preset)
    page.keyboard.press("Enter")


def bot_text(page) -> str:
    messages = page.locator("#chatbot .message-row.bot-row, #chatbot [data-testid='bot']")
    return messages.last.inner_text() if messages.count() else ""


def test_capital_question_streams_paris(page, shared_server) -> None:
    open_chat(page, shared_server.url, "Deterministic")
    page.fill("#chat-input textarea", "What is the capital of France?")
    page.click("#send")
    snapshots: list[str] = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        text = bot_text(page)
        if text and (not snapshots or text != snapshots[-1]):
            snapshots.append(text)
        if "finish:" in page.inner_text("#chat-status"):
            break
        time.sleep(0.02)
    final = bot_text(page)
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "chat-paris.png"), full_page=True)
    assert "Paris" in final
    assert len(snapshots) >= 2, f"the reply did not stream: {snapshots}"
    assert "tokens/s" in page.inner_text("#chat-status")
    assert page.input_value("#chat-input textarea") == ""


def test_stop_ends_a_long_reply(page, shared_server) -> None:
    open_chat(page, shared_server.url, "Creative")
    page.locator("#chat-input textarea").fill("Write a very long story about a dragon and a knight.")
    page.click("#send")
    page.wait_for_function("() => (document.querySelector('#chatbot')?.innerText || '').length > 80")
    page.click("#stop")
    page.wait_for_function("() => (document.querySelector('#chat-status')?.innerText || '').includes('finish:')")
    status = page.inner_text("#chat-status")
    assert "finish: cancelled" in status
    stopped_at = bot_text(page)
    time.sleep(1.0)
    assert bot_text(page) == stopped_at, "text kept arriving after Stop"
    assert len(stopped_at) > 20
