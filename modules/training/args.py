"""The arguments of a LoRA training run: one dataclass whose field docstrings are the docs the UI and the CLI show."""

from __future__ import annotations

import ast
import inspect
import itertools
import json
import textwrap
from dataclasses import asdict, dataclass, field, fields
from functools import cache
from pathlib import Path
from typing import Any

from modules.errors import InvalidRequest

SCHEDULERS = ("linear", "cosine", "constant", "constant_with_warmup", "cosine_with_restarts", "polynomial")
OPTIMIZERS = ("adamw_torch", "adamw_torch_fused", "adafactor", "sgd", "adamw_8bit", "paged_adamw_8bit")
BATCHING = ("padding_free", "padded")


@dataclass
class TrainingArgs:
    """Everything a LoRA run needs; saved as training_parameters.json next to the adapter."""

    model: str = ""
    """The base model: a Hugging Face folder (a path, or a name in the models folder)."""
    dataset: str = ""
    """The training data: a file (a path, or a name in user_data/training/datasets/): chat `messages` or ShareGPT
    `conversations` (JSON or JSONL), alpaca-style records (with a format file), or raw text (.txt)."""
    name: str = ""
    """The adapter's name: the run writes loras/NAME/."""
    format: str = ""
    """For alpaca-style records: a format file in user_data/training/formats/ (text-generation-webui's convention:
    {"instruction,output": "...%instruction%...%output%", ...}). Empty for chat data and raw text."""
    eval_dataset: str = ""
    """An evaluation file in the same form as the dataset; empty to use the eval split (or none)."""
    eval_split: float = 0.0
    """The fraction of the dataset held out for evaluation when no eval file is given (0 = no evaluation)."""
    eval_steps: int = 0
    """Evaluate every N steps (0 = at the end of each epoch when there is eval data)."""
    epochs: float = 3.0
    """Passes over the dataset (fractions allowed)."""
    max_steps: int = 0
    """Stop after this many optimizer steps (0 = as many as the epochs take)."""
    learning_rate: float = 3e-4
    """The peak learning rate."""
    lr_scheduler: str = "linear"
    """How the learning rate changes over the run: linear, cosine, constant, constant_with_warmup, ..."""
    warmup_steps: int = 0
    """Steps of linear warm-up from 0 to the learning rate."""
    optimizer: str = "adamw_torch"
    """The optimizer (transformers' names: adamw_torch, adafactor, sgd, adamw_8bit needs bitsandbytes + CUDA)."""
    weight_decay: float = 0.0
    """Weight decay of the optimizer."""
    micro_batch_size: int = 4
    """Samples per forward pass (per device)."""
    gradient_accumulation: int = 1
    """Micro-batches summed before each optimizer step (effective batch = micro batch x this x devices)."""
    cutoff_len: int = 512
    """Longest sample in tokens: longer chat or instruction samples are cut, raw text is chunked at this length."""
    overlap_len: int = 64
    """Raw text only: tokens shared by two consecutive chunks."""
    batching: str = "padding_free"
    """padding_free: a micro-batch's samples are concatenated with restarting positions, so short samples waste no
    compute; padded: each sample is padded to the longest in its micro-batch (the classic way)."""
    rank: int = 16
    """LoRA rank (r): the width of the low-rank update."""
    alpha: int = 32
    """LoRA alpha: the update is scaled by alpha / rank."""
    dropout: float = 0.05
    """Dropout on the LoRA input."""
    target_modules: list[str] = field(default_factory=list)
    """Layers to adapt, by their last name (q_proj, v_proj, ...); empty = every linear layer but the output head."""
    bias: str = "none"
    """Train biases too: none, all or lora_only."""
    load_in_4bit: bool = False
    """QLoRA: load the base model in 4-bit with bitsandbytes (needs a CUDA GPU)."""
    precision: str = "auto"
    """auto (bf16 on a GPU that has it, else fp16 on GPU, else fp32), bf16, fp16 or fp32."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass: less memory, about 30% slower."""
    seed: int = 42
    """Random seed (data order, LoRA initialisation, dropout)."""
    stop_at_loss: float = 0.0
    """Stop as soon as the training loss falls to this value (0 = never)."""
    save_steps: int = 0
    """Write a checkpoint every N steps (0 = only at the end); a stopped or crashed run resumes from the latest."""
    save_total_limit: int = 2
    """Checkpoints kept, the newest (each holds the optimizer state, about 3x the adapter); 0 keeps them all."""
    resume: bool = False
    """Continue from the latest checkpoint in loras/NAME/ at its step, with the run's own arguments (others are
    refused)."""
    overwrite: bool = False
    """Replace an existing loras/NAME/ (otherwise an existing adapter is refused)."""
    copy_from: str = ""
    """Start from the parameters of an earlier run (its name in loras/): the CLI flags you give win over them (one
    given at its default value too); in the Training tab and in Python the fields that differ from their defaults
    win, and a field left at its default takes the earlier run's value."""
    logging_steps: int = 1
    """Report loss and learning rate every N steps."""
    gguf: bool = True
    """Also write the adapter as a GGUF LoRA (adapter.gguf) so llama.cpp can apply it to the same model's GGUF."""

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able values."""
        return asdict(self)

    def validate(self) -> None:
        """Raise InvalidRequest naming the first wrong field."""
        if not self.model:
            raise InvalidRequest("choose a base model", param="model")
        if not self.dataset:
            raise InvalidRequest("choose a dataset", param="dataset")
        if not self.name or not self.name.strip():
            raise InvalidRequest("give the adapter a name", param="name")
        checks = [
            (self.epochs > 0 or self.max_steps > 0, "epochs", "must be above 0"),
            (self.learning_rate > 0, "learning_rate", "must be above 0"),
            (self.rank >= 1, "rank", "must be at least 1"),
            (self.alpha > 0, "alpha", "must be above 0"),
            (0 <= self.dropout < 1, "dropout", "must be in [0, 1)"),
            (self.micro_batch_size >= 1, "micro_batch_size", "must be at least 1"),
            (self.gradient_accumulation >= 1, "gradient_accumulation", "must be at least 1"),
            (self.cutoff_len >= 8, "cutoff_len", "must be at least 8"),
            (0 <= self.overlap_len < self.cutoff_len, "overlap_len", "must be in [0, cutoff_len)"),
            (0 <= self.eval_split < 1, "eval_split", "must be in [0, 1)"),
            (self.lr_scheduler in SCHEDULERS, "lr_scheduler", f"must be one of {', '.join(SCHEDULERS)}"),
            (self.optimizer in OPTIMIZERS, "optimizer", f"must be one of {', '.join(OPTIMIZERS)}"),
            (self.batching in BATCHING, "batching", f"must be one of {', '.join(BATCHING)}"),
            (self.bias in ("none", "all", "lora_only"), "bias", "must be none, all or lora_only"),
            (self.precision in ("auto", "bf16", "fp16", "fp32"), "precision", "must be auto, bf16, fp16 or fp32"),
            (self.save_steps >= 0 and self.max_steps >= 0 and self.warmup_steps >= 0, "save_steps", "must be >= 0"),
            (self.save_total_limit >= 0, "save_total_limit", "must be >= 0 (0 keeps every checkpoint)"),
        ]
        for ok, name, problem in checks:
            if not ok:
                raise InvalidRequest(f"{name} {problem} (got {getattr(self, name)!r})", param=name)


@cache
def field_docs() -> dict[str, str]:
    """Each field's docstring, as one line of text (the help of the CLI and the info of the UI)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(TrainingArgs)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for node, following in itertools.pairwise(body):
        named = isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
        if named and isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant):
            docs[node.target.id] = " ".join(str(following.value.value).split())  # type: ignore[union-attr]
    return docs


