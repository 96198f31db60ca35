"""Build a chat prompt from messages with the model's template, truncated to fit the context."""

from __future__ import annotations

from typing import Any

from modules.chat.templates import render
from modules.loaders.base import Backend


def model_template(backend: Backend) -> str | None:
    """The template to use for this model: a per-model override, else the model's own (None: fallback)."""
    override = backend.metadata.extra.get("chat_template")
    return str(override) if override else backend.metadata.chat_template


def render_messages(
    backend: Backend,
    messages: list[dict[str, Any]],
    *,
    template: str | None = None,
    add_generation_prompt: bool = True,
    **extra: Any,
) -> str:
    """Render messages with ``template`` or the model's own template."""
    return render(
        template or model_template(backend),
        messages,
        add_generation_prompt=add_generation_prompt,
        bos_token=backend.metadata.bos_token,
        eos_token=backend.metadata.eos_token,
        **extra,
    )


def fit_messages(
    backend: Backend,
    messages: list[dict[str, Any]],
    max_new_tokens: int,
    *,
    template: str | None = None,
    **extra: Any,
) -> tuple[str, list[dict[str, Any]]]:
    """Render the prompt, dropping the oldest turns (never system messages or the last one) until it fits.

    Returns the prompt and the messages it holds. If even the last turn does not fit, the prompt is
    returned as is and the pipeline reports the overflow.
    """
    budget = backend.context_length - max(1, min(max_new_tokens, backend.context_length // 2))
    droppable = [i for i, m in enumerate(messages[:-1]) if m.get("role") != "system"]

    def attempt(cut: int) -> tuple[str, list[dict[str, Any]], bool]:
        dropped = set(droppable[:cut])
        kept = [m for i, m in enumerate(messages) if i not in dropped]
        prompt = render_messages(backend, kept, template=template, **extra)
        return prompt, kept, len(backend.encode(prompt)) <= budget

    prompt, kept, fits = attempt(0)
    if fits or not droppable:
        return prompt, kept
    low, high = 1, len(droppable)  # the fewest dropped turns that fit lies in [low, high]
    best = attempt(high)
    if not best[2]:
        return best[0], best[1]
    while low < high:
        mid = (low + high) // 2
        trial = attempt(mid)
        if trial[2]:
            high, best = mid, trial
        else:
            low = mid + 1
    return best[0], best[1]
