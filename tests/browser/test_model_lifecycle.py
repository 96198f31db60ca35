"""The Model tab's lifecycle panels in a browser: the plan and expected memory before a load, estimate vs measured
after it, and a Hub download (from a Hub on 127.0.0.1) with progress, Cancel, and the new model in the list."""

from __future__ import annotations

import os
from pathlib import Path

from tests.browser.helpers import open_ui
from tests.conftest import DEFAULT_MODEL, default_model_path
from tests.fixtures.fake_hub import FakeHub

MiB = 1 << 20


def fill(page, selector: str, text: str) -> None:
    box = page.locator(f"{selector} textarea, {selector} input").first
    box.click()
    box.fill(text)
    page.keyboard.press("Tab")  # leave the box, as a person would: its value is committed before the next click


def test_plan_memory_and_download_in_the_model_tab(page, live_server_factory, tmp_path: Path) -> None:
    hub = FakeHub().start()
    try:
        hub.add_repo("org/other-GGUF", {"other-Q8_0.gguf": os.urandom(4096), "other-Q4_K_M.gguf": os.urandom(3 * MiB)})
        hub.add_repo("org/slow", {"config.json": b"{}", "model.safetensors": os.urandom(40 * MiB)})
        hub.slow[("org/slow", "model.safetensors")] = 0.6  # 24 s in all: Cancel lands while it runs on a slow page
        models = tmp_path / "models"
        models.mkdir()
        (models / DEFAULT_MODEL).symlink_to(default_model_path())
        server = live_server_factory(
            "--model-dir", str(models), "--user-data-dir", str(tmp_path / "ud"),
            env={"HF_ENDPOINT": hub.url, "HF_HUB_OFFLINE": "0"},
        )  # fmt: skip
        open_ui(page, server.url)
        page.get_by_role("tab", name="Model").click()
        plan = page.locator("#model-plan")
        plan.get_by_text("expected memory").wait_for()
        text = plan.inner_text()
        assert "fits" in text and "llama.cpp" in text and "n_ctx" in text and "physical cores" in text
        page.locator("#model-measured").get_by_text("measured").wait_for()  # filled by the page's load, not the plan
        measured = page.locator("#model-measured").inner_text()
        assert "expected" in measured and "measured" in measured and DEFAULT_MODEL in measured

        page.get_by_text("Download from the Hugging Face Hub").click()
        fill(page, "#download-repo", "org/other-GGUF")
        page.click("#download-check")
        status = page.locator("#download-status")
        status.get_by_text("Quantizations").wait_for()
        assert "other-Q4_K_M.gguf" in status.inner_text() and "Q8_0" in status.inner_text()
        page.click("#download-start")
        status.get_by_text("Downloaded").wait_for(timeout=30_000)
        assert "other-Q4_K_M.gguf" in status.inner_text()
        assert (models / "other-Q4_K_M.gguf").stat().st_size == 3 * MiB
        page.locator("#model-dropdown input").first.click()
        page.get_by_role("option", name="other-Q4_K_M.gguf", exact=True).wait_for()  # in the list without Refresh
        page.keyboard.press("Escape")

        fill(page, "#download-repo", "org/slow")
        page.click("#download-start")
        status.get_by_text("Downloading").wait_for(timeout=20_000)
        page.click("#download-cancel")
        status.get_by_text("Cancelled").wait_for(timeout=30_000)
        assert not (models / "org_slow").exists() and list((models / ".downloads").rglob("*.part"))
    finally:
        hub.stop()


def test_export_panel_writes_a_gguf_and_refuses_a_bad_name(page, live_server_factory, tiny_models, tmp_path) -> None:
    """Export a tiny HF model to Q8_0 from the Model tab, as a person would; a name outside models/ is refused."""
    from modules.lifecycle import quantize
    from tests.browser.helpers import choose

    models = tmp_path / "models"
    models.mkdir()
    (models / DEFAULT_MODEL).symlink_to(default_model_path())
    (models / "tiny-llama").symlink_to(tiny_models / "tiny-llama", target_is_directory=True)
    server = live_server_factory("--model-dir", str(models), "--user-data-dir", str(tmp_path / "ud"))
    open_ui(page, server.url)
    page.get_by_role("tab", name="Model").click()
    page.get_by_text("Merge, export and quantize").click()
    choose(page, "#export-source", "tiny-llama")
    choose(page, "#export-quant", "Q8_0")
    page.get_by_label("Fidelity check (greedy agreement, PPL, KLD vs F16)").uncheck()
    fill(page, "#export-output", "../outside.gguf")
    page.click("#export-start")
    page.locator("#export-status").get_by_text("as an output name").wait_for(timeout=30_000)
    assert not (tmp_path / "outside.gguf").exists()

    fill(page, "#export-output", "tiny.Q8_0.gguf")
    page.keyboard.press("Tab")
    page.click("#export-start")
    status = page.locator("#export-status")
    status.get_by_text("done").wait_for(timeout=120_000)
    assert "done. wrote tiny.Q8_0.gguf" in status.inner_text()
    out = models / "tiny.Q8_0.gguf"
    assert quantize.tensor_types(out).get("Q8_0", 0) > 0
    assert sorted(p.name for p in models.iterdir() if not p.name.startswith(".")) == [
        DEFAULT_MODEL, "tiny-llama", "tiny.Q8_0.gguf"
    ]  # fmt: skip
    written = out.stat().st_mtime_ns
    page.click("#export-start")  # the same name again: refused before anything runs, the file kept
    status.get_by_text("exists").wait_for(timeout=30_000)
    page.wait_for_timeout(2500)  # a tick of the panel's poll (2 s): the refusal stays, not the last job's "done"
    assert "exists" in status.inner_text() and "done" not in status.inner_text()
    assert out.stat().st_mtime_ns == written
    page.get_by_label("Replace the output if it exists").check()
    page.click("#export-start")
    page.wait_for_function("() => document.querySelector('#export-status').innerText.includes('done. wrote')",
                           timeout=120_000)  # fmt: skip
    assert out.stat().st_mtime_ns != written and quantize.tensor_types(out).get("Q8_0", 0) > 0


