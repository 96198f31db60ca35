"""Assemble the web UI from the tab modules."""

from __future__ import annotations

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
    return demo


def custom_css() -> str:
    """Our CSS plus every extension's."""
    return "\n".join([CSS, code_notebook_tab.CSS, *extensions.collect("custom_css")])


def custom_js() -> str | None:
    """Every extension's JavaScript, or None."""
    parts = extensions.collect("custom_js")
    return "\n".join(parts) if parts else None
