"""Small Playwright helpers for the Gradio UI."""

from __future__ import annotations


def open_ui(page, url: str) -> None:
    page.goto(url, wait_until="domcontentloaded")
    wait_page_loaded(page)


def wait_page_loaded(page, timeout: float = 60_000) -> None:
    """Wait until the page-load events (latest chat, parameters, Model tab) are done: the app marks the body."""
    page.wait_for_selector("#chat-input textarea")
    page.wait_for_function("() => document.body.dataset.pageLoaded === '1'", timeout=timeout)


def new_chat(page) -> None:
    """Start a new chat and wait until the old one has left the page (a loaded machine renders late)."""
    page.click("#new-chat")
    page.wait_for_timeout(300)
    page.wait_for_function("() => document.querySelectorAll('#chatbot [data-testid=user]').length === 0")


def choose(page, selector: str, value: str) -> None:
    """Pick a value in a Gradio dropdown."""
    box = page.locator(f"{selector} input").first
    box.click()
    box.fill(value)
    page.get_by_role("option", name=value, exact=True).click()


STATUS = "#chat-status [data-testid=markdown]"  # the text itself, without Gradio's progress tracker


def status(page) -> str:
    return page.inner_text(STATUS) if page.locator(STATUS).count() else ""


def wait_reply(page, before: str = "", timeout: float = 180_000) -> None:
    """Wait until the status line shows a finished reply different from ``before`` (a reply of up to 512 tokens at
    the page's 11-33 tokens/s, with another test file running beside this one under make test)."""
    page.wait_for_function(
        "(before) => { const t = document.querySelector('#chat-status [data-testid=markdown]')?.innerText || '';"
        " return t.includes('finish:') && t !== before && !t.includes('Generating'); }",
        arg=before,
        timeout=timeout,
    )


def send(page, text: str) -> None:
    """Type a message and press Enter, as a person would."""
    before = status(page)
    page.fill("#chat-input textarea", text)
    page.press("#chat-input textarea", "Enter")
    wait_reply(page, before)


def bot_messages(page) -> list[str]:
    return [m.inner_text() for m in page.locator("#chatbot [data-testid='bot']").all()]


def user_messages(page) -> list[str]:
    return [m.inner_text() for m in page.locator("#chatbot [data-testid='user']").all()]


def set_deterministic(page) -> None:
    page.get_by_role("tab", name="Parameters").click()
    choose(page, "#preset-dropdown", "Deterministic")
    page.wait_for_function("() => document.querySelector('#param-temperature input[type=number]')?.value === '0'")
    page.get_by_role("tab", name="Chat").click()
