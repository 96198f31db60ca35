"""ONNX export of the tiny random Llama with torch.onnx.export: onnxruntime computes what transformers computes, the
CLI a user types works, a cancel leaves nothing under the final name, and a missing package is named."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from modules import jobs
from modules.errors import BackendUnavailable
from modules.lifecycle.export import ExportArgs, ExportResult, export
from tests.conftest import ROOT

PROMPT = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"


def noop(*args: Any, **kwargs: Any) -> None:
    """A reporter that ignores progress."""


@pytest.fixture(scope="module")
def onnx_export(tiny_models: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, ExportResult]:
    out = tmp_path_factory.mktemp("onnx") / "tiny-llama-onnx"
    result = export(ExportArgs(tiny_models / "tiny-llama", format="onnx", output=out), noop, threading.Event())
    return out, result


def _hf(folder: Path) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32, local_files_only=True).eval()


def test_onnx_runtime_gives_transformers_logits_and_greedy_tokens(
    onnx_export: tuple[Path, ExportResult], tiny_models: Path
) -> None:
    import onnxruntime as ort
    import torch
    from transformers import AutoTokenizer

    out, result = onnx_export
    assert result.output == str(out) and result.format == "onnx"
    names = {p.name for p in out.iterdir()}
    assert {"model.onnx", "model.onnx.data", "config.json", "generation_config.json", "tokenizer.json"} <= names
    assert "chat_template.jinja" in names or "chat_template" in (out / "tokenizer_config.json").read_text()
    fid = result.fidelity
    assert fid is not None and fid["onnx_max_abs_diff"] < 1e-3 and fid["top1_agreement"] == 1.0
    assert fid["prompts_identical"] == len(fid["agreement"]) == 5 and fid["kv_cache"] is True

    # the exported folder on its own: its tokenizer, onnxruntime, greedy decoding against transformers' generate()
    model = _hf(tiny_models / "tiny-llama")
    tokenizer = AutoTokenizer.from_pretrained(str(out), local_files_only=True)
    ids = tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    sess = ort.InferenceSession(str(out / "model.onnx"), providers=["CPUExecutionProvider"])
    with torch.no_grad():
        want_logits = model(torch.tensor([ids])).logits[0].numpy()
        generated = model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False, min_new_tokens=8)
    want_tokens = generated[0, len(ids) :].tolist()
    inputs = [i.name for i in sess.get_inputs()]
    past_names = [n for n in inputs if n.startswith("past_key_values.")]
    assert inputs[:3] == ["input_ids", "attention_mask", "position_ids"] and len(past_names) == 2 * 2  # 2 layers

    def feed(batch: list[list[int]], mask: np.ndarray, past: list[np.ndarray] | None = None) -> dict[str, Any]:
        x = np.asarray(batch, dtype=np.int64)
        past = past or [np.zeros((len(batch), 2, 0, 16), np.float32)] * len(past_names)  # 2 KV heads of 16
        start = past[0].shape[2]
        positions = np.broadcast_to(np.arange(start, start + x.shape[1]), x.shape).astype(np.int64)
        return {
            "input_ids": x,
            "attention_mask": mask,
            "position_ids": positions,
            **dict(zip(past_names, past, strict=True)),
        }

    got_logits = sess.run(None, feed([ids], np.ones((1, len(ids)), np.int64)))[0][0]
    assert np.abs(got_logits - want_logits).max() < 1e-3
    # greedy decoding with the KV cache carried from step to step, as an ONNX runtime user would
    seq, step, past, got_tokens = list(ids), list(ids), None, []
    for _ in range(8):
        out = sess.run(None, feed([step], np.ones((1, len(seq)), np.int64), past))
        got_tokens.append(int(out[0][0, -1].argmax()))
        seq.append(got_tokens[-1])
        step, past = [got_tokens[-1]], out[1:]
    assert got_tokens == want_tokens
    # the batch axis is dynamic: two prompts of different lengths in one call, right-padded
    other = tokenizer("Once upon a time", add_special_tokens=False)["input_ids"]
    width = len(ids)
    mask = np.asarray([[1] * width, [1] * len(other) + [0] * (width - len(other))], dtype=np.int64)
    logits = sess.run(None, feed([ids, other + [0] * (width - len(other))], mask))[0]
    with torch.no_grad():
        want_other = model(torch.tensor([other])).logits[0].numpy()
    assert logits.shape[:2] == (2, width)
    assert np.abs(logits[0] - want_logits).max() < 1e-3
    assert np.abs(logits[1, : len(other)] - want_other).max() < 1e-3


def test_cli_exports_onnx_and_prints_the_check(tiny_models: Path, tmp_path: Path) -> None:
    out = tmp_path / "cli-onnx"
    cli = [sys.executable, "-m", "modules.lifecycle", "export", str(tiny_models / "tiny-llama"), "--format", "onnx"]
    done = subprocess.run([*cli, "--output", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"wrote {out}" in done.stdout
    assert "greedy agreement 5/5 prompts" in done.stdout and "max |logit diff| vs transformers" in done.stdout
    assert (out / "model.onnx").is_file() and (out / "tokenizer.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cli-onnx"]  # no .partial left beside it
    again = [*cli, "--output", str(out), "--json"]
    refused = subprocess.run(again, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert refused.returncode == 1 and "--overwrite" in refused.stderr  # the first export is kept
    done = subprocess.run([*again, "--overwrite"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cli-onnx"]  # the old folder went once the new was in
    result = json.loads(done.stdout[done.stdout.index("{") :])
    assert result["format"] == "onnx" and result["fidelity"]["top1_agreement"] == 1.0


@pytest.mark.parametrize("stage", ["exporting to ONNX", "checking with onnxruntime"])
def test_cancel_leaves_no_folder_under_the_final_name(tiny_models: Path, tmp_path: Path, stage: str) -> None:
    out = tmp_path / "tiny-onnx"

    def run(report: jobs.Reporter, cancel: threading.Event) -> Any:
        def spy(*args: Any, message: str = "", **kwargs: Any) -> None:
            if stage in message:
                cancel.set()  # the user presses Cancel while this step runs
            report(*args, message=message, **kwargs)

        return export(ExportArgs(tiny_models / "tiny-llama", format="onnx", output=out), spy, cancel)

    job = jobs.start("export", "onnx cancel test", run)
    assert job.wait(300)
    assert job.state == "cancelled", (job.state, job.error)
    assert not out.exists()
    assert list(tmp_path.iterdir()) == []  # no .partial either


def test_missing_onnxruntime_is_named(tiny_models: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # what an environment without the extra looks like
    out = tmp_path / "x-onnx"
    with pytest.raises(BackendUnavailable, match=r"missing: onnxruntime.*requirements-onnx\.txt"):
        export(ExportArgs(tiny_models / "tiny-llama", format="onnx", output=out), noop, threading.Event())
    assert list(tmp_path.iterdir()) == []
