"""One chat turn: history + user message -> prompt -> streamed reply, as a growing history."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from modules.chat.prompt import fit_messages
from modules.generation.params import GenerationParams
from modules.generation.pipeline import GenerationStats, current_model, generate_reply

Message = dict[str, Any]


@dataclass
class ChatUpdate:
    """The history as it stands now; ``stats`` is set once the reply is complete."""

    history: list[Message]
    stats: GenerationStats | None = None


def stream_reply(
    history: list[Message],
    params: GenerationParams,
    *,
    system: str | None = None,
    cancel: threading.Event | None = None,
    key: str | None = None,
) -> Iterator[ChatUpdate]:
    """Generate the assistant's reply to ``history`` (which ends with the user's message)."""
    backend = current_model()
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": m["role"], "content": m["content"]} for m in history
    ]
    prompt, _ = fit_messages(backend, messages, params.max_new_tokens)
    reply = ""
    for delta in generate_reply(prompt, params, cancel=cancel, key=key, backend=backend):
        reply += delta.text
        yield ChatUpdate(history + [{"role": "assistant", "content": reply}], delta.stats)


def send(history: list[Message], text: str, params: GenerationParams, **kwargs: Any) -> Iterator[ChatUpdate]:
    """Add the user's message and stream the reply."""
    history = history + [{"role": "user", "content": text}]
    yield ChatUpdate(history)
    yield from stream_reply(history, params, **kwargs)


def regenerate(history: list[Message], params: GenerationParams, **kwargs: Any) -> Iterator[ChatUpdate]:
    """Replace the last assistant reply with a new one."""
    while history and history[-1]["role"] == "assistant":
        history = history[:-1]
    if not history:
        return
    yield ChatUpdate(history)
    yield from stream_reply(history, params, **kwargs)
