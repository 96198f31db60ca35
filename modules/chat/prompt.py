"""Build chat prompts: instruct, chat and chat-instruct modes, truncated to fit the context.

- ``instruct``: the history rendered with the instruction template (the model's own unless one is named).
- ``chat``: a transcript ``Name: message`` under the character's context; the model continues as the character.
- ``chat-instruct``: the chat transcript wrapped in a command, sent as one user turn through the instruction
  template; the reply starts with the character's name.

When the history does not fit, the oldest turns are dropped first; system messages, the character context and
the newest message always stay.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from modules import extensions
from modules.chat.characters import DEFAULT_CHARACTER, Character, load_character
from modules.chat.templates import load_instruction_template, render
from modules.errors import InvalidRequest
from modules.generation.pipeline import surely_too_long
from modules.loaders.base import Backend

MODES = ("instruct", "chat", "chat-instruct")
DEFAULT_CHAT_INSTRUCT_COMMAND = (
    'Continue the chat dialogue below. Write a single reply for the character "<|character|>".\n\n<|prompt|>'
)
Message = dict[str, Any]


@dataclass
class ChatOptions:
    """How to turn a history into a prompt."""

    mode: str = "instruct"
    character: str | None = None  # a file in user_data/characters (chat modes; default: Assistant)
    user_name: str = "You"
    user_bio: str = ""  # the user persona, added to the context in chat modes
    system: str | None = None  # system message (instruct mode)
    instruction_template: str | None = None  # a name in user_data/instruction-templates; None: the model's
    chat_instruct_command: str = DEFAULT_CHAT_INSTRUCT_COMMAND
    continue_last: bool = False  # extend the last assistant message instead of starting a new one
    start_with: str = ""  # text the new reply starts with
    template_kwargs: dict[str, Any] = field(default_factory=dict)  # e.g. tools


@dataclass
class ChatPrompt:
    """A rendered prompt and what generation needs to know about it."""

    prompt: str
    stop: list[str]  # stop strings the mode needs (the user's name in chat modes)
    reply_prefix: str  # text already at the end of the prompt that belongs to the reply (start_with, continue)
    kept: int  # how many history messages fit
    character: Character | None = None
    images: list[str] = field(default_factory=list)  # pictures of the kept messages, in order


def model_template(backend: Backend) -> str | None:
    """The template to use for this model: a per-model override, else the model's own (None: fallback)."""
    override = backend.metadata.extra.get("chat_template")
    return str(override) if override else backend.metadata.chat_template


def instruction_template(backend: Backend, name: str | None) -> str | None:
    """A named user template, the per-model ``instruction_template`` setting, or the model's own."""
    name = name or backend.metadata.extra.get("instruction_template")
    return load_instruction_template(str(name)) if name else model_template(backend)


