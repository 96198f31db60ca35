"""Chat actions: send, regenerate (versions kept), continue, impersonate, edit, remove, send as the assistant.

Messages are dicts with ``role`` and ``content`` (what the model sees); ``visible`` holds what the UI shows when
an extension made it differ (``chat_input_modifier``, ``output_modifier``); a regenerated reply keeps its older
texts in ``versions`` with the index of the one shown in ``version``.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

from modules import extensions
from modules.chat.history import images_dir
from modules.chat.prompt import ChatOptions, build_chat_prompt, build_impersonate_prompt
from modules.errors import InvalidRequest
from modules.generation.params import GenerationParams
from modules.generation.pipeline import (
    GenerationStats,
    apply_state_modifier,
    current_model,
    generate_reply,
    make_state,
)
from modules.images import load_image

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


def options_from_state(state: dict[str, Any], options: ChatOptions) -> ChatOptions:
    """The chat settings as a ``state_modifier`` left them (the keys of :func:`chat_state`)."""
    return replace(
        options,
        mode=state.get("mode") or options.mode,
        character=state.get("character", options.character),
        user_name=state.get("name1") or options.user_name,
        user_bio=state.get("user_bio", options.user_bio),
        system=state.get("system_message") or options.system,
        instruction_template=state.get("instruction_template", options.instruction_template),
    )


def stream_reply(
    history: list[Message],
    params: GenerationParams,
    *,
    options: ChatOptions | None = None,
    system: str | None = None,
    cancel: threading.Event | None = None,
    key: str | None = None,
    previous: Message | None = None,
) -> Iterator[ChatUpdate]:
    """Generate the assistant's reply to ``history`` (or continue its last assistant message).

    ``previous`` is the reply being regenerated: its texts are kept as older versions of the new one.
    """
    backend = current_model()
    options = options or ChatOptions(system=system)
    state = chat_state(params, options)
    params = apply_state_modifier(state, params)  # first, so that changed chat settings shape the prompt
    options = options_from_state(state, options)
    chat = build_chat_prompt(backend, history, options, params.max_new_tokens, state)
    if chat.character is not None:
        state["name2"] = chat.character.name
    continuing = options.continue_last and bool(history) and history[-1]["role"] == "assistant"
    base = history[:-1] if continuing else history
    older = list(previous.get("versions") or [previous["content"]]) if previous else []
    params = params.replace(stop=[*params.stop, *chat.stop])
    reply = chat.reply_prefix
    tokens: list[tuple[str, float | None]] = []
    state["user_input"] = next((str(m["content"]) for m in reversed(history) if m["role"] == "user"), "")
    images = [load_image(path, "messages", files_in=images_dir()) for path in chat.images] or None
    for delta in generate_reply(
        chat.prompt,
        params,
        cancel=cancel,
        key=key,
        backend=backend,
        state=state,
        state_modified=True,
        is_chat=True,
        images=images,
    ):
        reply += delta.text
        tokens += [
            (t.piece.decode("utf-8", errors="replace"), t.logprob) for t in delta.tokens if t.logprob is not None
        ]
        text = reply if continuing else reply.lstrip()
        message: Message = {"role": "assistant", "content": text}
        if older:
            message["versions"] = [*older, text]
            message["version"] = len(older)
        elif continuing and history[-1].get("versions"):
            versions = list(history[-1]["versions"])
            versions[history[-1].get("version", len(versions) - 1)] = text
            message["versions"], message["version"] = versions, history[-1].get("version", len(versions) - 1)
        if delta.stats is not None:
            state["reply_tokens"] = tokens
            visible = extensions.apply_modifier("output_modifier", text, state=state, is_chat=True)
            if visible != text:
                message["visible"] = visible
        yield ChatUpdate([*base, message], delta.stats)


def send(
    history: list[Message],
    text: str,
    params: GenerationParams,
    *,
    options: ChatOptions | None = None,
    images: list[str] | None = None,
    **kwargs: Any,
) -> Iterator[ChatUpdate]:
    """Add the user's message (through ``chat_input_modifier``) with its pictures, and stream the reply."""
    options = options or ChatOptions(system=kwargs.pop("system", None))
    internal, visible = extensions.apply_chat_input(text, text, chat_state(params, options))
    message: Message = {"role": "user", "content": internal}
    if images:
        message["images"] = list(images)
    if visible != internal:
        message["visible"] = visible
    history = [*history, message]
    yield ChatUpdate(history)
    yield from stream_reply(history, params, options=options, **kwargs)


