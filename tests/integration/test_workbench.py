"""The script in docs/python-api.md runs as written; a Workbench leaves the process's settings, model and permissions
as it found them, closes its progress bars, and reports what the backend loaded."""

from __future__ import annotations

import _thread
import json
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from modules import models, shared
from modules.errors import InvalidRequest
from modules.workbench import Workbench
from tests.conftest import DEFAULT_MODEL, ROOT, default_model_path, hf_default_model


@pytest.mark.slow
def test_the_documented_script_runs(tmp_path: Path) -> None:
    hf_default_model()  # the HF copy the script loads
    page = (ROOT / "docs" / "python-api.md").read_text(encoding="utf-8")
    script = re.search(r"## A complete script.*?```python\n(.*?)```", page, re.S)
    assert script, "docs/python-api.md has no script"
    path = tmp_path / "script.py"
    path.write_text(script[1])
    env = {
        "PATH": "/usr/bin:/bin",
        "HF_HUB_OFFLINE": "1",
        "PYTHONPATH": str(ROOT),
        "HOME": str(tmp_path),
        "TMPDIR": str(tmp_path),
    }
    done = subprocess.run([sys.executable, str(path)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    assert "Paris" in out
    ppl = float(re.search(r"perplexity: ([\d.]+)", out)[1])  # type: ignore[index]
    assert 3 < ppl < 200
    assert "'loader': 'transformers'" in out and "hello.Q8_0.gguf" in out and "merged" in out


@pytest.fixture
def hub_tiny(tmp_path: Path, tiny_models: Path) -> Iterator[Path]:
    """A process that already has settings (as a running textgen has): tiny models, its own LoRA folder, an API key."""
    from modules.settings import load_settings

    models_dir, loras = tmp_path / "models", tmp_path / "loras"
    models_dir.mkdir()
    for name in ("tiny-llama", "tiny-llama-bin"):
        (models_dir / name).symlink_to(tiny_models / name)
    flags = ["--user-data-dir", str(tmp_path / "user_data"), "--model-dir", str(models_dir), "--lora-dir", str(loras),
             "--max-request-mb", "7", "--api-key", "sk-secret-of-the-server"]  # fmt: skip
    shared.init(load_settings(flags, env={}))
    yield tmp_path
    models.unload_model()
    shared.init()


def test_a_workbench_keeps_the_settings_and_the_model_the_process_already_has(
    hub_tiny: Path, tiny_models: Path
) -> None:
    settings = shared.settings
    served = models.load_model("tiny-llama")
    adopted = Workbench()  # no model named: the one loaded, as it is
    assert adopted.backend is served and adopted.name == "tiny-llama" and shared.settings is settings

    wb = Workbench(hub_tiny / "models" / "tiny-llama-bin")  # a path inside the models folder
    assert shared.settings is settings and shared.settings.max_request_mb == 7
    assert shared.settings.api_key == "sk-secret-of-the-server" and shared.models_dir() == hub_tiny / "models"
    assert served.model is None  # the model it replaced was unloaded (as the Model tab's Load does), not orphaned
    assert shared.model is wb.backend and shared.model_name == "tiny-llama-bin"

    with pytest.raises(InvalidRequest, match="lora_dir"):  # the server's folders are not changed under it
        Workbench("tiny-llama", loras_dir=hub_tiny / "elsewhere")
    with pytest.raises(InvalidRequest, match="outside the models folder"):
        Workbench(tiny_models / "tiny-llama")
    assert shared.model is wb.backend and shared.settings is settings
    adopted.close()  # no longer the loaded model: closing it leaves the server's model alone
    assert shared.model is wb.backend


def test_a_workbench_in_a_fresh_process_sets_the_hub_up_from_its_folders(tmp_path: Path, tiny_models: Path) -> None:
    shared.init()  # nothing set up yet: a plain script
    try:
        wb = Workbench(tiny_models / "tiny-llama", loras_dir=tmp_path / "loras", user_data_dir=tmp_path / "ud")
        assert shared.initialized and shared.models_dir() == tiny_models and shared.loras_dir() == tmp_path / "loras"
        assert shared.model is wb.backend
        wb.close()
        assert shared.model is None
    finally:
        models.unload_model()
        shared.init()


def test_finetune_lets_only_its_own_call_name_a_dataset_outside_user_data(hub_tiny: Path) -> None:
    from modules.training import datasets
    from modules.training.args import TrainingArgs
    from modules.training.run import prepare

    dataset = hub_tiny / "outside.jsonl"
    row = {"messages": [{"role": "user", "content": "Say hello."}, {"role": "assistant", "content": "Hello!"}]}
    dataset.write_text((json.dumps(row) + "\n") * 2)
    folder = hub_tiny / "user_data" / "training" / "datasets"
    folder.mkdir(parents=True)
    wb = Workbench("tiny-llama")
    allowed_elsewhere: list[bool] = []
    stop = threading.Event()

    def server() -> None:  # a Training tab request while the script trains
        while not stop.is_set():
            try:
                datasets.resolve_file(folder, str(dataset), "dataset")
                allowed_elsewhere.append(True)
            except InvalidRequest:
                allowed_elsewhere.append(False)
            time.sleep(0.01)

    watcher = threading.Thread(target=server, daemon=True)
    watcher.start()
    try:
        summary = wb.finetune(str(dataset), "outside", max_steps=1, micro_batch_size=1, cutoff_len=64, overlap_len=0,
                              gguf=False)  # fmt: skip
    finally:
        stop.set()
        watcher.join(10)
    assert summary["steps"] == 1 and (shared.loras_dir() / "outside" / "adapter_config.json").is_file()
    assert allowed_elsewhere and not any(allowed_elsewhere)  # the server's threads never had the permission
    with pytest.raises(InvalidRequest, match="not an absolute path"):  # nor has the Training tab afterwards
        prepare(TrainingArgs(model="tiny-llama", dataset=str(dataset), name="from-the-ui"))


def test_progress_bars_close_when_a_step_ends_fails_or_is_cancelled(
    hub_tiny: Path, tiny_models: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import tqdm

    bars: list[tqdm.tqdm] = []
    interrupt = {"on": False}

    class Recorded(tqdm.tqdm):  # type: ignore[misc]
        def __init__(self, *args: object, **kwargs: object) -> None:
            super().__init__(*args, **kwargs)
            bars.append(self)  # held here, so only close() can end it (not the garbage collector)

        def set_postfix(self, *args: object, **kwargs: object) -> None:
            super().set_postfix(*args, **kwargs)
            if interrupt["on"]:  # the first word of the step: Ctrl+C now, then let the step go on
                interrupt["on"] = False
                _thread.interrupt_main()
                time.sleep(0.5)

    monkeypatch.setattr(tqdm, "tqdm", Recorded)
    wb = Workbench("tiny-llama", progress=True)
    lora = tiny_models / "loras" / "lora-a"
    assert wb.merge(lora, output=hub_tiny / "merged").is_dir()  # ends
    not_an_adapter = hub_tiny / "empty"
    not_an_adapter.mkdir()
    with pytest.raises(InvalidRequest, match="not a PEFT adapter"):  # fails
        wb.merge(not_an_adapter, output=hub_tiny / "failed")
    interrupt["on"] = True
    with pytest.raises(KeyboardInterrupt):  # cancelled with Ctrl+C
        wb.merge(lora, output=hub_tiny / "cancelled")
    assert not (hub_tiny / "cancelled").exists()
    assert len(bars) == 3 and all(bar.disable for bar in bars)  # tqdm.close() leaves a bar disabled


def test_report_says_what_the_backend_loaded_not_what_was_asked(hub_tiny: Path, tiny_models: Path) -> None:
    (shared.loras_dir()).mkdir(parents=True, exist_ok=True)
    (shared.loras_dir() / "lora-a").symlink_to(tiny_models / "loras" / "lora-a")
    wb = Workbench("tiny-llama", options={"n_ctx": 4096, "parallel": 2, "dtype": "auto", "loader": "transformers"})
    models.apply_loras(["lora-a"])
    report = wb.report()
    assert report["loader"] == "transformers" and report["loaded"] is True
    assert report["context_length"] == 1024 == report["trained_context_length"]  # asked 4096; the model has 1024
    assert report["parallel"] == 2 and report["stats"]["slots"] == 2
    assert report["dtype"] == "torch.float32" and report["quantization"] is None  # asked "auto"
    assert report["device"] == "cpu" and report["architecture"] == "LlamaForCausalLM"
    assert report["loras"] == ["lora-a"]
    assert isinstance(report["memory"]["ram_increase_mib"], float)  # measured by the load
    assert "sk-secret-of-the-server" not in repr(report)  # the request's settings (keys included) are not echoed
    assert report["requested"] == {"n_ctx": 4096, "parallel": 2, "dtype": "auto", "loader": "transformers"}


def test_report_of_a_gguf_names_the_quantization_llama_cpp_read(hub_tiny: Path) -> None:
    (shared.models_dir() / DEFAULT_MODEL).symlink_to(default_model_path())
    wb = Workbench(DEFAULT_MODEL, options={"n_ctx": 512, "parallel": 1})
    report = wb.report()
    assert report["loader"] == "llama.cpp" and report["quantization"] == "Q4_1"  # from the file, not its name
    assert report["context_length"] == 512 and report["trained_context_length"] == 8192
    assert report["stats"]["slots"] == 1 and report["memory"]["ram_increase_mib"] > 0
