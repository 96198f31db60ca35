"""Perplexity of a base model and of base + LoRA on the same samples (an eval split, an eval file or a text file).

An adapter is measured as its run trained it: on that run's evaluation data (its eval file or the very samples it
held out), cut at its ``cutoff_len``, in its precision. A run that held nothing out is refused rather than measured
on its training data, as ``Trainer.evaluate()`` refuses without an ``eval_dataset``: a loss on the samples an
adapter was trained on shows how well it memorised them, not how well it does on new text.
"""

from __future__ import annotations

import contextlib
import math
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from modules.errors import InvalidRequest
from modules.jobs import Reporter, check
from modules.training.datasets import IGNORE, Sample

DEFAULT_CUTOFF = 512  # TrainingArgs.cutoff_len's default: an adapter without training_parameters.json


@dataclass
class EvalArgs:
    """What to compare."""

    model: str = ""
    """The base model: a Hugging Face folder (a path, or a name in the models folder); empty = the run's."""
    fallback_model: str = ""
    """The base when ``model`` is empty and the run recorded none (the Training tab's form model)."""
    lora: str = ""
    """The adapter: a name in loras/ (or a path to a PEFT adapter folder)."""
    dataset: str = ""
    """A dataset or text file (a path, or a name in user_data/training/datasets/); empty = the run's eval data (its
    eval file or its held-out split). A run without eval data is refused: name a file here (its training file
    too, if measuring what it was trained on is what you want)."""
    format: str = ""
    """The format file, for alpaca-style records; empty = the run's."""
    cutoff_len: int = 0
    """Longest sample in tokens (raw text is chunked at this length); 0 = the run's cutoff_len (512 without one)."""
    precision: str = ""
    """auto, bf16, fp16 or fp32 as in training; empty = the run's own (fp32 where it needs a GPU this machine lacks)."""
    batch_size: int = 4
    """Samples per forward pass."""


@dataclass
class EvalPrecision:
    """How the model is loaded and run: the dtype of its weights, and fp16 autocast (the Trainer's fp16 AMP)."""

    name: str
    dtype: Any
    autocast_fp16: bool


def eval_precision(requested: str, saved: str, cuda: bool) -> EvalPrecision:
    """The precision to evaluate in: ``requested`` (the user's), else ``saved`` (the run's), else auto.

    Training (``run.precision``) loads bf16 weights for bf16, fp32 weights under fp16 autocast for fp16 (the
    Trainer's AMP) and fp32 on the CPU, where bf16/fp16 training is refused; measuring in the same precision
    measures the model the run trained, so fp32 stays the CPU default. A run trained in bf16/fp16 on a GPU and
    measured on a machine without CUDA runs in fp32 there; a user asking for bf16/fp16 without CUDA is refused.
    """
    import torch

    choice = requested or saved or "auto"
    if choice not in ("auto", "bf16", "fp16", "fp32"):
        raise InvalidRequest(f"precision must be auto, bf16, fp16 or fp32 (got {choice!r})", param="precision")
    if choice in ("bf16", "fp16") and not cuda:
        if requested:
            raise InvalidRequest(f"{choice} evaluation needs a CUDA GPU; use fp32 here", param="precision")
        choice = "fp32"
    if choice == "auto":
        choice = ("bf16" if torch.cuda.is_bf16_supported() else "fp16") if cuda else "fp32"
    dtype = torch.bfloat16 if choice == "bf16" else torch.float32
    return EvalPrecision(choice, dtype, choice == "fp16")


def mean_loss(
    model: Any, samples: list[Sample], batch_size: int = 4, cancel: threading.Event | None = None
) -> tuple[float, int]:
    """The mean cross-entropy over every labelled token of ``samples`` (padded batches, no gradients), and how many
    tokens that is."""
    import torch

    device = next(model.parameters()).device
    total, count = 0.0, 0
    model.eval()
    with torch.no_grad():
        for start in range(0, len(samples), batch_size):
            if cancel is not None:
                check(cancel)
            batch = samples[start : start + batch_size]
            longest = max(len(s.input_ids) for s in batch)
            ids = torch.tensor([s.input_ids + [0] * (longest - len(s.input_ids)) for s in batch], device=device)
            labels = torch.tensor([s.labels + [IGNORE] * (longest - len(s.labels)) for s in batch], device=device)
            mask = torch.tensor([[1] * len(s.input_ids) + [0] * (longest - len(s.input_ids)) for s in batch])
            logits = model(input_ids=ids, attention_mask=mask.to(device)).logits[:, :-1].float()
            targets = labels[:, 1:]
            loss = torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=IGNORE, reduction="sum"
            )
            total += float(loss)
            count += int((targets != IGNORE).sum())
    if not count:
        raise InvalidRequest("the evaluation data has no labelled tokens", param="dataset")
    return total / count, count


