"""One chat turn: history + user message -> prompt -> streamed reply, as a growing history.

Messages are dicts with ``role`` and ``content`` (what the model sees); ``visible`` holds what the UI shows when
an extension made it differ (``chat_input_modifier``, ``output_modifier``).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

from modules import extensions
from modules.chat.prompt import ChatOptions, build_chat_prompt
from modules.generation.params import GenerationParams
from modules.generation.pipeline import GenerationStats, current_model, generate_reply, make_state

Message = dict[str, Any]


@dataclass
class ChatUpdate:
    """The history as it stands now; ``stats`` is set once the reply is complete."""

    history: list[Message]
    stats: GenerationStats | None = None


def chat_state(params: GenerationParams, options: ChatOptions) -> dict[str, Any]:
    """The ``state`` extension hooks see during a chat turn."""
    return make_state(
        params,
        mode=options.mode,
        character=options.character,
        name1=options.user_name,
        user_bio=options.user_bio,
        system_message=options.system or "",
        instruction_template=options.instruction_template,
    )


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
    state = chat_state(params, options)
    chat = build_chat_prompt(backend, history, options, params.max_new_tokens, state)
    if chat.character is not None:
        state["name2"] = chat.character.name
    continuing = options.continue_last and bool(history) and history[-1]["role"] == "assistant"
    base = history[:-1] if continuing else history
    params = params.replace(stop=[*params.stop, *chat.stop])
    reply = chat.reply_prefix
    tokens: list[tuple[str, float | None]] = []
    state["user_input"] = next((str(m["content"]) for m in reversed(history) if m["role"] == "user"), "")
    for delta in generate_reply(
        chat.prompt, params, cancel=cancel, key=key, backend=backend, state=state, is_chat=True
    ):
        reply += delta.text
        tokens += [
            (t.piece.decode("utf-8", errors="replace"), t.logprob) for t in delta.tokens if t.logprob is not None
        ]
        text = reply if continuing else reply.lstrip()
        message: Message = {"role": "assistant", "content": text}
        if delta.stats is not None:
            state["reply_tokens"] = tokens
            visible = extensions.apply_modifier("output_modifier", text, state=state, is_chat=True)
            if visible != text:
                message["visible"] = visible
        yield ChatUpdate([*base, message], delta.stats)


def send(
    history: list[Message], text: str, params: GenerationParams, *, options: ChatOptions | None = None, **kwargs: Any
) -> Iterator[ChatUpdate]:
    """Add the user's message (through ``chat_input_modifier``) and stream the reply."""
    options = options or ChatOptions(system=kwargs.pop("system", None))
    internal, visible = extensions.apply_chat_input(text, text, chat_state(params, options))
    message: Message = {"role": "user", "content": internal}
    if visible != internal:
        message["visible"] = visible
    history = [*history, message]
    yield ChatUpdate(history)
    yield from stream_reply(history, params, options=options, **kwargs)


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
