"""Perplexity of a base model and of base + LoRA on the same samples (an eval split, an eval file or a text file)."""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from modules.errors import InvalidRequest
from modules.jobs import Reporter, check
from modules.training.datasets import IGNORE, Sample


@dataclass
class EvalArgs:
    """What to compare."""

    model: str = ""
    """The base model: a Hugging Face folder (a path, or a name in the models folder)."""
    lora: str = ""
    """The adapter: a name in loras/ (or a path to a PEFT adapter folder)."""
    dataset: str = ""
    """A dataset or text file (a path, or a name in user_data/training/datasets/); empty = the run's eval data."""
    format: str = ""
    """The format file, for alpaca-style records."""
    cutoff_len: int = 512
    """Longest sample in tokens (raw text is chunked at this length)."""
    batch_size: int = 4
    """Samples per forward pass."""


def mean_loss(model: Any, samples: list[Sample], batch_size: int = 4, cancel: threading.Event | None = None) -> float:
    """The mean cross-entropy over every labelled token of ``samples`` (padded batches, no gradients)."""
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
    return total / count


def compare(model: Any, samples: list[Sample], name: str, batch_size: int = 4, cancel: Any = None) -> list[dict]:
    """Rows of (model, loss, perplexity) for the base (adapter disabled) and base + adapter, on a peft model."""
    with model.disable_adapter():
        base = mean_loss(model, samples, batch_size, cancel)
    tuned = mean_loss(model, samples, batch_size, cancel)
    return [
        {"model": "base", "loss": round(base, 4), "perplexity": round(math.exp(min(base, 50)), 3)},
        {"model": f"base + {name}", "loss": round(tuned, 4), "perplexity": round(math.exp(min(tuned, 50)), 3)},
    ]


def evaluate(args: EvalArgs, report: Reporter, cancel: threading.Event) -> list[dict]:
    """Perplexity of the base model and of base + ``args.lora`` on ``args.dataset`` (or the run's eval data)."""
    import json

    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from modules import shared
    from modules.paths import safe_child
    from modules.training.datasets import load_training_data, resolve_file
    from modules.training.run import resolve_model

    lora = Path(args.lora) if Path(args.lora).is_absolute() else safe_child(shared.loras_dir(), args.lora)
    if not (lora / "adapter_config.json").is_file():
        raise InvalidRequest(f"{args.lora!r} is not a trained adapter (no adapter_config.json)", param="lora")
    params: dict[str, Any] = {}
    if (lora / "training_parameters.json").is_file():
        params = json.loads((lora / "training_parameters.json").read_text(encoding="utf-8"))
    model_path = resolve_model(args.model or params.get("model", ""))
    base = shared.user_data_dir() / "training"
    dataset = args.dataset or params.get("eval_dataset") or params.get("dataset", "")
    if not dataset:
        raise InvalidRequest("choose an evaluation file", param="dataset")
    fmt = args.format or params.get("format", "")
    tokenizer = AutoTokenizer.from_pretrained(str(model_path), local_files_only=True)
    report(message="tokenizing")
    data = load_training_data(
        tokenizer,
        resolve_file(base / "datasets", dataset, "dataset"),
        cutoff=args.cutoff_len,
        format_path=resolve_file(base / "formats", fmt, "format", (".json",)) if fmt else None,
        eval_split=0.0 if args.dataset or params.get("eval_dataset") else float(params.get("eval_split", 0.0)),
        seed=int(params.get("seed", 42)),
    )
    samples = data.eval or data.train
    report(message="loading the model")
    model = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(str(model_path), local_files_only=True), str(lora)
    )
    report(message="measuring perplexity")
    return compare(model, samples, lora.name, args.batch_size, cancel)