def regenerate(history: list[Message], params: GenerationParams, **kwargs: Any) -> Iterator[ChatUpdate]:
    """Replace the last reply with a new one; the older replies stay browsable as versions."""
    if not history or history[-1]["role"] != "assistant" or len(history) < 2:
        raise InvalidRequest("there is no reply to regenerate")
    previous = history[-1]
    yield ChatUpdate(history[:-1])
    try:
        yield from stream_reply(history[:-1], params, previous=previous, **kwargs)
    except Exception:
        yield ChatUpdate(history)  # the generation failed: the old reply (and its versions) comes back
        raise


def continue_reply(history: list[Message], params: GenerationParams, **kwargs: Any) -> Iterator[ChatUpdate]:
    """Extend the last assistant message."""
    if not history or history[-1]["role"] != "assistant":
        raise InvalidRequest("there is no reply to continue")
    options = kwargs.pop("options", None) or ChatOptions(system=kwargs.pop("system", None))
    yield from stream_reply(history, params, options=replace(options, continue_last=True), **kwargs)


def impersonate(
    history: list[Message],
    params: GenerationParams,
    *,
    options: ChatOptions | None = None,
    cancel: threading.Event | None = None,
    key: str | None = None,
) -> Iterator[str]:
    """Write the user's next message (the growing draft); the history is not changed."""
    backend = current_model()
    options = options or ChatOptions()
    prompt, stops = build_impersonate_prompt(backend, history, options, params.max_new_tokens)
    draft = ""
    for delta in generate_reply(
        prompt, params.replace(stop=[*params.stop, *stops]), cancel=cancel, key=key, backend=backend
    ):
        draft += delta.text
        yield draft.lstrip()


def set_version(history: list[Message], index: int, step: int) -> list[Message]:
    """Show the previous (``step`` -1) or next (+1) version of message ``index``."""
    if not 0 <= index < len(history):
        raise InvalidRequest(f"message {index} does not exist")
    message = dict(history[index])
    versions = message.get("versions") or []
    if len(versions) < 2:
        return history
    current = (message.get("version", len(versions) - 1) + step) % len(versions)
    message["version"], message["content"] = current, versions[current]
    message.pop("visible", None)
    return [*history[:index], message, *history[index + 1 :]]


def edit_message(history: list[Message], index: int, text: str) -> list[Message]:
    """Replace the text of message ``index`` (and of its shown version)."""
    if not 0 <= index < len(history):
        raise InvalidRequest(f"message {index} does not exist")
    message = {**history[index], "content": text}
    message.pop("visible", None)
    if message.get("versions"):
        versions = list(message["versions"])
        versions[message.get("version", len(versions) - 1)] = text
        message["versions"] = versions
    return [*history[:index], message, *history[index + 1 :]]


def remove_last(history: list[Message]) -> tuple[list[Message], str]:
    """Remove the last exchange (the last user message and what follows it); returns the user's text."""
    for i in range(len(history) - 1, -1, -1):
        if history[i]["role"] == "user":
            return history[:i], str(history[i]["content"])
    return [m for m in history if m["role"] == "system"], ""


def send_as_assistant(history: list[Message], text: str) -> list[Message]:
    """Add a message written by the user as the assistant's reply."""
    if not text.strip():
        raise InvalidRequest("the message is empty")
    return [*history, {"role": "assistant", "content": text}]
