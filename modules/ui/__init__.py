"""The Gradio web UI: one module per tab, assembled by ui/app.py. No business logic here."""

from __future__ import annotations

from typing import Any


def on_change(key: Any, text: str, seen: Any) -> tuple[Any, list[Any]]:
    """A status line that a timer refreshes: what to show and what to remember (a ``gr.State``) for the next tick.
    The line changes when what it reports does (another job, its progress), not on every tick, so a message a button
    put there (a refusal, "stopping...") stays until then instead of the last job's old line coming back over it.
    ``seen`` starts as what the line shows when the page is built (``on_change(key, text, None)[1]``): starting empty,
    the first tick would put the line back over a click made before it."""
    import gradio as gr

    now = [key, text]
    return (gr.skip() if now == seen else text), now