def compare(model: Any, samples: list[Sample], name: str, batch_size: int = 4, cancel: Any = None) -> list[dict]:
    """Rows of (model, loss, perplexity, tokens measured) for the base (adapter disabled) and base + adapter, on a
    peft model."""
    with model.disable_adapter():
        base, tokens = mean_loss(model, samples, batch_size, cancel)
    tuned, _ = mean_loss(model, samples, batch_size, cancel)
    return [
        {"model": "base", "loss": round(base, 4), "perplexity": round(math.exp(min(base, 50)), 3), "tokens": tokens},
        {"model": f"base + {name}", "loss": round(tuned, 4), "perplexity": round(math.exp(min(tuned, 50)), 3),
         "tokens": tokens},
    ]  # fmt: skip


def evaluate(args: EvalArgs, report: Reporter, cancel: threading.Event) -> list[dict]:
    """Perplexity of the base model and of base + ``args.lora`` on ``args.dataset`` (or the run's eval data), with
    the run's cutoff and precision unless ``args`` names others; each row also says how many tokens were measured
    and in which precision."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from modules import shared
    from modules.paths import UnsafePath, safe_child
    from modules.training.args import PARAMETERS_FILE, saved_parameters
    from modules.training.datasets import load_training_data, paths_allowed, resolve_file
    from modules.training.run import resolve_model

    direct = Path(args.lora).expanduser()
    try:  # a path only where paths are allowed (the CLI, a script); the UI and the API name an adapter in loras/
        lora = direct if paths_allowed() and direct.is_absolute() else safe_child(shared.loras_dir(), args.lora)
    except UnsafePath as exc:
        raise InvalidRequest(f"invalid adapter name: {exc}", param="lora") from exc
    if not (lora / "adapter_config.json").is_file():
        raise InvalidRequest(f"{args.lora!r} is not a trained adapter (no adapter_config.json)", param="lora")
    if args.cutoff_len and args.cutoff_len < 8:
        raise InvalidRequest(f"cutoff_len must be at least 8, or 0 for the run's (got {args.cutoff_len})", "cutoff_len")
    params: dict[str, Any] = {}
    if (lora / PARAMETERS_FILE).is_file():
        params = saved_parameters(lora, "lora", "")
    model_path = resolve_model(args.model or params.get("model", "") or args.fallback_model)
    base = shared.user_data_dir() / "training"
    run_eval_file, run_split = str(params.get("eval_dataset") or ""), float(params.get("eval_split") or 0.0)
    if args.dataset:
        dataset, split = args.dataset, 0.0
    elif run_eval_file or run_split > 0:
        dataset, split = (run_eval_file, 0.0) if run_eval_file else (str(params.get("dataset", "")), run_split)
    elif params:
        raise InvalidRequest(
            f"loras/{lora.name} was trained without evaluation data (no eval_dataset, eval_split 0): measuring its "
            "training data would show how well it memorised it, not how it does on new text. Choose an evaluation "
            f"file as the dataset (its training file {params.get('dataset', '')!r}, to measure that on purpose)",
            param="dataset",
        )
    else:
        raise InvalidRequest(f"loras/{lora.name} has no {PARAMETERS_FILE}: choose an evaluation file", "dataset")
    cutoff = args.cutoff_len or int(params.get("cutoff_len") or DEFAULT_CUTOFF)
    overlap = int(params.get("overlap_len") or 0)  # the run's chunks of raw text, so its held-out split is the same
    fmt = args.format or params.get("format", "")
    chosen = eval_precision(args.precision, str(params.get("precision") or ""), torch.cuda.is_available())
    tokenizer = AutoTokenizer.from_pretrained(str(model_path), local_files_only=True)
    report(message="tokenizing")
    data = load_training_data(
        tokenizer,
        resolve_file(base / "datasets", dataset, "dataset"),
        cutoff=cutoff,
        overlap=overlap if overlap < cutoff else 0,
        format_path=resolve_file(base / "formats", fmt, "format", (".json",)) if fmt else None,
        eval_split=split,
        seed=int(params.get("seed", 42)),
    )
    samples = data.eval if split else data.train
    report(message=f"loading the model ({chosen.name})")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    loaded = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=chosen.dtype, local_files_only=True)
    model = PeftModel.from_pretrained(loaded, str(lora)).to(device)
    report(message="measuring perplexity")
    autocast = torch.autocast("cuda", dtype=torch.float16) if chosen.autocast_fp16 else contextlib.nullcontext()
    with autocast:
        rows = compare(model, samples, lora.name, args.batch_size, cancel)
    return [{**row, "precision": chosen.name} for row in rows]
