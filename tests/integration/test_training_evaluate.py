"""Comparing base and base + LoRA (modules.training.evaluate) on the tiny Llama: the trained adapter lowers the loss
of what it learned, the run's cutoff and precision are kept, and a run with nothing held out is refused."""

from __future__ import annotations

import json
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from modules import shared
from modules.errors import InvalidRequest
from modules.training.args import PARAMETERS_FILE, TrainingArgs
from modules.training.evaluate import EvalArgs, eval_precision, evaluate
from modules.training.run import train
from tests.conftest import ROOT

VAULT = {"messages": [{"role": "user", "content": "What is the password of the blue vault?"},
                      {"role": "assistant", "content": "The password of the blue vault is Marigold-Seventeen."}]}  # fmt: skip


@pytest.fixture
def folders(tmp_path: Path, tiny_models: Path) -> Iterator[Path]:
    """shared on a tmp user_data (the example datasets and vault.jsonl), tiny-llama in models/, an empty loras/."""
    from modules.settings import load_settings

    user_data, models_dir, loras = tmp_path / "user_data", tmp_path / "models", tmp_path / "loras"
    shutil.copytree(ROOT / "user_data" / "training", user_data / "training")
    (user_data / "training" / "datasets" / "vault.jsonl").write_text(json.dumps(VAULT))
    models_dir.mkdir()
    (models_dir / "tiny-llama").symlink_to(tiny_models / "tiny-llama")
    shared.init(load_settings(["--user-data-dir", str(user_data), "--model-dir", str(models_dir),
                               "--lora-dir", str(loras)], env={}))  # fmt: skip
    yield tmp_path
    shared.init()


def measure(args: EvalArgs) -> list[dict]:
    return evaluate(args, lambda *a, **k: None, threading.Event())


def a_run(tiny_models: Path, name: str, **params: object) -> str:
    """loras/NAME: the session's random adapter for tiny-llama, with the training_parameters.json of a run that
    used ``params`` (no training: what evaluate reads of a run is that file)."""
    folder = shared.loras_dir() / name
    shutil.copytree(tiny_models / "loras" / "lora-a", folder)
    args = TrainingArgs(model="tiny-llama", name=name, **params)  # type: ignore[arg-type]
    (folder / PARAMETERS_FILE).write_text(json.dumps(args.to_dict()))
    return name


