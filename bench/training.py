"""Training benchmark: textgen's LoRA training (padding-free batches) against a plain transformers Trainer + peft
loop with padded batches, same model (the default model's HF copy), data, seed and hyperparameters, on a chat
dataset of mixed lengths. Prints seconds per step, useful (non-padding) tokens/s and the final loss of each, and the
ratio (target: useful tokens/s >= 1.3x). The first step of each run is warm-up and is not timed. ``python -m bench.training [--steps N]``."""

from __future__ import annotations

import argparse
import json
import math
import random
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from bench.common import ROOT, write_result

WORDS = ["lantern", "harbour", "otter", "barley", "river", "granite", "copper", "meadow", "violet", "thunder", "ember", "willow", "quartz", "falcon", "orchard", "pebble", "saffron", "glacier", "cinder", "maple"]  # fmt: skip


def mixed_chat(path: Path, count: int = 32, seed: int = 0) -> Path:
    """Chat records whose answers run from 2 to 300 words, long-tailed as in real chat data (log-uniform lengths:
    most answers short, a few long)."""
    rng = random.Random(seed)
    with path.open("w", encoding="utf-8") as out:
        for i in range(count):
            words = round(math.exp(rng.uniform(math.log(2), math.log(300))))
            answer = " ".join(rng.choice(WORDS) for _ in range(words)) + "."
            question = f"Describe item {i} in {words} words."
            out.write(json.dumps({"messages": [{"role": "user", "content": question},
                                               {"role": "assistant", "content": answer}]}) + "\n")  # fmt: skip
    return path


def plain_loop(model_path: Path, dataset: Path, steps: int, batch: int, lr: float, rank: int) -> dict[str, Any]:
    """The reference: Trainer + peft, every micro-batch padded to its longest sample (DataCollatorForSeq2Seq)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import (
        AutoModelForCausalLM,
        AutoTokenizer,
        DataCollatorForSeq2Seq,
        Trainer,
        TrainingArguments,  # fmt: skip
        set_seed,
    )
    from transformers.trainer_callback import PrinterCallback, TrainerCallback

    from modules.training.datasets import load_training_data

    set_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(str(model_path), local_files_only=True)
    samples = load_training_data(tokenizer, dataset, cutoff=512).train
    rows = [{"input_ids": s.input_ids, "labels": s.labels, "attention_mask": [1] * len(s.input_ids)} for s in samples]
    model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32, local_files_only=True)
    model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules="all-linear",
                                             task_type="CAUSAL_LM"))  # fmt: skip
    tokens = {"n": 0}
    marks: list[tuple[float, int]] = []

    class Marks(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            marks.append((time.perf_counter(), tokens["n"]))

    class Counting(Trainer):
        def training_step(self, model: Any, inputs: dict[str, Any], num_items_in_batch: Any = None) -> Any:
            tokens["n"] += int(inputs["attention_mask"].sum())
            return super().training_step(model, inputs, num_items_in_batch)

    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(output_dir=out, max_steps=steps, per_device_train_batch_size=batch, learning_rate=lr,
                                 lr_scheduler_type="linear", logging_steps=1, save_strategy="no", report_to=[],
                                 seed=0, data_seed=0, disable_tqdm=True, use_cpu=not torch.cuda.is_available(),
                                 remove_unused_columns=False)  # fmt: skip
        collator = DataCollatorForSeq2Seq(tokenizer, padding=True, label_pad_token_id=-100)
        trainer = Counting(model=model, args=args, train_dataset=rows, data_collator=collator)  # type: ignore[arg-type]
        trainer.remove_callback(PrinterCallback)
        trainer.add_callback(Marks())
        trainer.train()
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    return {"marks": marks, "final_loss": losses[-1]}


def ours(model_path: Path, dataset: Path, steps: int, batch: int, lr: float, rank: int) -> dict[str, Any]:
    """textgen's ``train`` with its defaults for batching (padding-free)."""
    from modules import shared
    from modules.settings import load_settings
    from modules.training import datasets
    from modules.training.args import TrainingArgs
    from modules.training.run import train

    with tempfile.TemporaryDirectory() as loras:
        shared.init(load_settings(["--lora-dir", loras], env={}))
        args = TrainingArgs(model=str(model_path), dataset=str(dataset), name="bench", max_steps=steps,
                            micro_batch_size=batch, learning_rate=lr, rank=rank, alpha=2 * rank, dropout=0.0,
                            seed=0, cutoff_len=512, gguf=False)  # fmt: skip
        marks: list[tuple[float, int]] = []

        def report(*_: Any, **metrics: Any) -> None:
            if "tokens" in metrics:
                marks.append((time.perf_counter(), int(metrics["tokens"])))

        with datasets.allow_paths():  # a script, like the CLI, may name any file its user can read
            summary = train(args, report, threading.Event())
    return {"marks": marks, "final_loss": summary["final_loss"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=6, help="optimizer steps per run")
    parser.add_argument("--batch", type=int, default=4, help="micro-batch size")
    options = parser.parse_args(argv)
    from modules.lifecycle.default_model import make_hf_folder

    model_path = make_hf_folder(ROOT / "models")
    with tempfile.TemporaryDirectory() as tmp:
        dataset = mixed_chat(Path(tmp) / "mixed.jsonl")
        settings = (model_path, dataset, options.steps, options.batch, 2e-4, 8)
        reference = plain_loop(*settings)
        textgen = ours(*settings)
    rows = []
    print(f"{'run':<34} {'s/step':>8} {'useful tok/s':>13} {'final loss':>11}")
    for name, r in (("plain Trainer + peft, padded", reference), ("textgen (padding-free)", textgen)):
        (t0, n0), (t1, n1) = r["marks"][0], r["marks"][-1]  # the first step (warm-up) is left out of the timing
        per_step, rate = (t1 - t0) / (len(r["marks"]) - 1), (n1 - n0) / (t1 - t0)
        rows.append({"run": name, "s_per_step": per_step, "useful_tokens_per_s": rate, "final_loss": r["final_loss"]})
        print(f"{name:<34} {per_step:>8.2f} {rate:>13.1f} {r['final_loss']:>11.4f}")
    ratio = rows[1]["useful_tokens_per_s"] / rows[0]["useful_tokens_per_s"]
    print(f"useful tokens/s ratio: {ratio:.2f}x (target >= 1.3x); "
          f"final loss difference {abs(rows[1]['final_loss'] - rows[0]['final_loss']):.4f}")  # fmt: skip
    write_result("training", {"rows": rows, "ratio": ratio, "steps": options.steps, "batch": options.batch})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
