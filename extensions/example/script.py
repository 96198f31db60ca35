"""A commented template that touches every hook. Copy this folder to user_data/extensions/NAME to start your own.

Enable it with ``--extensions example`` (or in the Session tab). Each function below is a hook: textgen finds it by
its name, no decorator needed, and calls it with the arguments it declares (you may leave out the ones you do not
need). Modifier hooks receive the previous extension's result and return the new value. Anything your hook raises
is logged with the extension's name and switches the extension off; the server keeps running.
"""

from __future__ import annotations

from typing import Any

# Settings shown in the UI and overridable from user_data/settings.yaml as `example-KEY: value`.
params: dict[str, Any] = {
    "display_name": "Example",  # the name of the UI block
    "is_tab": False,  # True: the UI gets its own tab; False: an accordion under the chat
    "activate": False,  # this template changes nothing until you switch it on
    "reply_suffix": " (via the example extension)",
}

calls: list[str] = []  # every hook appends its name, so you can see what ran


def setup() -> None:
    """Runs once when the extension loads, after params were merged with settings.yaml."""
    calls.append("setup")


def ui() -> None:
    """Build Gradio components; they appear in this extension's block."""
    import gradio as gr

    activate = gr.Checkbox(value=params["activate"], label="Activate the example extension")
    from modules.ui.admin import admin_only  # a server-wide switch: admin work

    activate.change(admin_only("switch this extension")(lambda value: params.update(activate=value)), activate)


def custom_css() -> str:
    """CSS added to the page."""
    return ".example-extension { border: 1px dashed gray; }"


def custom_js() -> str:
    """JavaScript added to the page."""
    return "console.debug('example extension loaded');"


def state_modifier(state: dict[str, Any]) -> dict[str, Any]:
    """Change generation parameters (``state['temperature']``...) or chat settings before a generation."""
    calls.append("state_modifier")
    return state


def chat_input_modifier(text: str, visible_text: str, state: dict[str, Any]) -> tuple[str, str]:
    """Change what the model sees and what the history shows for the user's chat message."""
    calls.append("chat_input_modifier")
    return text, visible_text


def input_modifier(string: str, state: dict[str, Any], is_chat: bool = False) -> str:
    """Change the user input (the newest chat message, or a raw notebook/API prompt) in the prompt."""
    calls.append("input_modifier")
    return string


def history_modifier(history: dict[str, Any]) -> dict[str, Any]:
    """Change the history before the prompt is built (``history['messages']`` or text-generation-webui's
    ``history['internal']`` pairs)."""
    calls.append("history_modifier")
    return history


def bot_prefix_modifier(string: str, state: dict[str, Any]) -> str:
    """Text added after the reply's prefix steers the reply without being part of it."""
    calls.append("bot_prefix_modifier")
    return string


def custom_generate_chat_prompt(user_input: str, state: dict[str, Any], **kwargs: Any) -> str | None:
    """Return a whole prompt to replace the template's, or None to leave it alone."""
    calls.append("custom_generate_chat_prompt")
    return None


def custom_generate_reply(
    question: str, original_question: str, state: dict[str, Any], stopping_strings: list[str], is_chat: bool
) -> Any:
    """Return an iterator of the cumulative reply to answer instead of the model, or None."""
    calls.append("custom_generate_reply")
    return None


def tokenizer_modifier(state: dict[str, Any], prompt: str, input_ids: list[int]) -> tuple[str, list[int]]:
    """Change the prompt's token ids right before generation."""
    calls.append("tokenizer_modifier")
    return prompt, input_ids


def custom_tokenized_length(prompt: str) -> int | None:
    """Return a token count for ``prompt`` (used for truncation), or None."""
    return None


def logits_processor_modifier(processor_list: list[Any], input_ids: Any) -> None:
    """Append ``(input_ids, scores) -> scores`` processors (torch backends only)."""
    calls.append("logits_processor_modifier")


def output_modifier(string: str, state: dict[str, Any], is_chat: bool = False) -> str:
    """Change the reply the UI shows (the model's text stays in the history for the next prompt)."""
    calls.append("output_modifier")
    return string + params["reply_suffix"] if params["activate"] else string


def api_routes(app: Any) -> None:
    """Add HTTP routes to the server (before the web UI is mounted)."""

    from fastapi import Depends

    from extensions.openai.auth import require_key

    @app.get("/v1/example/hooks", dependencies=[Depends(require_key)])  # routes under /v1 take the API key
    def hooks_called() -> dict[str, list[str]]:
        return {"calls": calls[-50:]}


def register_backends(register: Any) -> None:
    """Add loaders: ``register("name", BackendClass)``."""