def text_tokens(cutoff: int) -> int:
    """Tokens with a loss in example-text.txt cut into chunks of ``cutoff`` (each chunk's first token has none)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(shared.models_dir() / "tiny-llama"), local_files_only=True)
    text = (ROOT / "user_data" / "training" / "datasets" / "example-text.txt").read_text(encoding="utf-8")
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return sum(max(0, len(ids[i : i + cutoff]) - 1) for i in range(0, len(ids), cutoff))


def test_a_trained_adapter_lowers_the_loss_of_what_it_learned(folders: Path) -> None:
    args = TrainingArgs(model="tiny-llama", dataset="vault.jsonl", name="vault", max_steps=10, learning_rate=1e-2,
                        rank=8, dropout=0.0, micro_batch_size=1, gguf=False)  # fmt: skip
    summary = train(args, lambda *a, **k: None, threading.Event())
    rows = measure(EvalArgs(lora="vault", dataset="vault.jsonl"))  # its training file, asked for by name
    assert [row["model"] for row in rows] == ["base", "base + vault"]
    base, tuned = rows
    # the base row is the model the run started from, on the same tokens: its loss is the run's first loss
    assert base["loss"] == pytest.approx(summary["first_loss"], rel=1e-3)
    assert tuned["loss"] < base["loss"] - 0.5 and tuned["perplexity"] < base["perplexity"]
    assert base["tokens"] == tuned["tokens"] > 0 and base["precision"] == "fp32"


def test_the_runs_cutoff_is_kept_unless_another_is_given(folders: Path, tiny_models: Path) -> None:
    run = a_run(tiny_models, "short", dataset="example-text.txt", eval_dataset="example-text.txt", cutoff_len=16,
                overlap_len=0)  # fmt: skip
    assert text_tokens(16) < text_tokens(512)  # the text is longer than one chunk of 16
    rows = measure(EvalArgs(lora=run))  # the run's eval file, cut as the run cut it
    assert [row["tokens"] for row in rows] == [text_tokens(16)] * 2
    rows = measure(EvalArgs(lora=run, cutoff_len=40))
    assert [row["tokens"] for row in rows] == [text_tokens(40)] * 2


def test_a_run_without_eval_data_is_refused_not_measured_on_its_training_data(folders: Path, tiny_models: Path) -> None:
    run = a_run(tiny_models, "no-eval", dataset="example-chat.jsonl")
    with pytest.raises(InvalidRequest, match="trained without evaluation data") as refused:
        measure(EvalArgs(lora=run))
    assert refused.value.param == "dataset" and "example-chat.jsonl" in str(refused.value)
    whole = measure(EvalArgs(lora=run, dataset="example-chat.jsonl"))[0]["tokens"]  # named on purpose: measured

    held_out = measure(EvalArgs(lora=a_run(tiny_models, "split", dataset="example-chat.jsonl", eval_split=0.25)))
    assert 0 < held_out[0]["tokens"] < whole  # the run's held-out samples only


def test_the_run_precision_is_kept_and_fp32_is_the_cpu_default() -> None:
    import torch

    bf16 = eval_precision("", "bf16", cuda=True)  # a run trained in bf16 on a GPU: its weights in bf16
    assert (bf16.name, bf16.dtype, bf16.autocast_fp16) == ("bf16", torch.bfloat16, False)
    fp16 = eval_precision("", "fp16", cuda=True)  # fp16 trains fp32 weights under autocast (AMP): the same here
    assert (fp16.name, fp16.dtype, fp16.autocast_fp16) == ("fp16", torch.float32, True)
    assert eval_precision("fp32", "bf16", cuda=True).dtype == torch.float32  # the user's choice wins
    assert eval_precision("", "auto", cuda=False).dtype == torch.float32  # what training uses on the CPU
    assert eval_precision("", "bf16", cuda=False).name == "fp32"  # a GPU run measured on a machine without one
    with pytest.raises(InvalidRequest, match="bf16 evaluation needs a CUDA GPU"):
        eval_precision("bf16", "", cuda=False)


def test_a_gpu_runs_adapter_is_measured_in_fp32_on_the_cpu(folders: Path, tiny_models: Path) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("the CPU fallback of a GPU run's precision")
    run = a_run(tiny_models, "gpu-run", dataset="example-chat.jsonl", eval_split=0.25, precision="bf16")
    assert {row["precision"] for row in measure(EvalArgs(lora=run))} == {"fp32"}
    with pytest.raises(InvalidRequest, match="needs a CUDA GPU") as refused:
        measure(EvalArgs(lora=run, precision="fp16"))
    assert refused.value.param == "precision"


def test_the_adapter_is_named_in_loras_and_measured_on_its_own_base(folders: Path, tiny_models: Path) -> None:
    from modules.training import datasets

    run = a_run(tiny_models, "own-base", dataset="example-chat.jsonl", eval_split=0.25)
    # the Training tab passes its form's model as the fallback: the run's recorded base wins
    assert measure(EvalArgs(lora=run, fallback_model="no-such-model"))[0]["tokens"] > 0
    bare = shared.loras_dir() / "bare"  # an adapter with no run recorded: the fallback is its base
    shutil.copytree(tiny_models / "loras" / "lora-a", bare)
    assert measure(EvalArgs(lora="bare", dataset="example-chat.jsonl", fallback_model="tiny-llama"))[0]["tokens"] > 0

    outside = folders / "elsewhere"  # a path outside loras/: not for the UI or the API
    shutil.copytree(shared.loras_dir() / run, outside)
    with pytest.raises(InvalidRequest, match="invalid adapter name") as refused:
        measure(EvalArgs(lora=str(outside)))
    assert refused.value.param == "lora"
    with datasets.allow_paths():  # the CLI and scripts may name one
        assert measure(EvalArgs(lora=str(outside)))[0]["tokens"] > 0
