"""The Code tab in a real browser: type a cell, Shift+Enter, see its output; the next cell sees its variables."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest

from tests.browser.helpers import open_ui

pytestmark = pytest.mark.browser


def type_cell(page, index: int, code: str) -> None:
    """Click into a cell's editor and type as a person would."""
    page.locator(f"#nb-src-{index} .cm-content").click()
    page.keyboard.type(code)


def output_has(page, index: int, text: str, timeout: float = 30_000) -> None:
    page.wait_for_function(
        "([index, text]) => (document.querySelector(`#nb-out-${index}`)?.innerText || '').includes(text)",
        arg=[index, text],
        timeout=timeout,
    )


def test_run_cells_and_save(page, live_server_factory, user_data: Path) -> None:
    server = live_server_factory("--enable-code-execution", "--user-data-dir", str(user_data))
    open_ui(page, server.url)
    page.get_by_role("tab", name="Code", exact=True).click()
    type_cell(page, 0, "x = 6 * 7\nprint('answer', x)")
    page.keyboard.press("Shift+Enter")
    output_has(page, 0, "answer 42")
    assert page.inner_text("#nb-label-0").strip() == "In [1]"

    page.click("#nb-add-code")
    page.wait_for_selector("#nb-src-1")
    assert "print('answer', x)" in page.inner_text("#nb-src-0 .cm-content")  # the redraw kept the first cell
    type_cell(page, 1, "import matplotlib.pyplot as plt\nplt.plot([x, 1]); plt.show()\nprint(x + 1)")
    page.click("#nb-run-1")
    output_has(page, 1, "43")
    page.wait_for_selector("#nb-out-1 img.nb-image")

    page.fill("#nb-name input, #nb-name textarea", "from-the-browser")
    page.click("#nb-save")
    page.wait_for_function("() => (document.querySelector('#nb-message')?.innerText || '').includes('Saved')")
    node = nbformat.read(user_data / "notebooks" / "default" / "from-the-browser.ipynb", as_version=4)
    nbformat.validate(node)
    assert node.cells[0].outputs[0]["text"] == "answer 42\n"
    assert "image/png" in node.cells[1].outputs[0]["data"]


def test_without_the_flag_the_tab_says_how_to_turn_it_on(page, shared_server) -> None:
    open_ui(page, shared_server.url)
    page.get_by_role("tab", name="Code", exact=True).click()
    page.wait_for_function(
        "() => (document.querySelector('#nb-status')?.innerText || '').includes('--enable-code-execution')"
    )
    type_cell(page, 0, "print('should not run')")
    page.click("#nb-run-0")
    output_has(page, 0, "--enable-code-execution")
    assert "should not run" not in page.inner_text("#nb-out-0")
