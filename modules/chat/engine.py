"""One chat turn: history + user message -> prompt -> streamed reply, as a growing history."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

from modules.chat.prompt import ChatOptions, build_chat_prompt
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
    options: ChatOptions | None = None,
    system: str | None = None,
    cancel: threading.Event | None = None,
    key: str | None = None,
) -> Iterator[ChatUpdate]:
    """Generate the assistant's reply to ``history`` (or continue its last assistant message)."""
    backend = current_model()
    options = options or ChatOptions(system=system)
    chat = build_chat_prompt(backend, history, options, params.max_new_tokens)
    continuing = options.continue_last and bool(history) and history[-1]["role"] == "assistant"
    base = history[:-1] if continuing else history
    params = params.replace(stop=[*params.stop, *chat.stop])
    reply = chat.reply_prefix
    for delta in generate_reply(chat.prompt, params, cancel=cancel, key=key, backend=backend):
        reply += delta.text
        yield ChatUpdate(
            [*base, {"role": "assistant", "content": reply.lstrip() if not continuing else reply}], delta.stats
        )


def send(history: list[Message], text: str, params: GenerationParams, **kwargs: Any) -> Iterator[ChatUpdate]:
    """Add the user's message and stream the reply."""
    history = [*history, {"role": "user", "content": text}]
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


def continue_reply(history: list[Message], params: GenerationParams, **kwargs: Any) -> Iterator[ChatUpdate]:
    """Extend the last assistant message."""
    options = kwargs.pop("options", None) or ChatOptions(system=kwargs.pop("system", None))
    yield from stream_reply(history, params, options=replace(options, continue_last=True), **kwargs)
