"""Character bias: add a fixed string after the reply's prefix, steering every reply (e.g. a mood)."""

from __future__ import annotations

from typing import Any

params: dict[str, Any] = {
    "display_name": "Character bias",
    "is_tab": False,
    "activate": True,
    "bias_string": "*I am so happy*",
}


def bot_prefix_modifier(string: str, state: dict[str, Any]) -> str:
    """Append the bias string to the reply's prefix: the model continues from it."""
    bias = str(params.get("bias_string", "")).strip()
    if params.get("activate") and bias:
        return f"{string} {bias} "
    return string


def ui() -> None:
    """An on/off switch and the bias text."""
    import gradio as gr

    activate = gr.Checkbox(value=params["activate"], label="Activate character bias")
    text = gr.Textbox(value=params["bias_string"], label="Bias string")
    from modules.ui.admin import admin_only  # the bias applies to everyone's replies: admin work

    activate.change(admin_only("switch the character bias")(lambda value: params.update(activate=value)), activate)
    text.change(admin_only("change the character bias")(lambda value: params.update(bias_string=value)), text)
