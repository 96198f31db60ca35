"""Training tab: a form generated from TrainingArgs (each field's docstring is its help), start / stop / resume,
live progress and loss plot, apply the adapter to the loaded model, and a perplexity table. Only an adapter over
modules.training."""

from __future__ import annotations

import typing
from dataclasses import MISSING, fields
from typing import Any

import gradio as gr
import pandas as pd

from modules import jobs, models
from modules.errors import TextgenError
from modules.training import background
from modules.training.args import BATCHING, OPTIMIZERS, SCHEDULERS, TrainingArgs, field_docs
from modules.training.evaluate import EvalArgs
from modules.ui import on_change
from modules.ui.admin import admin_control, admin_only

MAIN = ("model", "dataset", "format", "name", "epochs", "learning_rate", "rank", "alpha", "micro_batch_size",
        "cutoff_len", "eval_split", "save_steps")  # fmt: skip
CHOICES: dict[str, tuple[str, ...]] = {
    "lr_scheduler": SCHEDULERS, "optimizer": OPTIMIZERS, "batching": BATCHING, "bias": ("none", "all", "lora_only"),
    "precision": ("auto", "bf16", "fp16", "fp32"),
}  # fmt: skip
HIDDEN = ("resume",)  # the Resume button sets it


def _default(name: str) -> Any:
    f = next(f for f in fields(TrainingArgs) if f.name == name)
    return f.default if f.default is not MISSING else f.default_factory()  # type: ignore[misc,operator]


def _component(name: str, hint: Any) -> Any:
    docs, value, elem = field_docs().get(name, ""), _default(name), f"train-{name.replace('_', '-')}"
    label = name.replace("_", " ")
    if name == "model":
        return gr.Dropdown(background.hf_models(), label=label, info=docs, allow_custom_value=True, elem_id=elem)
    if name in ("dataset", "eval_dataset"):
        choices = ([""] if name == "eval_dataset" else []) + background.dataset_files()
        return gr.Dropdown(choices, label=label, info=docs, allow_custom_value=True, elem_id=elem)
    if name == "format":
        return gr.Dropdown(["", *background.format_files()], value="", label=label, info=docs, elem_id=elem)
    if name == "copy_from":
        return gr.Dropdown(["", *background.trained_adapters()], value="", label=label, info=docs, elem_id=elem)
    if name in CHOICES:
        return gr.Dropdown(list(CHOICES[name]), value=value, label=label, info=docs, elem_id=elem)
    if hint is bool:
        return gr.Checkbox(value=value, label=label, info=docs, elem_id=elem)
    if hint in (int, float):
        return gr.Number(value=value, label=label, info=docs, precision=0 if hint is int else None, elem_id=elem)
    if hint == list[str]:
        return gr.Textbox(value="", label=label, info=docs + " (comma-separated)", elem_id=elem)
    return gr.Textbox(value=value, label=label, info=docs, elem_id=elem)


def _args(names: list[str], values: tuple[Any, ...], resume: bool) -> TrainingArgs:
    hints = typing.get_type_hints(TrainingArgs)
    given: dict[str, Any] = {}
    for name, value in zip(names, values, strict=True):
        hint = hints[name]
        if hint == list[str]:
            given[name] = [v.strip() for v in str(value or "").split(",") if v.strip()]
        elif hint in (int, float):
            given[name] = hint(value if value is not None else _default(name))
        else:
            given[name] = hint(value) if value is not None else _default(name)
    return TrainingArgs(**given, resume=resume)


def status_text(job: jobs.Job | None) -> str:
    """The run's state in a few lines: step, epoch, losses, learning rate, tokens/s, ETA, memory."""
    if job is None:
        found = background.resumable()
        if not found:
            return "No training run yet."
        runs = ", ".join(f"`{name}` (step {step})" for name, step in found[:5])
        return f"No training run in this session. Checkpoints to resume: {runs}: type the name and press Resume."
    m = job.metrics
    parts = [f"**{job.title}**: {job.state}", f"step {int(job.done)}/{int(job.total or 0)}"]
    for key, label, fmt in (("epoch", "epoch", "{:.2f}"), ("loss", "loss", "{:.4f}"), ("eval_loss", "eval loss",
                            "{:.4f}"), ("learning_rate", "lr", "{:.2e}"), ("tokens_per_s", "tokens/s", "{:.0f}"),
                            ("memory_mb", "memory MiB", "{:.0f}")):  # fmt: skip
        if key in m:
            parts.append(f"{label} {fmt.format(m[key])}")
    if job.eta_s is not None:
        parts.append(f"ETA {job.eta_s:.0f} s")
    text = " · ".join(parts)
    if job.message and job.state == "running":
        text += f"\n\n{job.message}"
    if job.error:
        text += f"\n\n**Error:** {job.error}"
    if job.state in ("done", "cancelled") and isinstance(job.result, dict):
        r = job.result
        losses = [f"{label} loss {r[key]:.4f}" for key, label in (("first_loss", "first"), ("final_loss", "final"))
                  if r.get(key) is not None]  # fmt: skip
        text += f"\n\nSaved to `{r['output']}`" + (": " + ", ".join(losses) if losses else " (no loss logged yet)")
        if r.get("gguf"):
            text += f" (and `{r['gguf']}` for llama.cpp)"
        if r.get("stopped"):
            text += f"; {r['stopped']}"
    return text


def loss_frame(job: jobs.Job | None) -> pd.DataFrame:
    """(step, loss, series) rows for the live plot."""
    rows = []
    for entry in job.history if job else []:
        if "loss" in entry:
            rows.append({"step": entry["step"], "loss": entry["loss"], "series": "train"})
        if "eval_loss" in entry:
            rows.append({"step": entry["step"], "loss": entry["eval_loss"], "series": "eval"})
    return pd.DataFrame(rows, columns=["step", "loss", "series"])