def from_dict(values: dict[str, Any]) -> TrainingArgs:
    """TrainingArgs from a dict (a saved training_parameters.json or a form), refusing unknown keys."""
    names = {f.name for f in fields(TrainingArgs)}
    unknown = sorted(set(values) - names)
    if unknown:
        raise InvalidRequest(f"unknown training parameter(s): {', '.join(unknown)}", param=unknown[0])
    return TrainingArgs(**values)


PARAMETERS_FILE = "training_parameters.json"
LOG_FILE = "training_log.json"


def saved_parameters(lora_dir: Path, param: str, missing: str) -> dict[str, Any]:
    """A run's ``training_parameters.json`` (what copy-from, resume and its check read); an InvalidRequest on
    ``param`` that says ``missing`` when there is none, or why it cannot be read."""
    path = lora_dir / PARAMETERS_FILE
    if not path.is_file():
        raise InvalidRequest(f"loras/{lora_dir.name} has no {PARAMETERS_FILE}: {missing}", param=param)
    try:
        saved = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise InvalidRequest(f"{path}: cannot read it ({exc})", param=param) from exc
    if not isinstance(saved, dict):
        raise InvalidRequest(f"{path}: not a JSON object", param=param)
    return saved


def copy_parameters(args: TrainingArgs, lora_dir: Path, explicit: set[str]) -> TrainingArgs:
    """``args`` with the fields of an earlier run's training_parameters.json, but for those in ``explicit``."""
    saved = saved_parameters(lora_dir, "copy_from", "nothing to copy from")
    keep = {"name", "copy_from", "resume", "overwrite"} | explicit
    merged = {**{k: v for k, v in saved.items() if k not in keep}, **{k: getattr(args, k) for k in keep}}
    return from_dict({k: v for k, v in merged.items() if k in {f.name for f in fields(TrainingArgs)}})
