"""The Model tab's Merge / Export / Quant table panel: forms that start the lifecycle jobs and show their progress.

Only an adapter: the work is ``lifecycle.merge.merge``, ``lifecycle.export.export`` and ``lifecycle.quant_table.build``
run as background jobs in a child process (:func:`modules.jobs.start_process`), a push in a thread; a timer shows
their progress, results and the fidelity numbers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gradio as gr
import pandas as pd

from modules import jobs, models, shared
from modules.errors import TextgenError
from modules.paths import UnsafePath, safe_child
from modules.ui import on_change
from modules.ui.admin import admin_control, admin_only

KIND = "export"  # one export-like job at a time (merge, export, table): they each need the whole CPU


def _sources() -> list[str]:
    root = shared.models_dir()
    names = []
    for name in models.model_names():
        path = root / name
        if (path / "config.json").is_file() or path.suffix == ".gguf":
            names.append(name)
    return names


def _adapters() -> list[str]:
    """PEFT adapter folders in loras/ (what a LoRA -> GGUF export reads)."""
    root = shared.loras_dir()
    return [name for name in models.list_loras() if (root / name / "adapter_config.json").is_file()]


def _publishable() -> list[str]:
    """What a push can send: model folders and GGUF files in models/."""
    return models.model_names()


def listings() -> dict[str, list[str]]:
    """Every list the panel's dropdowns show, read now (models/ and loras/ change under a running server)."""
    return {"sources": _sources(), "adapters": _adapters(), "publish": _publishable()}


def source_choices(fmt: str, lists: dict[str, list[str]] | None = None) -> tuple[list[str], str]:
    """The export source's choices and label for a format: a LoRA export reads loras/, the others models/."""
    lists = lists or listings()
    if fmt == "gguf-lora":
        return lists["adapters"], "LoRA adapter (in loras/)"
    return lists["sources"], "Model (HF folder or GGUF)"


def type_choices(fmt: str) -> tuple[list[str], str | None]:
    """The GGUF types a format takes, and its default: llama.cpp's LoRA converter writes only F32/F16/BF16/Q8_0."""
    from modules.lifecycle.convert import CONVERTER_TYPES
    from modules.lifecycle.export import GGUF_TYPES

    if fmt == "gguf-lora":
        return list(CONVERTER_TYPES), "F16"
    return list(GGUF_TYPES), "Q4_K_M"


def _path(name: str, what: str, root: Path | None = None) -> Path:
    if not name or not name.strip():
        raise TextgenError(f"choose {what}")
    try:
        return safe_child(root or shared.models_dir(), name.strip())
    except UnsafePath as exc:
        raise TextgenError(f"cannot use {name.strip()!r} as {what}: {exc}") from exc


def job_text(job: jobs.Job | None) -> str:
    """The last export-like job, as a status line (and its result)."""
    if job is None:
        return "*No export has run yet.*"
    fraction = f" {job.fraction:.0%}" if job.fraction is not None and job.state == "running" else ""
    text = f"**{job.title}**: {job.state}{fraction}. {job.message}"
    if job.error:
        text += f"\n\n{job.error}"
    result = job.result
    fidelity = getattr(result, "fidelity", None)
    if fidelity:
        from modules.lifecycle import fidelity as fid

        text += f"\n\n{fid.summary(fidelity)}"
        for item in fidelity.get("agreement", []):
            if item["agreed"] < item["total"]:
                text += f"\n- parted at token {item['agreed']} (HF logit margin {item['margin']:.3f})"
    elif isinstance(result, dict) and result.get("url"):
        visibility = "private" if result.get("private") else "public"
        text += f"\n\nPushed to {result['url']} ({visibility}): {', '.join(result.get('files', []))}"
    elif isinstance(result, Path | str):
        text += f"\n\nWrote `{result}`"
    return text


def table_frame(job: jobs.Job | None) -> pd.DataFrame:
    """The quant table job's rows (empty until it finishes)."""
    if job is None or not isinstance(job.result, list):
        return pd.DataFrame(columns=["quant", "size_mb", "bits_per_weight", "perplexity", "kld", "tokens_per_s"])
    frame = pd.DataFrame(job.result)
    return frame[["quant", "size_mb", "bits_per_weight", "perplexity", "ppl_ratio", "kld", "top1_same", "tokens_per_s"]]


def refused(exc: Exception) -> str:
    """A refused form, shown in the status line as well as in a toast (which queue=False events do not show)."""
    gr.Warning(str(exc))
    return f"**Refused:** {exc}"


def start_job(title: str, target: Any, args: Any, *, process: bool = True) -> jobs.Job:
    """Start ``target(args, report, cancel)`` as the panel's job: in a child process (merge, export, quant table load
    torch and llama.cpp: a native crash or an OOM kill ends the job, not the server), or in a thread (push)."""
    if process:
        return jobs.start_process(KIND, title, target, args, exclusive=True)
    return jobs.start(KIND, title, lambda report, cancel: target(args, report, cancel), exclusive=True)


