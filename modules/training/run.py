"""A LoRA training run: peft on a transformers model, the transformers Trainer, progress through a callback.

``train(args, report, cancel)`` is the one function the CLI, the Training tab and ``accelerate launch`` run. It writes
``loras/NAME/``: the PEFT adapter (safetensors), training_parameters.json, training_log.json, loss.png, README.md
and adapter.gguf for llama.cpp (llama.cpp's own converter); checkpoints go to ``loras/NAME/checkpoints/``.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from modules import shared
from modules.errors import InvalidRequest, ModelNotFound
from modules.fileio import atomic_write_text
from modules.jobs import Reporter
from modules.paths import UnsafePath, safe_child
from modules.training import outputs
from modules.training.args import LOG_FILE, PARAMETERS_FILE, TrainingArgs, saved_parameters
from modules.training.datasets import IGNORE, Sample, TrainingData, load_training_data, resolve_file

log = logging.getLogger(__name__)
CHECKPOINTS = "checkpoints"


@dataclass
class Paths:
    """Where a run reads and writes."""

    model: Path
    dataset: Path
    format: Path | None
    eval: Path | None
    output: Path

    @property
    def checkpoints(self) -> Path:
        return self.output / CHECKPOINTS


def resolve_model(name: str) -> Path:
    """A Hugging Face model folder: a path as given, else a name in the models folder."""
    from modules.training import datasets

    direct = Path(name).expanduser()
    if datasets.paths_allowed() and direct.is_dir() and (direct / "config.json").is_file():
        return direct.resolve()
    try:
        path = safe_child(shared.models_dir(), name)
    except UnsafePath as exc:
        raise InvalidRequest(f"invalid model name: {exc}", param="model") from exc
    if not (path / "config.json").is_file():
        raise ModelNotFound(f"{name!r} is not a Hugging Face model folder (with config.json) in {shared.models_dir()}")
    return path


def resolve_paths(args: TrainingArgs) -> Paths:
    """Every input and the output folder, checked before anything loads."""
    base = shared.user_data_dir() / "training"
    try:
        output = safe_child(shared.loras_dir(), args.name.strip())
    except UnsafePath as exc:
        raise InvalidRequest(f"invalid adapter name: {exc}", param="name") from exc
    return Paths(
        model=resolve_model(args.model),
        dataset=resolve_file(base / "datasets", args.dataset, "dataset"),
        format=resolve_file(base / "formats", args.format, "format", (".json",)) if args.format else None,
        eval=resolve_file(base / "datasets", args.eval_dataset, "eval_dataset") if args.eval_dataset else None,
        output=output,
    )


def latest_checkpoint(output: Path) -> Path | None:
    """The checkpoint with the highest step in ``output/checkpoints``, if any."""
    folder = output / CHECKPOINTS
    found = [
        p
        for p in folder.glob("checkpoint-*")
        if p.name.split("-")[-1].isdigit() and (p / "trainer_state.json").is_file()
    ]
    return max(found, key=lambda p: int(p.name.split("-")[-1])) if found else None


def finished(output: Path) -> bool:
    """The run saved its outputs after its last planned step (training_log.json says so): nothing is left to
    resume. A run killed after its last checkpoint but before saving is not finished: resuming it saves."""
    try:
        summary = json.loads((output / LOG_FILE).read_text())["summary"]
        return int(summary["steps"]) >= int(summary["max_steps"]) > 0
    except (OSError, ValueError, KeyError, TypeError):
        return False


def prepare_output(args: TrainingArgs, paths: Paths) -> Path | None:
    """Refuse to clobber an adapter; the checkpoint to resume from (with ``resume``)."""
    if args.resume:
        checkpoint = latest_checkpoint(paths.output)
        if checkpoint is None:
            raise InvalidRequest(f"loras/{args.name} has no checkpoint to resume from", param="resume")
        if finished(paths.output):
            raise InvalidRequest(
                f"loras/{args.name} finished all its steps: there is nothing to resume. Start a new run "
                "(copy from it to keep its settings)",
                param="resume",
            )
        return checkpoint
    if paths.output.exists() and any(paths.output.iterdir()):
        if not args.overwrite:
            raise InvalidRequest(
                f"loras/{args.name} already exists; choose another name, resume it, or overwrite it", param="name"
            )
        shutil.rmtree(paths.output)
    return None


RESUME_MAY_DIFFER = frozenset(
    {"name", "resume", "overwrite", "copy_from", "save_steps", "save_total_limit", "logging_steps", "gguf"}
)
"""What a resumed run may set otherwise than its start: where and how often it writes, not what it computes."""


def check_resume(args: TrainingArgs, paths: Paths) -> None:
    """A resume goes on with the arguments the checkpoint was made with (``training_parameters.json``): any other
    value of what shapes the loss curve (data, model, rates, batch, seed, steps) is refused, naming each."""
    if not (paths.output / PARAMETERS_FILE).is_file():
        return  # a run of an older textgen: nothing to compare with
    saved = saved_parameters(paths.output, "resume", "")
    ours = args.to_dict()
    differ = [f"{k} {ours[k]!r} (the run's: {saved[k]!r})" for k in sorted(ours)
              if k in saved and k not in RESUME_MAY_DIFFER and ours[k] != saved[k]]  # fmt: skip
    if differ:
        raise InvalidRequest(
            f"loras/{args.name} resumes with the arguments it was started with; these differ: {'; '.join(differ)}. "
            "Resume in the Training tab uses the run's own, or start a new run under another name",
            param="resume",
        )


def check_hardware(args: TrainingArgs) -> None:
    """Refuse what this machine cannot do before a job starts (not minutes into it): bf16/fp16 need CUDA, and a
    launch that shards the weights (FSDP, DeepSpeed ZeRO-3) is not one this run can save."""
    precision(args)
    check_sharding(os.environ)


def check_sharding(env: Mapping[str, str]) -> None:
    """Refuse FSDP and DeepSpeed ZeRO-3, as ``accelerate launch`` sets them in the environment: they shard the
    weights themselves, and rank 0 saving and measuring alone would write an incomplete adapter or wait for the
    other ranks forever (docs/training.md says what is supported)."""
    if env.get("ACCELERATE_USE_FSDP", "").lower() == "true":
        raise InvalidRequest(
            "FSDP is not supported by textgen's training: it shards the weights, and the adapter "
            "would be saved incomplete. Use data parallel or DeepSpeed ZeRO-1/2 (docs/training.md)"
        )
    if env.get("ACCELERATE_USE_DEEPSPEED", "").lower() != "true":
        return
    stage = env.get("ACCELERATE_DEEPSPEED_ZERO_STAGE", "")
    config_file = env.get("ACCELERATE_DEEPSPEED_CONFIG_FILE", "")
    if config_file:  # a DeepSpeed JSON config names its own stage
        try:
            found = json.loads(Path(config_file).read_text()).get("zero_optimization", {}).get("stage")
        except (OSError, ValueError, AttributeError) as exc:
            raise InvalidRequest(f"cannot read the DeepSpeed config {config_file}: {exc}") from exc
        stage = str(found) if found is not None else stage
    if stage.strip() == "3":
        raise InvalidRequest(
            "DeepSpeed ZeRO-3 is not supported by textgen's training: it shards the weights, and "
            "the adapter would be saved incomplete. Use ZeRO-1 or ZeRO-2 (docs/training.md)"
        )


def linear_names(model: Any) -> tuple[set[str], set[str]]:
    """The last names of the model's linear layers, and the names of its output head (never adapted by default)."""
    import torch
    from transformers.pytorch_utils import Conv1D

    kinds: tuple[type, ...] = (torch.nn.Linear, Conv1D)
    try:
        import bitsandbytes as bnb

        kinds += (bnb.nn.Linear4bit, bnb.nn.Linear8bitLt)
    except Exception:
        pass
    head = model.get_output_embeddings()
    names: set[str] = set()
    heads: set[str] = set()
    for full, module in model.named_modules():
        if isinstance(module, kinds):
            (heads if module is head else names).add(full.split(".")[-1])
    return names - heads, heads


