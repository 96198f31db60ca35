"""Long replies: the model may not end its reply before a minimum number of tokens."""

from __future__ import annotations

from typing import Any

params: dict[str, Any] = {"display_name": "Long replies", "is_tab": False, "min_length": 120}


def state_modifier(state: dict[str, Any]) -> dict[str, Any]:
    """Forbid the end-of-sequence token until ``min_length`` tokens were generated."""
    state["min_tokens"] = max(int(state.get("min_tokens") or 0), int(params.get("min_length") or 0))
    return state


def ui() -> None:
    """The minimum length."""
    import gradio as gr

    length = gr.Slider(0, 1000, value=params["min_length"], step=10, label="Minimum reply length (tokens)")
    from modules.ui.admin import admin_only  # a server-wide setting: admin work

    length.change(
        admin_only("change the minimum reply length")(lambda value: params.update(min_length=int(value))), length
    )
