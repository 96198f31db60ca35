"""The Training tab in a real browser: start a short run, watch the live loss plot, chat meanwhile, busy, stop."""

from __future__ import annotations

import shutil
from pathlib import Path

import httpx
import pytest

from tests.browser.helpers import choose
from tests.conftest import DEFAULT_MODEL, ROOT, default_model_path

pytestmark = pytest.mark.browser
STATUS = "#training-status"


def status(page) -> str:  # type: ignore[no-untyped-def]
    return page.inner_text(STATUS)


def test_start_a_run_see_the_plot_chat_meanwhile_and_stop(page, live_server_factory, tmp_path: Path,
                                                         tiny_models: Path) -> None:  # fmt: skip
    models_dir, loras = tmp_path / "models", tmp_path / "loras"
    models_dir.mkdir()
    (models_dir / DEFAULT_MODEL).symlink_to(default_model_path())
    (models_dir / "tiny-llama").symlink_to(tiny_models / "tiny-llama")
    user_data = tmp_path / "user_data"
    for sub in ("presets", "instruction-templates", "characters", "training"):  # never the developer's own files
        shutil.copytree(ROOT / "user_data" / sub, user_data / sub)
    server = live_server_factory("--user-data-dir", str(user_data), "--model-dir", str(models_dir),
                                 "--lora-dir", str(loras))  # fmt: skip
    page.goto(server.url, wait_until="domcontentloaded")
    page.get_by_role("tab", name="Training").click()
    choose(page, "#train-model", "tiny-llama")
    page.click("#train-start")  # no dataset yet: refused, and the refusal stays over the timer's ticks (1 s)
    page.locator(STATUS).get_by_text("Not started").wait_for(timeout=30_000)
    page.wait_for_timeout(1500)
    assert "Not started" in status(page), status(page)
    choose(page, "#train-dataset", "example-chat.jsonl")
    page.locator("#train-name textarea, #train-name input").first.fill("browser-run")
    page.locator("#train-epochs input").first.fill("100")
    page.locator("#train-learning-rate input").first.fill("0.01")
    page.click("#train-start")
    page.wait_for_function(
        "() => { const t = document.querySelector('#training-status')?.innerText || '';"
        " return t.includes('running') && t.includes('loss'); }",
        timeout=120_000,
    )
    # the live plot draws the loss curve
    page.wait_for_selector("#training-plot canvas, #training-plot svg", timeout=30_000)

    # another user chats while the run trains, and a second run is refused as busy
    reply = httpx.post(server.url + "/v1/chat/completions", timeout=120,
                       json={"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 8})  # fmt: skip
    assert reply.status_code == 200 and reply.json()["choices"][0]["message"]["content"].strip()
    assert "running" in status(page)
    page.click("#train-start")
    page.wait_for_selector("text=already running", timeout=30_000)

    page.click("#train-stop")
    page.wait_for_function(
        "() => (document.querySelector('#training-status')?.innerText || '').includes('Saved to')", timeout=120_000
    )
    assert "cancelled" in status(page) and "stopped by the user" in status(page)
    assert (loras / "browser-run" / "adapter_model.safetensors").is_file()
    assert (loras / "browser-run" / "loss.png").is_file()