def _start(title: str, target: Any, args: Any, *, process: bool = True) -> str:
    try:
        job = start_job(title, target, args, process=process)
    except jobs.Busy as exc:
        gr.Warning(str(exc))
        return job_text(exc.job)
    return job_text(job)


def build() -> None:
    """The panel (call inside the Model tab)."""
    from modules.lifecycle.export import FORMATS, GGUF_TYPES
    from modules.lifecycle.quant_table import DEFAULT_TYPES

    with gr.Accordion("Merge, export and quantize", open=False):
        with gr.Tab("Export"):
            with gr.Row():
                source = gr.Dropdown(_sources(), label="Model (HF folder or GGUF)", elem_id="export-source", scale=3)
                fmt = gr.Dropdown(list(FORMATS), value="gguf", label="Format", elem_id="export-format")
                quant = gr.Dropdown(list(GGUF_TYPES), value="Q4_K_M", label="Type", elem_id="export-quant")
            with gr.Row():
                output = gr.Textbox(label="Output name in models/ (empty: NAME.TYPE.gguf)", elem_id="export-output")
                base = gr.Dropdown(_sources(), value=None, label="Base (for a LoRA export)", elem_id="export-base")
                check = gr.Checkbox(True, label="Fidelity check (greedy agreement, PPL, KLD vs F16)")
                replace = gr.Checkbox(False, label="Replace the output if it exists", elem_id="export-replace")
            with gr.Row():
                export_btn = admin_control(gr.Button("Export", variant="primary", elem_id="export-start"))
                cancel_btn = admin_control(gr.Button("Cancel", elem_id="export-cancel"))
        with gr.Tab("Merge LoRA"):
            with gr.Row():
                merge_base = gr.Dropdown(_sources(), label="Base model (HF folder)", elem_id="merge-base")
                merge_lora = gr.Dropdown(_adapters(), label="LoRA", elem_id="merge-lora")
                merge_out = gr.Textbox(label="Merged model name in models/", elem_id="merge-output")
                merge_replace = gr.Checkbox(False, label="Replace the output if it exists", elem_id="merge-replace")
            merge_btn = admin_control(gr.Button("Merge", variant="primary", elem_id="merge-start"))
        with gr.Tab("Quant table"):
            with gr.Row():
                table_source = gr.Dropdown(_sources(), label="Model (HF folder)", elem_id="table-source", scale=2)
                types = gr.CheckboxGroup(list(GGUF_TYPES), value=list(DEFAULT_TYPES), label="Types", scale=3)
                table_replace = gr.Checkbox(False, label="Replace NAME-quants if it exists", elem_id="table-replace")
            table_btn = admin_control(gr.Button("Build the table", variant="primary", elem_id="table-start"))
            table = gr.Dataframe(table_frame(None), interactive=False, elem_id="quant-table")
            plot = gr.ScatterPlot(table_frame(None), x="size_mb", y="perplexity", color="quant",
                                  title="File size (MB) against perplexity", elem_id="quant-plot")  # fmt: skip
        with gr.Tab("Publish"):
            with gr.Row():
                push_source = gr.Dropdown(_publishable(), label="Model folder or GGUF in models/",
                                          elem_id="push-source", scale=2)  # fmt: skip
                push_repo = gr.Textbox(label="Hub repo (ORG/NAME)", elem_id="push-repo", scale=2)
                push_private = gr.Checkbox(True, label="Private repo", elem_id="push-private")
            with gr.Row():
                push_license = gr.Textbox(label="License for the card (e.g. apache-2.0)", elem_id="push-license")
                push_base = gr.Textbox(label="Base model on the Hub (for the card)", elem_id="push-base")
            gr.Markdown("The token comes from `HF_TOKEN` or `hf auth login` on the server; it is never shown here.")
            with gr.Row():
                card_btn = gr.Button("Preview the model card", elem_id="push-card")
                push_btn = admin_control(gr.Button("Push", variant="primary", elem_id="push-start"))
            card_text = gr.Code(label="Model card (README.md) as it would be sent", language="markdown",
                                interactive=False, elem_id="push-card-text")  # fmt: skip
        first = next(iter(jobs.all_jobs(KIND)), None)
        status = gr.Markdown(job_text(first), elem_id="export-status")
        shown = gr.State(listings())  # what the dropdowns list now: they are updated when models/ or loras/ change
        seen = gr.State(on_change(first.id if first else None, job_text(first), None)[1])  # what the line shows

    def start_export(name: str, fmt_: str, quant_: str, out: str, base_: str, check_: bool, replace_: bool) -> str:
        from modules.lifecycle.convert import refuse_existing
        from modules.lifecycle.export import ExportArgs, default_output, export

        try:
            args = ExportArgs(_path(name, "a model"), fmt_, quant_, _path(out, "an output name") if out else None,
                              _path(base_, "a base model") if base_ else None, check=bool(check_),
                              overwrite=bool(replace_))  # fmt: skip
            if fmt_ == "gguf-lora":
                args.source = _path(name, "a LoRA", shared.loras_dir())
            refuse_existing(Path(args.output or default_output(args)), args.overwrite)  # before the job starts
        except TextgenError as exc:
            return refused(exc)
        what = quant_ if fmt_ in ("gguf", "gguf-lora") else fmt_
        return _start(f"export {name} {what}", export, args)

    def start_merge(base_: str, lora: str, out: str, replace_: bool) -> str:
        from modules.lifecycle.convert import refuse_existing
        from modules.lifecycle.merge import MergeArgs, merge

        try:
            args = MergeArgs(_path(base_, "a base model"), _path(lora, "a LoRA", shared.loras_dir()),
                             _path(out or f"{base_}-{lora}-merged", "an output name"),
                             overwrite=bool(replace_))  # fmt: skip
            refuse_existing(args.output, args.overwrite)
        except TextgenError as exc:
            return refused(exc)
        return _start(f"merge {lora} into {base_}", merge, args)

    def start_table(name: str, chosen: list[str], replace_: bool) -> str:
        from modules.lifecycle.convert import refuse_existing
        from modules.lifecycle.quant_table import TableArgs, build

        try:
            source_path = _path(name, "a model")
            args = TableArgs(source_path, shared.models_dir() / f"{name}-quants", tuple(chosen or DEFAULT_TYPES),
                             overwrite=bool(replace_))  # fmt: skip
            refuse_existing(args.folder, args.overwrite)  # before the job starts
        except TextgenError as exc:
            return refused(exc)
        return _start(f"quant table {name}", build, args)

    def push_args(name: str, repo: str, private: bool, license_: str, base_: str) -> Any:
        from modules.lifecycle.publish import PushArgs

        return PushArgs(_path(name, "a model or GGUF to push"), (repo or "").strip(), private=bool(private),
                        license=(license_ or "").strip(), base_model=(base_ or "").strip())  # fmt: skip

    def preview_card(name: str, repo: str, private: bool, license_: str, base_: str) -> Any:
        from modules.lifecycle.publish import prepare

        try:
            _, files, text = prepare(push_args(name, repo, private, license_, base_))
        except TextgenError as exc:
            refused(exc)
            return gr.update(value=f"<!-- {exc} -->")
        return gr.update(value=text or f"<!-- no card: {', '.join(files)} are sent without one -->")

    def start_push(name: str, repo: str, private: bool, license_: str, base_: str) -> str:
        from modules.lifecycle.publish import find_token, prepare, push

        try:
            args = push_args(name, repo, private, license_, base_)
            prepare(args)  # a bad repo name or an empty folder is refused before the job starts
            find_token(args)
        except TextgenError as exc:
            return refused(exc)
        return _start(f"push {name} to {args.repo}", push, args, process=False)

    def cancel() -> str:
        job = jobs.running(KIND)
        if job is None:  # nothing to cancel: the last job's line stays (the timer changes it only when the job does)
            gr.Info("No export, merge or push is running.")
            return job_text(next(iter(jobs.all_jobs(KIND)), None))
        jobs.cancel(job.id)
        return job_text(job)

    def poll(fmt_: str, before: dict[str, list[str]], seen: list[str] | None) -> tuple[Any, ...]:
        last = next(iter(jobs.all_jobs(KIND)), None)
        shown_text, now_seen = on_change(last.id if last else None, job_text(last), seen)
        table_job = next((j for j in jobs.all_jobs(KIND) if j.title.startswith("quant table")), None)
        frame = table_frame(table_job)
        now = listings()
        if now == before:  # nothing new on disk: leave the dropdowns (and what is open in them) alone
            return shown_text, frame, frame, before, now_seen, *[gr.skip()] * 6
        choices, label = source_choices(fmt_, now)
        sources = gr.update(choices=now["sources"])
        return (shown_text, frame, frame, now, now_seen, gr.update(choices=choices, label=label), sources, sources,
                gr.update(choices=now["adapters"]), sources, gr.update(choices=now["publish"]))  # fmt: skip

    def format_changed(fmt_: str) -> tuple[Any, Any]:
        choices, label = source_choices(fmt_)
        types_, default = type_choices(fmt_)
        return gr.update(choices=choices, value=None, label=label), gr.update(choices=types_, value=default)

    export_btn.click(admin_only("export models")(start_export), [source, fmt, quant, output, base, check, replace], status,
                     queue=False)  # fmt: skip
    merge_btn.click(admin_only("merge LoRAs")(start_merge), [merge_base, merge_lora, merge_out, merge_replace], status,
                    queue=False)  # fmt: skip
    table_btn.click(admin_only("quantize models")(start_table), [table_source, types, table_replace], status,
                    queue=False)  # fmt: skip
    cancel_btn.click(admin_only("cancel an export")(cancel), None, status, queue=False)
    push_inputs = [push_source, push_repo, push_private, push_license, push_base]
    card_btn.click(preview_card, push_inputs, card_text, queue=False)
    push_btn.click(admin_only("push models to the Hub")(start_push), push_inputs, status, queue=False)
    fmt.change(format_changed, fmt, [source, quant], queue=False)
    lists = [source, base, merge_base, merge_lora, table_source, push_source]
    gr.Timer(2.0).tick(poll, [fmt, shown, seen], [status, table, plot, shown, seen, *lists], queue=False,
                       show_progress="hidden")  # fmt: skip
