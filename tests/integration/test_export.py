"""Export of the default model's HF copy with llama.cpp's own converter: the same model, a smaller file, a clean
cancel, and the CLI a user types."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from modules import jobs
from modules.errors import InvalidRequest
from modules.lifecycle import fidelity, quantize
from modules.lifecycle.export import ExportArgs, export
from tests.conftest import ROOT, hf_default_model

pytestmark = pytest.mark.slow


def noop(*args: Any, **kwargs: Any) -> None:
    """A reporter that ignores progress."""


@pytest.fixture(scope="module")
def f16_export(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    out = tmp_path_factory.mktemp("export") / "SmolLM2.F16.gguf"
    result = export(ExportArgs(hf_default_model(), quant="F16", output=out), noop, threading.Event())
    assert result.fidelity is not None
    return out, result.fidelity


def test_f16_export_agrees_with_the_hf_model_token_for_token(f16_export: tuple[Path, dict[str, Any]]) -> None:
    path, report = f16_export
    assert quantize.tensor_types(path).get("F16", 0) > 100  # really an F16 file
    assert path.with_name(path.name + ".fidelity.json").is_file()
    assert not list(path.parent.glob("*.partial")) and not list(path.parent.glob(".*"))
    agreement = report["agreement"]
    assert len(agreement) == 5
    identical = [a for a in agreement if a["agreed"] == a["total"] == 32]
    assert len(identical) >= 4, agreement
    for item in agreement:  # where they part, it must be a near-tie in the HF model (rounding), not another model
        if item["margin"] is not None:
            assert item["agreed"] >= 8 and abs(item["margin"]) < 0.5, item
    assert 5 < report["perplexity"] < 80  # the model reads English, not noise


def test_q8_0_is_close_to_f16(f16_export: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    f16, _ = f16_export
    result = export(ExportArgs(f16, quant="Q8_0", output=tmp_path / "SmolLM2.Q8_0.gguf"), noop, threading.Event())
    assert result.fidelity is not None
    assert result.fidelity["kld"] < 0.01, fidelity.summary(result.fidelity)
    assert result.fidelity["top1_same"] > 0.9
    assert 8.0 < result.fidelity["bits_per_weight"] < 9.0
    assert Path(result.output).stat().st_size < f16.stat().st_size * 0.6


def test_types_that_need_an_importance_matrix_are_refused(tmp_path: Path) -> None:
    out = tmp_path / "x.IQ2_XS.gguf"
    with pytest.raises(InvalidRequest, match="importance matrix"):
        export(ExportArgs(hf_default_model(), quant="IQ2_XS", output=out), noop, threading.Event())
    with pytest.raises(InvalidRequest, match="unknown quantization type"):
        export(ExportArgs(hf_default_model(), quant="Q9_K", output=out), noop, threading.Event())
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("stage", ["reading tensors", "quantizing"])
def test_cancel_leaves_no_file_under_the_final_name(request: pytest.FixtureRequest, tmp_path: Path, stage: str) -> None:
    out = tmp_path / "SmolLM2.Q4_K_M.gguf"
    source = hf_default_model() if stage == "reading tensors" else request.getfixturevalue("f16_export")[0]
    holder: dict[str, threading.Event] = {}

    def run(report: jobs.Reporter, cancel: threading.Event) -> Any:
        holder["cancel"] = cancel

        def spy(*args: Any, message: str = "", **kwargs: Any) -> None:
            if stage in message:
                cancel.set()  # the user presses Cancel while this step runs
            report(*args, message=message, **kwargs)

        return export(ExportArgs(source, quant="Q4_K_M", output=out), spy, cancel)

    job = jobs.start("export", "cancel test", run)
    assert job.wait(120)
    assert job.state == "cancelled", (job.state, job.error)
    assert not out.exists()
    assert [p.name for p in tmp_path.iterdir()] == []  # no .partial, no work folder


def test_cli_merge_then_export_and_refusal(tiny_models: Path, tmp_path: Path) -> None:
    cli = [sys.executable, "-m", "modules.lifecycle"]
    base, lora, merged = tiny_models / "tiny-llama", tiny_models / "loras" / "lora-a", tmp_path / "merged"

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*cli, *args], cwd=ROOT, capture_output=True, text=True, timeout=300)

    done = run("merge", str(base), str(lora), "--output", str(merged))
    assert done.returncode == 0, done.stderr[-2000:]
    assert (merged / "model.safetensors").is_file() and f"merged into {merged}" in done.stdout
    out = tmp_path / "merged.Q4_0.gguf"
    done = run(
        "export", str(merged), "--format", "gguf", "--quant", "Q4_0", "--output", str(out), "--no-check", "--json"
    )
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout[done.stdout.index("{") :])
    assert result["output"] == str(out) and result["quant"] == "Q4_0"
    types = quantize.tensor_types(out)
    assert types.get("Q4_0", 0) > 0 and "F16" not in types
    exported = out.read_bytes()
    for again in ([str(merged), "--quant", "Q4_0", "--output", str(out)], [str(base), "--format", "safetensors",
                  "--output", str(merged)]):  # fmt: skip
        refused = run("export", *again, "--no-check")  # an existing file or model is kept
        assert refused.returncode == 1 and "exists" in refused.stderr and "--overwrite" in refused.stderr
        assert "Traceback" not in refused.stderr
    assert out.read_bytes() == exported and (merged / "model.safetensors").is_file()
    replaced = run("export", str(merged), "--quant", "Q8_0", "--output", str(out), "--no-check", "--overwrite")
    assert replaced.returncode == 0, replaced.stderr[-2000:]
    assert quantize.tensor_types(out).get("Q8_0", 0) > 0
    refused = run("export", str(merged), "--quant", "IQ1_S", "--output", str(tmp_path / "x.gguf"))
    assert refused.returncode == 1
    assert "importance matrix" in refused.stderr and "Traceback" not in refused.stderr
    assert not (tmp_path / "x.gguf").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["merged", "merged.Q4_0.gguf"]


def test_an_export_that_is_not_the_model_is_refused_and_leaves_nothing(tmp_path: Path) -> None:
    """The default model with a config that transformers reads one way and llama.cpp's converter another (the
    activation): the file converts, but it is another function than the HF model, and the check refuses it."""
    source = tmp_path / "wrong-activation"
    source.mkdir()
    for item in hf_default_model().iterdir():
        (source / item.name).symlink_to(item)
    config = json.loads((hf_default_model() / "config.json").read_text())
    (source / "config.json").unlink()
    (source / "config.json").write_text(json.dumps({**config, "hidden_act": "gelu"}))
    out = tmp_path / "out" / "wrong.F16.gguf"
    with pytest.raises(fidelity.FidelityFailed, match="parts from the HF model where that model was sure") as failed:
        export(ExportArgs(source, quant="F16", output=out), noop, threading.Event())
    assert "greedy agreement" in str(failed.value) and "--no-check" in str(failed.value)
    assert list(out.parent.iterdir()) == []  # no file, no report, no work folder
    result = export(ExportArgs(source, quant="F16", output=out, check=False), noop, threading.Event())
    assert out.is_file() and result.fidelity is None  # asked for: kept unchecked


def _running(processes: list[psutil.Process], within_s: float) -> list[psutil.Process]:
    """Those of ``processes`` still running (not ended, not a zombie) after waiting up to ``within_s``."""

    def alive(p: psutil.Process) -> bool:
        try:
            return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    deadline = time.monotonic() + within_s
    while any(alive(p) for p in processes) and time.monotonic() < deadline:
        time.sleep(0.05)
    return [p for p in processes if alive(p)]


def test_the_model_tabs_export_runs_in_a_child_process_a_sigkill_ends_alone(tiny_models: Path, tmp_path: Path) -> None:
    """The Model tab starts merge, export and the quant table in a child process (jobs.start_process): SIGKILL
    there fails that job with the reason, ends the converter it started, leaves nothing under the output's name, and a
    retry works."""
    from modules.ui import export_panel

    out = tmp_path / "tiny.Q8_0.gguf"
    args = ExportArgs(tiny_models / "tiny-llama", quant="Q8_0", output=out, check=False)
    job = export_panel.start_job("export tiny-llama Q8_0", export, args)
    deadline = time.monotonic() + 120
    while not (job.pid and job.message) and job.state == "running" and time.monotonic() < deadline:
        time.sleep(0.02)  # the child has started the export (it reports its first step)
    assert job.state == "running" and job.pid is not None and job.pid != os.getpid()
    converters = [p for p in psutil.Process(job.pid).children() if "convert_hf_to_gguf" in " ".join(p.cmdline())]
    assert converters  # started before the first report
    os.kill(job.pid, signal.SIGKILL)
    assert job.wait(60) and job.state == "failed"
    assert "SIGKILL" in (job.error or ""), job.error
    # the converter the killed child started went with it: left running, it wrote into the retry's work folder
    # (it would take seconds more to finish; killed, it is gone, or a zombie where no init reaps it, within 2 s)
    assert not _running(converters, within_s=2.0), "the killed export's converter is still running"
    assert not out.exists()
    again = export_panel.start_job("export tiny-llama Q8_0", export, args)
    assert again.wait(300) and again.state == "done", again.error
    assert Path(again.result.output) == out and quantize.tensor_types(out).get("Q8_0", 0) > 0
    assert sorted(p.name for p in tmp_path.iterdir()) == [out.name]  # the killed run's work folder went too