def target_modules(model: Any, wanted: list[str]) -> list[str]:
    """The modules to adapt: ``wanted`` checked against the model's real layer names, or every linear but the head."""
    names, heads = linear_names(model)
    if not wanted:
        if not names:
            raise InvalidRequest("this model has no linear layers LoRA can adapt", param="target_modules")
        return sorted(names)
    unknown = [w for w in wanted if w not in names]
    if unknown:
        raise InvalidRequest(
            f"target module(s) {', '.join(unknown)} are not linear layers of this model; "
            f"it has: {', '.join(sorted(names | heads))}",
            param="target_modules",
        )
    return list(wanted)


def precision(args: TrainingArgs) -> tuple[Any, bool, bool]:
    """The dtype to load in, and the Trainer's bf16 / fp16 flags."""
    import torch

    cuda = torch.cuda.is_available()
    choice = args.precision
    if choice == "auto":
        choice = ("bf16" if torch.cuda.is_bf16_supported() else "fp16") if cuda else "fp32"
    if choice in ("bf16", "fp16") and not cuda:
        raise InvalidRequest(f"{choice} training needs a CUDA GPU; use fp32 here", param="precision")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float32, "fp32": torch.float32}[choice]
    return dtype, choice == "bf16", choice == "fp16"


def load_model(args: TrainingArgs, model_path: Path) -> tuple[Any, Any]:
    """The peft-wrapped model (LoRA on the chosen layers, QLoRA when asked) and the tokenizer."""
    import torch
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_path), local_files_only=True)
    dtype, _, _ = precision(args)
    options: dict[str, Any] = {"dtype": dtype, "local_files_only": True}
    if args.load_in_4bit:  # bitsandbytes has 4-bit kernels for the CPU too (0.45 and newer)
        from transformers import BitsAndBytesConfig

        options["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=dtype, bnb_4bit_use_double_quant=True
        )
        cuda = torch.cuda.is_available()
        options["device_map"] = {"": int(os.environ.get("LOCAL_RANK", "0")) if cuda else "cpu"}
    model = AutoModelForCausalLM.from_pretrained(str(model_path), **options)
    if args.load_in_4bit:
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=args.gradient_checkpointing)
    elif args.gradient_checkpointing:
        model.enable_input_require_grads()
    config = LoraConfig(
        r=args.rank,
        lora_alpha=args.alpha,
        lora_dropout=args.dropout,
        target_modules=target_modules(model, args.target_modules),
        bias=args.bias,  # type: ignore[arg-type]
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, config), tokenizer


