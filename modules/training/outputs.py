"""What a finished run leaves in loras/NAME/: adapter, parameters, log, loss plot, README and the GGUF LoRA."""

from __future__ import annotations

import io
import json
import logging
import os
import shutil
import tempfile
import threading
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from modules.fileio import atomic_write_bytes, atomic_write_text
from modules.training.args import LOG_FILE, TrainingArgs
from modules.training.datasets import TrainingData

if TYPE_CHECKING:
    from modules.training.run import Paths

log = logging.getLogger(__name__)
GGUF_NAME = "adapter.gguf"
PLOT_NAME = "loss.png"


def save_adapter(model: Any, output: Path) -> None:
    """The PEFT adapter (adapter_model.safetensors + adapter_config.json), each file appearing whole."""
    tmp = Path(tempfile.mkdtemp(prefix=".adapter.", dir=output))
    try:
        model.save_pretrained(str(tmp), safe_serialization=True)
        for item in tmp.iterdir():
            os.replace(item, output / item.name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def loss_plot(history: list[dict[str, Any]], title: str) -> bytes:
    """A PNG of the training (and eval) loss against the step."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    figure = Figure(figsize=(6, 3.5), dpi=100)
    axes = figure.subplots()
    train = [(e["step"], e["loss"]) for e in history if "loss" in e]
    evals = [(e["step"], e["eval_loss"]) for e in history if "eval_loss" in e]
    if train:
        axes.plot(*zip(*train, strict=True), label="train loss")
    if evals:
        axes.plot(*zip(*evals, strict=True), marker="o", label="eval loss")
    axes.set_xlabel("step")
    axes.set_ylabel("loss")
    axes.set_title(title)
    axes.grid(alpha=0.3)
    if train or evals:
        axes.legend()
    buffer = io.BytesIO()
    figure.tight_layout()
    figure.savefig(buffer, format="png")
    return buffer.getvalue()


def readme(args: TrainingArgs, paths: Paths, data: TrainingData, summary: dict[str, Any]) -> str:
    """A short model card: what it was trained on, how, and how to use it."""
    evals = f", {summary['eval_samples']} eval samples" if data.eval else ""
    lines = [
        f"# {args.name}",
        "",
        f"A LoRA adapter for `{paths.model.name}`, trained by textgen on {datetime.now(UTC):%Y-%m-%d %H:%M} UTC.",
        "",
        f"- Data: `{paths.dataset.name}` ({data.kind}, {summary['samples']} training samples, "
        f"{data.trained_tokens()} trained tokens per epoch{evals})",
        f"- LoRA: rank {args.rank}, alpha {args.alpha:g}, dropout {args.dropout:g}, "
        f"targets {', '.join(args.target_modules) or 'every linear layer but the head'}",
        f"- Training: {summary['steps']} steps, learning rate {args.learning_rate:g} ({args.lr_scheduler}), "
        f"micro-batch {args.micro_batch_size} x {args.gradient_accumulation}, cutoff {args.cutoff_len}, "
        f"{args.batching.replace('_', '-')} batches, seed {args.seed}",
        f"- Loss: first {summary['first_loss']:.4f}, final {summary['final_loss']:.4f}"
        if summary.get("first_loss") is not None
        else "- Loss: not logged",
    ]
    if summary.get("eval_loss") is not None:
        lines.append(f"- Eval loss: {summary['eval_loss']:.4f}")
    for row in summary.get("perplexity") or []:
        lines.append(f"- Perplexity ({row['model']}): {row['perplexity']}")
    if summary.get("stopped"):
        lines.append(f"- Stopped early: {summary['stopped']}")
    lines += [
        "",
        "Use it: Model tab -> LoRA, or `POST /v1/internal/lora/load`"
        + (f"; `{GGUF_NAME}` is the same adapter for llama.cpp." if summary.get("gguf") else "."),
        "",
        f"![loss]({PLOT_NAME})",
        "",
    ]
    return "\n".join(lines)


def write_gguf(args: TrainingArgs, paths: Paths, output: Path) -> str | None:
    """The saved adapter as a GGUF LoRA, written by llama.cpp's own ``convert_lora_to_gguf.py`` (every architecture
    it knows); returns its file name, or None (with the reason logged) where it cannot be written."""
    from modules.lifecycle.convert import ConversionError, LoraConvertArgs, convert_lora_to_gguf

    if args.bias != "none":
        log.warning("no GGUF LoRA: trained biases have no place in llama.cpp's LoRA format")
        return None
    convert_args = LoraConvertArgs(lora=output, base=paths.model, output=output / GGUF_NAME)
    try:
        # its own Event: a stop ends the training, and the adapter trained so far is still converted
        convert_lora_to_gguf(convert_args, lambda *a, **k: None, threading.Event())
    except ConversionError as exc:
        log.warning("no GGUF LoRA for llama.cpp: %s", exc)
        return None
    return GGUF_NAME


def write_all(
    args: TrainingArgs, paths: Paths, trainer: Any, model: Any, data: TrainingData, summary: dict[str, Any]
) -> None:
    """Every output file of a finished (or stopped) run."""
    from modules.training.evaluate import compare

    output = paths.output
    save_adapter(model, output)
    if data.eval:
        summary["perplexity"] = compare(model, data.eval, args.name, args.micro_batch_size)
    summary["gguf"] = write_gguf(args, paths, output) if args.gguf else None
    history = trainer.state.log_history
    atomic_write_text(output / LOG_FILE, json.dumps({"summary": summary, "log": history}, indent=2) + "\n")
    atomic_write_bytes(output / PLOT_NAME, loss_plot(history, args.name))
    atomic_write_text(output / "README.md", readme(args, paths, data, summary))
