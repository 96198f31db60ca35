"""Notebook tab (one text: the model continues it) and Default tab (input and output side by side)."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import gradio as gr

from modules import shared
from modules.errors import TextgenError
from modules.generation.pipeline import count_tokens, stream_text
from modules.ui.chat_tab import update_interval
from modules.ui.parameters_tab import ParamsUI

log = logging.getLogger(__name__)


@dataclass
class NotebookUI:
    """A text area the model continues, with its buttons."""

    text: Any
    output: Any | None
    generate: Any
    stop: Any
    tokens: Any
    status: Any


def _tokens_text(text: str) -> str:
    try:
        return f"{count_tokens(text)} tokens"
    except TextgenError:
        return ""


def build_notebook() -> NotebookUI:
    """The Notebook tab: the output is appended to the same text."""
    text = gr.Textbox(value="Once upon a time,", lines=20, label="Notebook", elem_id="notebook-text")
    with gr.Row():
        generate = gr.Button("Generate", variant="primary", elem_id="notebook-generate")
        stop = gr.Button("Stop", variant="stop", elem_id="notebook-stop")
        tokens = gr.Markdown(elem_id="notebook-tokens")
    status = gr.Markdown(elem_id="notebook-status")
    return NotebookUI(text, None, generate, stop, tokens, status)


def build_default() -> NotebookUI:
    """The Default tab: a prompt on the left, the completion on the right."""
    with gr.Row():
        with gr.Column():
            text = gr.Textbox(value="", lines=16, label="Input", elem_id="default-input")
            with gr.Row():
                generate = gr.Button("Generate", variant="primary", elem_id="default-generate")
                stop = gr.Button("Stop", variant="stop", elem_id="default-stop")
            tokens = gr.Markdown(elem_id="default-tokens")
        with gr.Column():
            output = gr.Textbox(lines=16, label="Output", elem_id="default-output")
            status = gr.Markdown(elem_id="default-status")
    return NotebookUI(text, output, generate, stop, tokens, status)


def wire(ui: NotebookUI, params: ParamsUI, key_suffix: str) -> None:
    """Connect generation (reading the Parameters tab), stop and the token count."""
    appends = ui.output is None

    def generate(request: gr.Request, prompt: str, *values: Any) -> Iterator[tuple[Any, ...]]:
        try:
            gen = params.to_params(*values)
            shown_at = 0.0
            for text, stats in stream_text(prompt, gen, key=request.session_hash + key_suffix):
                if stats is None and time.monotonic() - shown_at < update_interval():
                    continue
                shown_at = time.monotonic()
                shown = prompt + text if appends else text
                yield shown, stats.summary() if stats else "Generating...", _tokens_text(shown if appends else prompt)
        except TextgenError as exc:
            gr.Warning(str(exc))
            yield gr.skip(), f"Error: {exc}", gr.skip()

    target = ui.text if appends else ui.output
    ui.generate.click(
        generate,
        [ui.text, *params.components],
        [target, ui.status, ui.tokens],
        concurrency_limit=None,
        show_progress="hidden",
    )

    def stop(request: gr.Request) -> None:
        shared.stop_generation(request.session_hash + key_suffix)

    ui.stop.click(stop, None, None, queue=False)
    ui.text.change(_tokens_text, ui.text, ui.tokens, queue=False, show_progress="hidden")