def render_messages(
    backend: Backend,
    messages: list[Message],
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


def _with_image_parts(message: Message) -> Message:
    """A message with pictures as the content parts chat templates of vision models expect."""
    images = message.get("images")
    if not images or not isinstance(message.get("content"), str):
        return message
    parts = [{"type": "image"} for _ in images] + [{"type": "text", "text": message["content"]}]
    return {**message, "content": parts}


def _continue(backend: Backend, template: str | None, messages: list[Message], **extra: Any) -> str:
    """Render so that the last (assistant) message stays open for the model to continue."""
    text = render_messages(backend, messages, template=template, add_generation_prompt=False, **extra)
    last = str(messages[-1]["content"])
    cut = text.rfind(last) if last else -1
    return text[: cut + len(last)] if cut >= 0 else text


def _substitute(text: str, character: Character, user: str) -> str:
    return text.replace("{{char}}", character.name).replace("{{user}}", user)


def _transcript(history: list[Message], character: Character, user: str, open_reply: bool) -> str:
    lines = []
    for i, message in enumerate(history):
        if message["role"] == "system":  # context, said by nobody (not a "You:" turn)
            lines.append(f"{message['content']}\n")
            continue
        name = character.name if message["role"] == "assistant" else user
        is_open = open_reply and i == len(history) - 1 and message["role"] == "assistant"
        lines.append(f"{name}: {message['content']}" + ("" if is_open else "\n"))
    return "".join(lines)


def _system(backend: Backend, options: ChatOptions, history: list[Message]) -> list[Message]:
    """The system message an instruct prompt starts with: the chat's own, else (when the history has none either)
    the model's default ``system_message`` from its per-model settings, else none (the template's own default)."""
    if options.system:
        return [{"role": "system", "content": options.system}]
    default = backend.metadata.extra.get("system_message")
    if default and not any(m.get("role") == "system" for m in history):
        return [{"role": "system", "content": str(default)}]
    return []


def _builder(
    backend: Backend, options: ChatOptions
) -> tuple[Callable[[list[Message]], str], list[str], Character | None]:
    """A function rendering a (possibly shortened) history, the stop strings, and the character."""
    if options.mode not in MODES:
        raise InvalidRequest(f"mode must be one of {', '.join(MODES)}", param="mode")
    extra = options.template_kwargs
    if options.mode == "instruct":
        template = instruction_template(backend, options.instruction_template)

        def build_instruct(history: list[Message]) -> str:
            system = _system(backend, options, history)
            messages = system + [_with_image_parts(m) for m in history]
            if options.continue_last and history and history[-1]["role"] == "assistant":
                return _continue(backend, template, messages, **extra)
            return render_messages(backend, messages, template=template, **extra) + options.start_with

        return build_instruct, [], None

    character = load_character(options.character or DEFAULT_CHARACTER)
    user = options.user_name or "You"
    context = _substitute(character.context.strip(), character, user)
    if options.user_bio.strip():
        context += "\n" + _substitute(options.user_bio.strip(), character, user)
    stops = [f"\n{user}:"]
    open_reply = options.continue_last

    if options.mode == "chat":

        def build_chat(history: list[Message]) -> str:
            body = _transcript(history, character, user, open_reply)
            tail = "" if open_reply and history and history[-1]["role"] == "assistant" else f"{character.name}:"
            prefix = " " + options.start_with if options.start_with and tail else options.start_with
            return (context + "\n\n" if context else "") + body + tail + prefix

        return build_chat, stops, character

    template = instruction_template(backend, options.instruction_template)

    def build_chat_instruct(history: list[Message]) -> str:
        transcript = _transcript(history, character, user, False)
        # The command's placeholders are filled before the transcript goes in: what people wrote stays as written.
        command = _substitute(options.chat_instruct_command.replace("<|character|>", character.name), character, user)
        command = command.replace("<|prompt|>", (context + "\n\n" if context else "") + transcript)
        messages: list[Message] = [{"role": "user", "content": command}]
        prompt = render_messages(backend, messages, template=template, **extra)
        return prompt + f"{character.name}:" + (" " + options.start_with if options.start_with else "")

    return build_chat_instruct, stops, character


def token_count(backend: Backend, prompt: str) -> int:
    """Tokens in ``prompt``: an extension's ``custom_tokenized_length`` when one answers, else the model's."""
    custom = extensions.first_result("custom_tokenized_length", prompt=prompt)
    return int(custom) if isinstance(custom, int) else len(backend.encode(prompt))


def fit_history(
    backend: Backend, build: Callable[[list[Message]], str], history: list[Message], max_new_tokens: int
) -> tuple[str, list[Message]]:
    """Render with as many of the newest messages as fit, leaving room for the reply.

    Returns the prompt and the messages it keeps. If even the newest message does not fit, the
    prompt is returned as is and the pipeline reports the overflow.
    """
    budget = backend.context_length - max(1, min(max_new_tokens, backend.context_length // 2))
    keep_always = {i for i, m in enumerate(history) if m.get("role") == "system"}
    droppable = [i for i in range(len(history) - 1) if i not in keep_always]

    def attempt(cut: int) -> tuple[str, list[Message], bool]:
        dropped = set(droppable[:cut])
        kept = [m for i, m in enumerate(history) if i not in dropped]
        prompt = build(kept)
        if surely_too_long(backend, prompt, budget) and not extensions.implementers("custom_tokenized_length"):
            return prompt, kept, False  # megabytes of text: known not to fit without tokenizing them
        return prompt, kept, token_count(backend, prompt) <= budget

    first = attempt(0)
    if first[2] or not droppable:
        return first[0], first[1]
    best = attempt(len(droppable))
    if not best[2]:
        return best[0], best[1]
    low, high = 1, len(droppable)  # the fewest dropped turns that fit lies in [low, high]
    while low < high:
        mid = (low + high) // 2
        trial = attempt(mid)
        if trial[2]:
            high, best = mid, trial
        else:
            low = mid + 1
    return best[0], best[1]


def _history_hook(history: list[Message], state: dict[str, Any]) -> list[Message]:
    """Run ``history_modifier``: extensions get text-generation-webui's pair view and our messages."""
    pairs: list[list[str]] = []
    for message in history:
        if message["role"] == "user":
            pairs.append([str(message["content"]), ""])
        elif message["role"] == "assistant":
            if not pairs or pairs[-1][1]:
                pairs.append(["", ""])
            pairs[-1][1] = str(message["content"])
    view = {
        "internal": [list(p) for p in pairs],
        "visible": [list(p) for p in pairs],
        "messages": [dict(m) for m in history],
    }
    result = extensions.apply_modifier("history_modifier", view)
    if not isinstance(result, dict):
        return history
    if result.get("messages") != view["messages"] and isinstance(result.get("messages"), list):
        return list(result["messages"])
    if result.get("internal") != pairs and isinstance(result.get("internal"), list):
        rebuilt: list[Message] = [m for m in history if m["role"] == "system"]
        for user, bot in result["internal"]:
            if user:
                rebuilt.append({"role": "user", "content": user})
            if bot:
                rebuilt.append({"role": "assistant", "content": bot})
        return rebuilt
    return history


def build_chat_prompt(
    backend: Backend,
    history: list[Message],
    options: ChatOptions,
    max_new_tokens: int,
    state: dict[str, Any] | None = None,
) -> ChatPrompt:
    """The prompt for the next reply to ``history`` in the chosen mode, truncated to fit the context.

    Extension hooks, in order: ``input_modifier`` (the newest user message), ``history_modifier``,
    ``custom_generate_chat_prompt`` (replaces the template), ``bot_prefix_modifier`` (text after the reply's
    prefix; it steers the reply without being part of it).
    """
    state = state if state is not None else {}
    history = list(history)
    last_text = bool(history) and history[-1]["role"] == "user" and isinstance(history[-1]["content"], str)
    if last_text and extensions.implementers("input_modifier"):
        text = extensions.apply_modifier("input_modifier", str(history[-1]["content"]), state=state, is_chat=True)
        history[-1] = {**history[-1], "content": text}
    if extensions.implementers("history_modifier"):
        history = _history_hook(history, state)
    build, stops, character = _builder(backend, options)
    continuing = options.continue_last and bool(history) and history[-1]["role"] == "assistant"
    prefix = str(history[-1]["content"]) if continuing else options.start_with
    user_input = next((str(m["content"]) for m in reversed(history) if m["role"] == "user"), "")
    custom = extensions.first_result(
        "custom_generate_chat_prompt", user_input=user_input, state=state, history=history, _continue=continuing
    )
    if isinstance(custom, str):
        return ChatPrompt(prompt=custom, stop=stops, reply_prefix=prefix, kept=len(history), character=character)
    prompt, kept_messages = fit_history(backend, build, history, max_new_tokens)
    kept = len(kept_messages)
    images = [path for m in kept_messages if m["role"] == "user" for path in m.get("images") or []]
    if images and options.mode != "instruct":
        raise InvalidRequest("pictures in messages need the instruct mode", param="messages")
    if extensions.implementers("bot_prefix_modifier") and not continuing:
        base = f"{character.name}:" if character is not None else ""
        modified = str(extensions.apply_modifier("bot_prefix_modifier", base, state=state))
        if modified != base:
            prompt += modified[len(base) :] if modified.startswith(base) else modified
    return ChatPrompt(prompt=prompt, stop=stops, reply_prefix=prefix, kept=kept, character=character, images=images)


_MARKER = "\u2063IMPERSONATE\u2063"


def build_impersonate_prompt(
    backend: Backend, history: list[Message], options: ChatOptions, max_new_tokens: int
) -> tuple[str, list[str]]:
    """A prompt where the model writes the user's next message, and the stop strings that end it."""
    if options.mode == "instruct":
        template = instruction_template(backend, options.instruction_template)

        def build_instruct(kept: list[Message]) -> str:
            text = render_messages(
                backend,
                [*_system(backend, options, kept), *kept, {"role": "user", "content": _MARKER}],
                template=template,
                add_generation_prompt=False,
            )
            return text[: text.index(_MARKER)] if _MARKER in text else text

        prompt, _ = fit_history(backend, build_instruct, history, max_new_tokens)
        return prompt, []
    character = load_character(options.character or DEFAULT_CHARACTER)
    user = options.user_name or "You"
    context = _substitute(character.context.strip(), character, user)

    def build_chat(kept: list[Message]) -> str:
        return (context + "\n\n" if context else "") + _transcript(kept, character, user, False) + f"{user}:"

    prompt, _ = fit_history(backend, build_chat, history, max_new_tokens)
    return prompt, [f"\n{character.name}:", f"\n{user}:"]