def test_lora_export_merge_and_push_from_the_model_tab(page, live_server_factory, tiny_models, tmp_path) -> None:
    """The Model tab's LoRA -> GGUF export lists loras/ and offers the types the converter writes; a merged model
    appears in the lists without a restart; Publish previews the card and pushes only the model's files (to a Hub on
    127.0.0.1), with no local path and no token in anything sent."""
    import shutil

    from tests.browser.helpers import choose

    hub = FakeHub(users={"hf_writer": "me"}).start()
    try:
        models, loras = tmp_path / "models", tmp_path / "loras"
        models.mkdir()
        (models / DEFAULT_MODEL).symlink_to(default_model_path())
        (models / "tiny-llama").symlink_to(tiny_models / "tiny-llama", target_is_directory=True)
        shutil.copytree(tiny_models / "loras" / "lora-a", loras / "lora-a")
        env = {"HF_ENDPOINT": hub.url, "HF_HUB_OFFLINE": "0", "HF_TOKEN": "hf_writer"}
        server = live_server_factory("--model-dir", str(models), "--lora-dir", str(loras), "--user-data-dir",
                                     str(tmp_path / "ud"), env=env)  # fmt: skip
        open_ui(page, server.url)
        page.get_by_role("tab", name="Model").click()
        page.get_by_text("Merge, export and quantize").click()
        status = page.locator("#export-status")

        choose(page, "#export-format", "gguf-lora")
        page.wait_for_function("() => document.querySelector('#export-quant input').value === 'F16'")
        choose(page, "#export-source", "lora-a")  # listed from loras/, not models/
        choose(page, "#export-base", "tiny-llama")
        page.click("#export-start")
        wait_status(page, r"export lora-a F16\*?\*?: done")
        assert (loras / "lora-a.F16.gguf").is_file()

        page.get_by_role("tab", name="Merge LoRA").click()
        choose(page, "#merge-base", "tiny-llama")
        choose(page, "#merge-lora", "lora-a")
        page.fill("#merge-output textarea, #merge-output input", "tiny-merged")
        page.keyboard.press("Tab")
        page.click("#merge-start")
        wait_status(page, r"merge lora-a into tiny-llama\*?\*?: done")
        assert (models / "tiny-merged" / "config.json").is_file()
        (models / "tiny-merged" / "mine.txt").write_text("a file of the old merge")
        page.click("#merge-start")  # again: the output exists
        wait_status(page, "exists")
        assert (models / "tiny-merged" / "mine.txt").is_file()
        page.locator("#merge-replace input").focus()
        page.keyboard.press("Space")  # Replace, ticked from the keyboard
        page.click("#merge-start")
        wait_status(page, r"merge lora-a into tiny-llama\*?\*?: done")
        assert (models / "tiny-merged" / "config.json").is_file() and not (models / "tiny-merged" / "mine.txt").exists()

        page.get_by_role("tab", name="Publish").click()
        choose(page, "#push-source", "tiny-merged")  # listed without a restart
        page.fill("#push-repo input, #push-repo textarea", "me/tiny-merged")
        page.fill("#push-license input, #push-license textarea", "apache-2.0")
        page.keyboard.press("Tab")
        page.click("#push-card")
        page.locator("#push-card-text").get_by_text("license: apache-2.0").wait_for(timeout=20_000)
        page.click("#push-start")
        wait_status(page, "Pushed to")
        sent = hub.repos["me/tiny-merged"].branches["main"]
        assert "README.md" in sent and "config.json" in sent and any(n.endswith(".safetensors") for n in sent)
        assert not any(n.endswith(".gguf") for n in sent) and "textgen_merge.json" in sent
        for name, content in sent.items():
            data = content.read_bytes() if isinstance(content, Path) else content
            assert str(tmp_path).encode() not in data and b"hf_writer" not in data, name
        assert "private" in status.inner_text() and hub.repos["me/tiny-merged"].private
    finally:
        hub.stop()


def wait_status(page, pattern: str, timeout: float = 120) -> str:
    """Wait until the export panel's status matches ``pattern`` (a regex); fail with what it says instead."""
    import re
    import time

    deadline = time.monotonic() + timeout
    text = ""
    while time.monotonic() < deadline:
        text = page.locator("#export-status").inner_text()
        if re.search(pattern, text):
            return text
        page.wait_for_timeout(500)
    raise AssertionError(f"the status never matched {pattern!r}; it says: {text}")