class SampleSet:
    """The samples as a torch-style map dataset of dicts."""

    def __init__(self, samples: list[Sample]) -> None:
        self.samples = samples

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> dict[str, list[int]]:
        sample = self.samples[index]
        return {"input_ids": sample.input_ids, "labels": sample.labels}


def padded_collator(pad_id: int) -> Any:
    """Pad each micro-batch to its longest sample (labels IGNORE, attention mask 0 on padding)."""
    import torch

    def collate(features: list[dict[str, list[int]]]) -> dict[str, Any]:
        longest = max(len(f["input_ids"]) for f in features)
        ids, labels, mask = [], [], []
        for f in features:
            gap = longest - len(f["input_ids"])
            ids.append(f["input_ids"] + [pad_id] * gap)
            labels.append(f["labels"] + [IGNORE] * gap)
            mask.append([1] * len(f["input_ids"]) + [0] * gap)
        return {"input_ids": torch.tensor(ids), "labels": torch.tensor(labels), "attention_mask": torch.tensor(mask)}

    return collate


def collator(args: TrainingArgs, tokenizer: Any) -> Any:
    """Padding-free batches (samples concatenated, positions restarting per sample, the first label of each
    ignored) or padded ones. transformers keeps packed samples apart by their restarting position_ids when the
    model runs without a KV cache (the Trainer's ``use_cache=False``, set in :func:`make_trainer`)."""
    if args.batching == "padding_free":
        from transformers import DataCollatorWithFlattening

        return DataCollatorWithFlattening(return_position_ids=True, separator_id=IGNORE)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return padded_collator(int(pad or 0))


@dataclass
class Counters:
    """What the callbacks count during a run: tokens fed (padding excluded), the clock, why it stopped early."""

    tokens: int = 0
    start_tokens: int = 0
    since: float = 0.0
    stopped: str = ""
    steps: int = 0  # optimizer steps this session ran (a resumed run skips the ones before its checkpoint)


