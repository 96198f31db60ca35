"""Perplexity colors: show each generated token coloured by the probability the model gave it.

Asks the backend for log probabilities (``state['logprobs']``) and turns the reply's tokens into HTML spans:
red for unlikely tokens, yellow in between, green for confident ones; hover a token to see its probability.
"""

from __future__ import annotations

import html
import math
from typing import Any

params: dict[str, Any] = {"display_name": "Perplexity colors", "is_tab": False, "activate": True}


def state_modifier(state: dict[str, Any]) -> dict[str, Any]:
    """Ask for the log probability of every generated token."""
    if params.get("activate"):
        state["logprobs"] = True
    return state


def color(probability: float) -> str:
    """Red (0) through yellow (0.5) to green (1)."""
    p = min(max(probability, 0.0), 1.0)
    red = 255 if p < 0.5 else int(255 * (1 - p) * 2)
    green = int(255 * p * 2) if p < 0.5 else 255
    return f"#{red:02x}{green:02x}40"


def output_modifier(string: str, state: dict[str, Any], is_chat: bool = False) -> str:
    """Colour the reply token by token (``state['reply_tokens']`` holds (text, logprob) pairs)."""
    tokens = state.get("reply_tokens") or []
    if not params.get("activate") or not tokens:
        return string
    spans = []
    for text, logprob in tokens:
        probability = math.exp(logprob) if logprob is not None else 1.0
        spans.append(
            f'<span style="background-color: {color(probability)}; color: black" '
            f'title="{probability:.3f}">{html.escape(text)}</span>'
        )
    return "".join(spans)
