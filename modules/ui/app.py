"""Assemble the web UI from the tab modules."""

from __future__ import annotations

import gradio as gr

from modules import extensions
from modules.ui import chat_tab, model_tab, session_tab

CSS = """
#chat-status { font-size: 0.85em; opacity: 0.8; }
"""


def build_ui() -> gr.Blocks:
    """The whole web UI as one Blocks app."""
    with gr.Blocks(title="textgen") as demo:
        with gr.Tab("Chat", id="chat"):
            chat_tab.build()
            for ext in extensions.implementers("ui"):
                if not ext.params.get("is_tab"):
                    with gr.Accordion(ext.display_name, open=False, elem_classes=["extension-block"]):
                        extensions.call(ext, "ui")
        with gr.Tab("Model", id="model"):
            model_tab.build()
        for ext in extensions.implementers("ui"):
            if ext.params.get("is_tab"):
                with gr.Tab(ext.display_name, elem_classes=["extension-tab"]):
                    extensions.call(ext, "ui")
        with gr.Tab("Session", id="session"):
            session_tab.build()
    return demo


def custom_css() -> str:
    """Our CSS plus every extension's."""
    return "\n".join([CSS, *extensions.collect("custom_css")])


def custom_js() -> str | None:
    """Every extension's JavaScript, or None."""
    parts = extensions.collect("custom_js")
    return "\n".join(parts) if parts else None
