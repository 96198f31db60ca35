"""Chat tab: history, input, Send / Stop / Regenerate / Clear, streaming replies."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import gradio as gr

from modules import shared
from modules.chat import engine
from modules.errors import TextgenError
from modules.generation import presets
from modules.generation.params import GenerationParams

NO_PRESET = "(defaults)"
DEFAULT_PRESET = "Min-P"
# A short system message works better with small models than their own long default one; editable in the UI.
DEFAULT_SYSTEM_MESSAGE = "You are a helpful AI assistant."

History = list[dict[str, Any]]
log = logging.getLogger(__name__)


def _params(preset: str, max_new_tokens: float) -> GenerationParams:
    base = presets.load_preset(preset) if preset and preset != NO_PRESET else {}
    return GenerationParams.from_dict({**base, "max_new_tokens": int(max_new_tokens)})


def display(history: History) -> list[dict[str, Any]]:
    """What the chat shows: each message's visible text (extensions may have changed it)."""
    return [
        {"role": m["role"], "content": m.get("visible", m["content"])}
        for m in history
        if m["role"] in ("user", "assistant")
    ]


def _run(updates: Iterator[engine.ChatUpdate], history: History) -> Iterator[tuple[Any, ...]]:
    try:
        for update in updates:
            history = update.history
            status = update.stats.summary() if update.stats else "Generating..."
            yield display(history), history, status
    except TextgenError as exc:
        gr.Warning(str(exc))
        yield display(history), history, f"Error: {exc}"
    except Exception as exc:  # an unexpected failure: keep the history, say what happened
        log.exception("chat generation failed")
        gr.Warning(f"Generation failed: {exc}")
        yield display(history), history, f"Error: generation failed ({type(exc).__name__}: {exc})"


def send(
    text: str, history: History, preset: str, max_new: float, system: str, request: gr.Request
) -> Iterator[tuple[Any, ...]]:
    """Send the user's message and stream the reply."""
    if not text.strip():
        yield display(history), history, ""
        return
    try:
        params = _params(preset, max_new)
    except TextgenError as exc:
        gr.Warning(str(exc))
        yield display(history), history, f"Error: {exc}"
        return
    yield from _run(engine.send(history, text, params, system=system, key=request.session_hash), history)


def regenerate(
    history: History, preset: str, max_new: float, system: str, request: gr.Request
) -> Iterator[tuple[Any, ...]]:
    """Replace the last reply."""
    try:
        params = _params(preset, max_new)
    except TextgenError as exc:
        gr.Warning(str(exc))
        yield display(history), history, f"Error: {exc}"
        return
    yield from _run(engine.regenerate(history, params, system=system, key=request.session_hash), history)


def stop(request: gr.Request) -> None:
    """Stop this browser session's generation."""
    shared.stop_generation(request.session_hash)


def build() -> None:
    """Create the chat tab's components and events inside the current Blocks context."""
    history = gr.State([])
    chatbot = gr.Chatbot(label="Chat", elem_id="chatbot", height=520, buttons=["copy"], placeholder="Say something.")
    with gr.Row():
        textbox = gr.Textbox(show_label=False, placeholder="Send a message", elem_id="chat-input", scale=8, lines=2)
        send_btn = gr.Button("Send", variant="primary", elem_id="send", scale=1)
    with gr.Row():
        stop_btn = gr.Button("Stop", variant="stop", elem_id="stop")
        regen_btn = gr.Button("Regenerate", elem_id="regenerate")
        clear_btn = gr.Button("Clear", elem_id="clear")
    status = gr.Markdown("", elem_id="chat-status")
    with gr.Accordion("Generation", open=False):
        choices = [NO_PRESET, *presets.list_presets()]
        default = shared.ui_defaults.get("preset", DEFAULT_PRESET)
        preset = gr.Dropdown(
            choices, value=default if default in choices else NO_PRESET, label="Preset", elem_id="chat-preset"
        )
        max_new = gr.Slider(
            1, 4096, value=int(shared.ui_defaults.get("max_new_tokens", 512)), step=1, label="max_new_tokens"
        )
        system = gr.Textbox(
            value=str(shared.ui_defaults.get("system_message", DEFAULT_SYSTEM_MESSAGE)),
            label="System message (empty: the model's own default)",
            lines=2,
            elem_id="system-message",
        )

    pending = gr.State("")  # the message being sent, so the textbox can clear at once
    outputs = [chatbot, history, status]
    for trigger in (send_btn.click, textbox.submit):
        trigger(lambda text: ("", text), [textbox], [textbox, pending], queue=False).then(
            send, [pending, history, preset, max_new, system], outputs, concurrency_limit=None
        )
    regen_btn.click(regenerate, [history, preset, max_new, system], outputs, concurrency_limit=None)
    stop_btn.click(stop, None, None, queue=False)
    clear_btn.click(lambda: ([], [], ""), None, outputs, queue=False)