def memory_mb() -> float:
    """Peak memory of this process: GPU memory on CUDA, else resident memory."""
    import torch

    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**20
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def make_trainer(
    args: TrainingArgs, model: Any, tokenizer: Any, data: TrainingData, output: Path, report: Reporter,
    cancel: threading.Event,
) -> Any:  # fmt: skip
    """The transformers Trainer for this run, with the progress / stop callback."""
    from transformers import Trainer, TrainerCallback, TrainingArguments

    _, bf16, fp16 = precision(args)
    has_eval = bool(data.eval)
    training_args = TrainingArguments(
        output_dir=str(output / CHECKPOINTS),
        num_train_epochs=args.epochs,
        max_steps=args.max_steps or -1,
        learning_rate=args.learning_rate,
        lr_scheduler_type=args.lr_scheduler,
        warmup_steps=args.warmup_steps,
        optim=args.optimizer,
        weight_decay=args.weight_decay,
        per_device_train_batch_size=args.micro_batch_size,
        per_device_eval_batch_size=args.micro_batch_size,
        gradient_accumulation_steps=args.gradient_accumulation,
        activation_checkpointing=args.gradient_checkpointing,
        bf16=bf16,
        fp16=fp16,
        seed=args.seed,
        data_seed=args.seed,
        logging_steps=args.logging_steps,
        save_strategy="steps" if args.save_steps else "no",  # 0: the callback asks for one at the last step
        save_steps=args.save_steps or 500,
        save_total_limit=args.save_total_limit or None,
        eval_strategy=("steps" if args.eval_steps else "epoch") if has_eval else "no",
        eval_steps=args.eval_steps or None,
        report_to=[],
        disable_tqdm=True,
        remove_unused_columns=False,
        dataloader_num_workers=0,
        use_cpu=not _cuda(),
        use_cache=False,  # padding-free samples are kept apart (by position_ids) only without a KV cache
    )
    counters = Counters()
    run_args = args

    class CountingTrainer(Trainer):
        def training_step(self, model: Any, inputs: dict[str, Any], num_items_in_batch: Any = None) -> Any:
            mask = inputs.get("attention_mask")
            counters.tokens += int(mask.sum()) if mask is not None else int(inputs["input_ids"].numel())
            return super().training_step(model, inputs, num_items_in_batch)

    class Progress(TrainerCallback):
        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            counters.since, counters.start_tokens = time.perf_counter(), counters.tokens
            report(done=state.global_step, total=state.max_steps, message="training")

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            counters.steps += 1
            if state.global_step >= state.max_steps:
                control.should_save = True  # a checkpoint at the end, whatever save_steps is
            if cancel.is_set():
                counters.stopped = "stopped by the user"
                control.should_training_stop = True
                control.should_save = True  # a checkpoint to resume from

        def on_log(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            logs: dict[str, Any] = kwargs.get("logs") or {}
            elapsed = max(1e-9, time.perf_counter() - counters.since)
            metrics: dict[str, Any] = {"step": state.global_step, "epoch": round(float(state.epoch or 0), 3)}
            if "loss" in logs:
                metrics["loss"] = float(logs["loss"])
                metrics["learning_rate"] = float(logs.get("learning_rate", 0.0))
                metrics["tokens_per_s"] = round((counters.tokens - counters.start_tokens) / elapsed, 1)
                metrics["tokens"] = counters.tokens
                metrics["memory_mb"] = round(memory_mb(), 1)
                goal = run_args.stop_at_loss
                if goal and metrics["loss"] <= goal:
                    counters.stopped = f"loss {metrics['loss']:.4f} reached stop_at_loss {goal}"
                    control.should_training_stop = True
                    control.should_save = control.should_save or bool(run_args.save_steps)  # keep the last step's
            if "eval_loss" in logs:
                metrics["eval_loss"] = float(logs["eval_loss"])
            if "loss" in metrics or "eval_loss" in metrics:
                line = f"step {state.global_step}/{state.max_steps}"
                report(done=state.global_step, total=state.max_steps, message=line, **metrics)

    trainer = CountingTrainer(
        model=model,
        args=training_args,
        train_dataset=SampleSet(data.train),
        eval_dataset=SampleSet(data.eval) if has_eval else None,
        data_collator=collator(args, tokenizer),
        callbacks=[Progress()],
    )
    from transformers.trainer_callback import PrinterCallback

    trainer.remove_callback(PrinterCallback)  # progress goes through ``report`` (tqdm on the CLI)
    trainer.textgen_counters = counters  # type: ignore[attr-defined]
    return trainer


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def prepare(args: TrainingArgs, explicit: set[str] | None = None) -> tuple[TrainingArgs, Paths, TrainingData]:
    """The effective arguments (``copy_from`` applied), the paths and the tokenized data, all checked.

    With ``copy_from``, the fields named in ``explicit`` keep the value in ``args`` and the others take the copied
    run's; the CLI passes the flags it was given (one given at its default value wins too). Without ``explicit``
    (the Training tab's form, a TrainingArgs built in Python) the fields that differ from their defaults win.
    Raises InvalidRequest (DatasetError for a bad file) before anything loads a model or trains.
    """
    if args.copy_from:
        from modules.training.args import copy_parameters

        try:
            source = safe_child(shared.loras_dir(), args.copy_from)
        except UnsafePath as exc:
            raise InvalidRequest(f"invalid adapter name: {exc}", param="copy_from") from exc
        if explicit is None:
            defaults = TrainingArgs()
            explicit = {k for k, v in args.to_dict().items() if v != getattr(defaults, k)}
        args = copy_parameters(args, source, explicit)
    args.validate()
    check_hardware(args)
    paths = resolve_paths(args)
    if args.resume:
        prepare_output(args, paths)  # a missing checkpoint is an error now, not in the job
        check_resume(args, paths)
    elif paths.output.exists() and any(paths.output.iterdir()) and not args.overwrite:
        prepare_output(args, paths)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(paths.model), local_files_only=True)
    data = load_training_data(
        tokenizer, paths.dataset, cutoff=args.cutoff_len, overlap=args.overlap_len, format_path=paths.format,
        eval_path=paths.eval, eval_split=args.eval_split, seed=args.seed,
    )  # fmt: skip
    return args, paths, data