def build() -> None:
    """The tab's components and events."""
    hints = typing.get_type_hints(TrainingArgs)
    names = [f.name for f in fields(TrainingArgs) if f.name not in HIDDEN]
    components: dict[str, Any] = {}
    with gr.Row():
        with gr.Column(scale=2):
            with gr.Row():
                for name in MAIN[:4]:
                    components[name] = _component(name, hints[name])
            with gr.Row():
                for name in MAIN[4:]:
                    components[name] = _component(name, hints[name])
            with gr.Accordion("More settings", open=False):
                for name in names:
                    if name not in components:
                        components[name] = _component(name, hints[name])
            with gr.Row():
                start = admin_control(gr.Button("Start training", variant="primary", elem_id="train-start"))
                resume = admin_control(gr.Button("Resume", elem_id="train-resume"))
                stop = admin_control(gr.Button("Stop", variant="stop", elem_id="train-stop"))
                refresh = gr.Button("Refresh lists", elem_id="train-refresh")
        with gr.Column(scale=2):
            first = background.current()
            status = gr.Markdown(status_text(first), elem_id="training-status")
            seen = gr.State(on_change(first.id if first else None, status_text(first), None)[1])  # what it shows
            plot = gr.LinePlot(loss_frame(None), x="step", y="loss", color="series", title="Loss",
                               elem_id="training-plot", height=280)  # fmt: skip
            with gr.Row():
                adapter = gr.Dropdown(background.trained_adapters(), label="Adapter", elem_id="train-adapter")
                apply = admin_control(gr.Button("Apply to the loaded model", elem_id="train-apply"))
                evaluate = admin_control(gr.Button("Compare perplexity", elem_id="train-evaluate"))
            action = gr.Markdown("", elem_id="train-action")
            table = gr.Dataframe(headers=["model", "loss", "perplexity", "tokens", "precision"], label="Perplexity",
                                 elem_id="train-ppl", interactive=False)  # fmt: skip
    inputs = [components[n] for n in names]

    def launch(resuming: bool, *values: Any) -> str:
        try:
            args = _args(names, values, False)
            # Resume goes on with the run's own arguments (training_parameters.json), not the form's
            job = background.resume(args.name) if resuming else background.start(args)
        except jobs.Busy as exc:
            gr.Warning(str(exc))
            return status_text(exc.job)
        except (TextgenError, ValueError, TypeError) as exc:
            gr.Warning(str(exc))
            return f"**Not started:** {exc}"
        return status_text(job)

    def halt() -> str:
        job = jobs.running(background.KIND)
        if job is None:  # the last run's line stays under the note (the timer changes it only when the run does)
            return status_text(background.current()) + "\n\nNo run to stop."
        jobs.cancel(job.id)
        return status_text(job) + "\n\nStopping at the end of this step (a checkpoint is written)..."

    def tick(seen: list[Any] | None) -> tuple[Any, Any, Any, list[Any]]:
        job = background.current()
        evaluation = next(iter(jobs.all_jobs(background.EVAL_KIND)), None)
        rows = gr.update()
        if evaluation is not None and evaluation.state == "done" and isinstance(evaluation.result, list):
            rows = pd.DataFrame(evaluation.result)
        elif evaluation is not None and evaluation.state == "failed":
            rows = pd.DataFrame([{"model": f"error: {evaluation.error}", "loss": None, "perplexity": None}])
        shown, now_seen = on_change(job.id if job else None, status_text(job), seen)
        return shown, loss_frame(job), rows, now_seen

    def apply_adapter(name: str | None) -> str:
        if not name:
            return "Choose an adapter."
        try:
            models.apply_loras([name])
        except TextgenError as exc:
            gr.Warning(str(exc))
            return f"**Not applied:** {exc}"
        return f"Applied **{name}** to {models.shared.model_name}."

    def compare(name: str | None, model: str | None, eval_dataset: str | None) -> str:
        if not name:
            return "Choose an adapter."
        try:  # the run's own base (the form's model if it recorded none); the form's eval dataset, if one is chosen
            args = EvalArgs(fallback_model=model or "", lora=name, dataset=eval_dataset or "")
            background.start_evaluation(args)
        except (jobs.Busy, TextgenError) as exc:
            gr.Warning(str(exc))
            return str(exc)
        return f"Measuring the perplexity of the base and of base + {name}..."

    def lists() -> tuple[Any, ...]:
        return (gr.update(choices=background.hf_models()), gr.update(choices=background.dataset_files()),
                gr.update(choices=["", *background.format_files()]), gr.update(choices=background.trained_adapters()))  # fmt: skip

    def launch_new(*values: Any) -> str:
        return launch(False, *values)

    def launch_resume(*values: Any) -> str:
        return launch(True, *values)

    start.click(admin_only("start training")(launch_new), inputs, status, concurrency_limit=1)
    resume.click(admin_only("resume training")(launch_resume), inputs, status, concurrency_limit=1)
    stop.click(admin_only("stop training")(halt), None, status, queue=False)
    apply.click(admin_only("apply LoRAs")(apply_adapter), adapter, action, concurrency_limit=1)
    evaluate.click(admin_only("run evaluations")(compare), [adapter, components["model"], components["eval_dataset"]],
                   action, concurrency_limit=1)  # fmt: skip
    refresh.click(lists, None, [components["model"], components["dataset"], components["format"], adapter])
    timer = gr.Timer(1.0)
    timer.tick(tick, seen, [status, plot, table, seen], queue=False, show_progress="hidden")
