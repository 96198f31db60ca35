"""Model tab panels of the lifecycle: this machine's plan for the selected model (with the memory it expects, and
after a load the measured memory beside the estimate), and a Hub download box with progress and Cancel.

Only an adapter: the plan is ``smart_config.make_plan``, the download ``hub.download`` run as a ``jobs`` job.
"""

from __future__ import annotations

import time
from typing import Any

import gradio as gr

from modules import jobs, models, shared
from modules.errors import TextgenError
from modules.lifecycle import memory
from modules.ui.admin import admin_control, admin_only

_hardware_cache: tuple[float, Any] = (0.0, None)


def _hardware() -> Any:
    global _hardware_cache
    from modules.lifecycle import hardware

    stamp, info = _hardware_cache
    if info is None or time.monotonic() - stamp > 30:
        info = hardware.detect()
        _hardware_cache = (time.monotonic(), info)
    return info


def plan_text(name: str | None) -> str:
    """The plan for the model ``name`` on this machine, in Markdown."""
    if not name:
        return "*Pick a model to see the plan for this machine.*"
    from modules.lifecycle import analyzer, smart_config

    try:
        info = models.find_model(name)
        analysis = analyzer.analyze_gguf(info.path) if info.path.is_file() else analyzer.analyze_folder(info.path)
        plan = smart_config.make_plan(analysis, _hardware(), allow_remote_code=shared.settings.trust_remote_code)
    except TextgenError as exc:
        return f"No plan for {name}: {exc}"
    verdict = (
        f"**will not load as it is**: {plan.refused}"
        if plan.refused
        else "**fits**"
        if plan.fits
        else "**will not fit** this machine"
    )
    lines = [
        f"**Plan for this machine** ({'applied on load: --auto' if shared.settings.auto else 'advice'}): {verdict}"
    ]
    lines += [f"- `{c.setting}` = `{c.value}`: {c.reason}" for c in plan.choices]
    if plan.memory:
        lines.append(f"- expected memory: {plan.memory.text()}")
    lines += [f"- would fit: {w}" for w in plan.would_fit]
    return "\n".join(lines)


def measured_text() -> str:
    """After a load: its memory estimate beside what it took."""
    last = memory.last_load
    if last is None or shared.model is None or last.model != shared.model_name:
        return ""
    return f"**Last load**: {last.text()}"


def job_text(job_id: str | None) -> str:
    """A download job's progress in one line."""
    job = jobs.get(job_id) if job_id else None
    if job is None:
        return ""
    if job.state == "running":
        shown = f"{job.done / 2**20:,.1f} / {(job.total or 0) / 2**20:,.1f} MiB"
        percent = f" ({job.fraction:.0%})" if job.fraction is not None else ""
        eta = f", about {job.eta_s:,.0f} s left" if job.eta_s else ""
        return f"Downloading **{job.title}**: {shown}{percent}{eta}. {job.message}"
    if job.state == "done":
        result = job.result or {}
        return f"Downloaded **{job.title}** to `{result.get('path', '')}`: load it as **{result.get('name', '')}**."
    if job.state == "cancelled":
        return f"Cancelled **{job.title}**; what arrived is kept: download again to resume."
    return f"Download of **{job.title}** failed: {job.error}"


def _args(repo: str, quant: str, specific: str, include: str, exclude: str, token: str) -> Any:
    from modules.lifecycle import hub

    return hub.DownloadArgs(
        repo=repo.strip(),
        quant=quant.strip() or None,
        specific_file=specific.strip() or None,
        include=include.split(),
        exclude=exclude.split(),
        token=token.strip() or None,
    )


def build(dropdown: Any) -> None:
    """Add the plan and the download box under the Model tab's controls; ``dropdown`` is the model picker."""
    plan = gr.Markdown(lambda: plan_text(shared.model_name), elem_id="model-plan")
    measured = gr.Markdown(measured_text, elem_id="model-measured")
    with gr.Accordion("Download from the Hugging Face Hub", open=False, elem_id="download-box"):
        with gr.Row():
            repo = gr.Textbox(label="Repo", placeholder="ORG/NAME or ORG/NAME:BRANCH", scale=3, elem_id="download-repo")
            quant = gr.Textbox(label="GGUF quantization", placeholder="Q4_K_M", scale=1, elem_id="download-quant")
            specific = gr.Textbox(label="Only this file", placeholder="(optional)", scale=2, elem_id="download-file")
        with gr.Row():
            include = gr.Textbox(label="Include (globs)", placeholder="*.safetensors *.json", scale=2)
            exclude = gr.Textbox(label="Exclude (globs)", scale=2)
            token = gr.Textbox(label="Token (gated repos)", type="password", placeholder="HF_TOKEN", scale=2)
        with gr.Row():
            check_btn = admin_control(gr.Button("Check", elem_id="download-check"))
            start_btn = admin_control(gr.Button("Download", variant="primary", elem_id="download-start"))
            cancel_btn = admin_control(gr.Button("Cancel", variant="stop", elem_id="download-cancel"))
        status = gr.Markdown(elem_id="download-status")
        job_id = gr.State(None)

    def check(*values: str) -> str:
        from modules.lifecycle import hub

        try:
            prepared = hub.prepare(_args(*values)).to_dict()
        except TextgenError as exc:
            return f"{exc}"
        files = ", ".join(f["path"] for f in prepared["files"][:8]) + (" ..." if len(prepared["files"]) > 8 else "")
        quants = f" Quantizations: {', '.join(prepared['quants'])}." if prepared["quants"] else ""
        notes = "".join(f" {n}." for n in prepared["notes"])
        return (
            f"{prepared['repo']}@{prepared['branch']}: {files} ({prepared['total_bytes'] / 2**20:,.1f} MiB) "
            f"-> `{prepared['target']}`.{quants}{notes}"
        )

    def start(*values: str) -> tuple[str | None, str]:
        from modules.lifecycle import hub

        try:
            # the same job as the API's: a second Start (or an API client) fetching the same files joins it
            job = hub.start_job(hub.prepare(_args(*values)), exclusive=True)
        except (TextgenError, jobs.Busy) as exc:
            return None, str(exc)
        return job.id, job_text(job.id)

    def cancel(current: str | None) -> str:
        if current and jobs.cancel(current):
            jobs.get(current).wait(5)  # type: ignore[union-attr]
        return job_text(current)

    def tick(current: str | None) -> tuple[Any, Any, str, str | None]:
        job = jobs.get(current) if current else None
        if job is None:
            return gr.update(), gr.update(), measured_text(), None
        choices = gr.update(choices=models.model_names()) if job.state == "done" else gr.update()
        return job_text(current), choices, measured_text(), current if job.state == "running" else None

    values = [repo, quant, specific, include, exclude, token]
    check_btn.click(admin_only("download from the Hub")(check), values, status, concurrency_limit=2)
    start_btn.click(admin_only("download from the Hub")(start), values, [job_id, status], queue=False)
    cancel_btn.click(admin_only("cancel a download")(cancel), job_id, status, queue=False)
    dropdown.change(plan_text, dropdown, plan, queue=False)
    timer = gr.Timer(1.0)
    timer.tick(tick, job_id, [status, dropdown, measured, job_id], queue=False, show_progress="hidden")