def train(
    args: TrainingArgs, report: Reporter, cancel: threading.Event, prepared: tuple | None = None,
    explicit: set[str] | None = None,
) -> dict[str, Any]:  # fmt: skip
    """Train a LoRA adapter as ``args`` says; returns a summary (losses, steps, where the adapter is).

    Raises InvalidRequest (DatasetError included) before anything trains when an argument or the data is wrong.
    A stop (``cancel``) ends the run at the next step with a checkpoint; ``resume`` continues from it.
    ``prepared`` is what :func:`prepare` returned, when the caller checked the data already; ``explicit`` the
    fields the caller gave, which win over ``copy_from`` (see :func:`prepare`).
    """
    report(message="loading the tokenizer and the data")
    args, paths, data = prepared or prepare(args, explicit)
    checkpoint = prepare_output(args, paths)
    report(message="loading the model")
    import transformers

    transformers.set_seed(args.seed)
    model, tokenizer = load_model(args, paths.model)
    trainer = make_trainer(args, model, tokenizer, data, paths.output, report, cancel)
    main = trainer.is_world_process_zero()
    if main:
        paths.output.mkdir(parents=True, exist_ok=True)
        atomic_write_text(paths.output / "training_parameters.json", json.dumps(args.to_dict(), indent=2) + "\n")
    started = time.perf_counter()
    result = trainer.train(resume_from_checkpoint=str(checkpoint) if checkpoint else None)
    seconds = time.perf_counter() - started
    counters: Counters = trainer.textgen_counters  # type: ignore[attr-defined]
    summary: dict[str, Any] = {
        "name": args.name,
        "output": str(paths.output),
        "kind": data.kind,
        "samples": len(data.train),
        "eval_samples": len(data.eval),
        "dropped": data.dropped,
        "steps": trainer.state.global_step,
        "max_steps": trainer.state.max_steps,
        "resumed_from": int(checkpoint.name.split("-")[-1]) if checkpoint else 0,
        "steps_trained": counters.steps,
        "seconds": round(seconds, 2),
        "train_loss": float(result.training_loss),
        "tokens": counters.tokens,
        "tokens_per_s": round(counters.tokens / max(seconds, 1e-9), 1),
        "stopped": counters.stopped or ("stopped by the user" if cancel.is_set() else ""),
    }
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    summary["first_loss"], summary["final_loss"] = (losses[0], losses[-1]) if losses else (None, None)
    evals = [e["eval_loss"] for e in trainer.state.log_history if "eval_loss" in e]
    summary["eval_loss"] = evals[-1] if evals else None
    if main:
        report(message="saving the adapter")
        outputs.write_all(args, paths, trainer, model, data, summary)
    report(done=trainer.state.global_step, message=summary["stopped"] or "done")
    return summary
