"""Model controls: pick a model from models/, load, unload, and see what is loaded."""

from __future__ import annotations

from typing import Any

import gradio as gr

from modules import models, shared
from modules.errors import TextgenError


def status_text() -> str:
    """What is loaded now (or why not)."""
    if shared.loading_model:
        return f"Loading **{shared.loading_model}**..."
    if shared.model is not None:
        loader = shared.model_options.get("loader", shared.model.loader_name)
        return f"Loaded **{shared.model_name}** ({loader}, context {shared.model.context_length})"
    if shared.load_error:
        return f"No model loaded. Last error: {shared.load_error}"
    return "No model loaded."


def refresh() -> Any:
    """Re-read the models folder."""
    return gr.update(choices=models.model_names(), value=shared.model_name)


def load(name: str | None) -> str:
    """Load the chosen model, unloading the current one first."""
    if not name:
        gr.Warning("Pick a model first.")
        return status_text()
    try:
        models.load_model(name)
    except TextgenError as exc:
        gr.Warning(str(exc))
    return status_text()


def unload() -> str:
    """Unload the current model."""
    models.unload_model()
    return status_text()


def build() -> None:
    """Create the model controls inside the current Blocks context."""
    with gr.Row():
        dropdown = gr.Dropdown(
            models.model_names(), value=shared.model_name, label="Model", elem_id="model-dropdown", scale=4
        )
        refresh_btn = gr.Button("Refresh", scale=1)
        load_btn = gr.Button("Load", variant="primary", elem_id="model-load", scale=1)
        unload_btn = gr.Button("Unload", elem_id="model-unload", scale=1)
    status = gr.Markdown(status_text(), elem_id="model-status")
    refresh_btn.click(refresh, None, dropdown, queue=False)
    load_btn.click(load, dropdown, status, concurrency_limit=1)
    unload_btn.click(unload, None, status, concurrency_limit=1)
    timer = gr.Timer(2.0)
    timer.tick(status_text, None, status, queue=False, show_progress="hidden")
