"""Assemble the web UI from the tab modules."""

from __future__ import annotations

from typing import Any

import gradio as gr

from modules import extensions
from modules.ui import (
    admin,
    chat_sidebar,
    chat_tab,
    code_notebook_tab,
    model_tab,
    notebook_tab,
    parameters_tab,
    session_tab,
    training_tab,
)

CSS = """
#chat-status, #context-usage { font-size: 0.85em; opacity: 0.8; }
#chatbot { font-size: 0.95em; }
#exposed-warning { border: 2px solid #d97706; border-radius: 6px; padding: 0 0.8em; background: #fffbeb; color: #7c2d12; }
#admin-notice { font-size: 0.9em; opacity: 0.85; }
"""


def build_ui() -> gr.Blocks:
    """The whole web UI as one Blocks app."""
    with gr.Blocks(title="textgen") as demo, admin.collecting() as admin_controls:
        exposed = admin.exposure_text()
        gr.Markdown(exposed, visible=bool(exposed), elem_id="exposed-warning")
        notice = gr.Markdown(visible=False, elem_id="admin-notice")  # filled for a signed-in non-admin
        with gr.Tab("Chat", id="chat"):
            with gr.Row():
                with gr.Column(scale=4):
                    chat = chat_tab.build()
                with gr.Column(scale=1, min_width=280):
                    side = chat_sidebar.build()
            for ext in extensions.implementers("ui"):
                if not ext.params.get("is_tab"):
                    with gr.Accordion(ext.display_name, open=False, elem_classes=["extension-block"]):
                        extensions.call(ext, "ui")
        with gr.Tab("Notebook", id="notebook"):
            notebook = notebook_tab.build_notebook()
        with gr.Tab("Code", id="code-notebook"):
            code_notebook = code_notebook_tab.build(demo)
        with gr.Tab("Default", id="default"):
            default = notebook_tab.build_default()
        with gr.Tab("Parameters", id="parameters"):
            params = parameters_tab.build()
        with gr.Tab("Model", id="model"):
            model_page_load, model_page_outputs = model_tab.build()
        with gr.Tab("Training", id="training"):
            training_tab.build()
        for ext in extensions.implementers("ui"):
            if ext.params.get("is_tab"):
                with gr.Tab(ext.display_name, elem_classes=["extension-tab"]):
                    extensions.call(ext, "ui")
        with gr.Tab("Session", id="session"):
            session_tab.build()
        chat_tab.wire(chat, params)
        restore, restore_inputs, restore_outputs = chat_sidebar.wire(chat, side)
        notebook_tab.wire(notebook, params, "-notebook")
        notebook_tab.wire(default, params, "-default")
        code_notebook_tab.wire(code_notebook, params)
        # One chain, so the page knows when it is ready: the body gets data-page-loaded="1" once the latest chat,
        # the parameters and the Model tab are restored (a user typing before that could see their input replaced).
        loaded = demo.load(admin.page_load(admin_controls), None, [notice, *admin_controls], show_progress="hidden")
        loaded = loaded.then(restore, restore_inputs, restore_outputs)
        loaded = loaded.then(parameters_tab.ignored_text, None, params.ignored)
        loaded = loaded.then(params.page_load, None, params.page_load_outputs)
        loaded = loaded.then(model_page_load, None, model_page_outputs)
        loaded.then(None, js="() => { document.body.dataset.pageLoaded = '1'; }")
    quiet_queue(demo)
    return demo


QUEUE_IDLE_POLL_S = 0.01


def quiet_queue(demo: gr.Blocks) -> None:
    """Gradio's queue looks for work every millisecond while it has none or its workers are all busy (the same
    sleep for both; 1000 wake-ups a second on Linux): an idle server spent 6.5% of a core on it, 2.7% with 10 ms
    (2 cores, AMD EPYC), time otherwise taken from llama.cpp's threads while they generate. 10 ms is still far below
    what a person notices. Gradio has no setting for it, so the attribute is set, and left alone if Gradio renames
    it (tests/integration/test_server.py says so)."""
    queue: Any = getattr(demo, "_queue", None)
    if isinstance(getattr(queue, "sleep_when_free", None), float) and queue.sleep_when_free < QUEUE_IDLE_POLL_S:
        queue.sleep_when_free = QUEUE_IDLE_POLL_S


def custom_css() -> str:
    """Our CSS plus every extension's."""
    return "\n".join([CSS, code_notebook_tab.CSS, *extensions.collect("custom_css")])


def custom_js() -> str | None:
    """Every extension's JavaScript, or None."""
    parts = extensions.collect("custom_js")
    return "\n".join(parts) if parts else None
