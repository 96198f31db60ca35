"""Chat tab: the conversation, the input, and the actions (send, stop, regenerate, versions, continue, impersonate,
remove, edit, send as the assistant). Histories and characters are in ui/chat_sidebar.py."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gradio as gr

from modules import shared
from modules.chat import engine
from modules.chat import history as store
from modules.chat.characters import DEFAULT_CHARACTER, list_characters
from modules.chat.prompt import DEFAULT_CHAT_INSTRUCT_COMMAND, MODES, ChatOptions
from modules.chat.templates import list_instruction_templates
from modules.errors import TextgenError
from modules.generation.pipeline import GenerationStats
from modules.ui.parameters_tab import ParamsUI

log = logging.getLogger(__name__)
# A short system message works better with small models than their own long default one; editable in the UI.
DEFAULT_SYSTEM_MESSAGE = "You are a helpful AI assistant."
MODEL_TEMPLATE = "(the model's own)"
LATEX = [{"left": "$$", "right": "$$", "display": True}, {"left": "$", "right": "$", "display": False}]


@dataclass
class ChatUI:
    """The chat tab's components."""

    chatbot: Any
    conv: Any  # gr.State: {"conv": Conversation JSON, "incognito": bool, "greeting": the new chat's greeting}
    textbox: Any
    pending: Any
    image: Any
    pending_image: Any
    send: Any
    stop: Any
    regenerate: Any
    cont: Any
    impersonate: Any
    remove: Any
    prev_version: Any
    next_version: Any
    as_assistant: Any
    start_with: Any
    status: Any
    context: Any
    show_all: Any
    settings: list[Any]  # mode, character, user name, persona, system, template, command


DEFAULT_UPDATES_PER_SECOND = 5


def update_interval() -> float:
    """Seconds between two streamed updates of the page (``max_updates_second`` in settings.yaml; 0: every token).

    Rendering a chat costs the browser and Gradio more than generating a token, and where the browser shares the
    machine's cores with the model every repaint is time the model does not get: on 2 cores (AMD EPYC) a 512-token
    reply was written at 11 tokens/s with 20 updates a second, 33 with 5, against 51 through the API (``bench.ui_bench``).
    """
    rate = float(shared.ui_defaults.get("max_updates_second", DEFAULT_UPDATES_PER_SECOND) or 0)
    return 1.0 / rate if rate > 0 else 0.0


def user_of(request: gr.Request | None) -> tuple[str, bool]:
    """(history owner, forced incognito): each signed-in user has their own histories with --multi-user."""
    if not shared.settings.multi_user:
        return store.DEFAULT_USER, False
    name = getattr(request, "username", None) if request is not None else None
    if name:
        # a login called "default" must not see the single-user histories: its name gets a hashed folder
        return (f"{name}@" if str(name).lower() == store.DEFAULT_USER else str(name)), False
    return "anonymous", True  # without sign-in there is no owner to keep histories for


WINDOW = 30  # long chats show their newest messages; "Show every message" lifts the limit


def _shown_indexes(messages: list[dict[str, Any]], show_all: bool) -> list[int]:
    indexes = [i for i, m in enumerate(messages) if m["role"] in ("user", "assistant")]
    return indexes if show_all else indexes[-WINDOW:]


def display(messages: list[dict[str, Any]], show_all: bool = False) -> list[dict[str, Any]]:
    """What the chat shows: each message's visible text, the version counter on regenerated replies.

    A long chat shows its newest ``WINDOW`` messages unless ``show_all``: streaming into a chat of hundreds of
    rendered messages would make every token slow to appear.
    """
    shown = []
    for i in _shown_indexes(messages, show_all):
        m = messages[i]
        text = m.get("visible", m["content"])
        pictures = "".join(f"![picture](/gradio_api/file={path})\n\n" for path in m.get("images") or [])
        text = pictures + str(text)
        versions = m.get("versions")
        if versions and len(versions) > 1:
            text = f"{text}\n\n<sub>version {m.get('version', len(versions) - 1) + 1}/{len(versions)}</sub>"
        shown.append({"role": m["role"], "content": text})
    return shown


def display_index(messages: list[dict[str, Any]], shown_index: int, show_all: bool = False) -> int:
    """The history index of the ``shown_index``-th displayed message."""
    return _shown_indexes(messages, show_all)[shown_index]


def options_of(
    mode: str, character: str, user_name: str, bio: str, system: str, template: str, command: str, start_with: str = ""
) -> ChatOptions:
    """ChatOptions from the chat settings' values."""
    return ChatOptions(
        mode=mode,
        character=character or DEFAULT_CHARACTER,
        user_name=user_name or "You",
        user_bio=bio or "",
        system=system or None,
        instruction_template=None if not template or template == MODEL_TEMPLATE else template,
        chat_instruct_command=command or DEFAULT_CHAT_INSTRUCT_COMMAND,
        start_with=start_with or "",
    )


def new_state(request: gr.Request | None, character: str, mode: str, greeting: str = "") -> dict[str, Any]:
    """A fresh conversation for this user."""
    user, forced = user_of(request)
    conv = store.new_conversation(character or DEFAULT_CHARACTER, user=user, mode=mode, greeting=greeting)
    return {"conv": conv.to_json(), "incognito": forced, "greeting": greeting}


def conversation(state: dict[str, Any], request: gr.Request | None) -> store.Conversation:
    """The Conversation behind a state (for this user)."""
    user, _ = user_of(request)
    data = state.get("conv") or {}
    return store.from_json(data, user=user, character=str(data.get("character") or DEFAULT_CHARACTER))


def persist(state: dict[str, Any], messages: list[dict[str, Any]], request: gr.Request | None) -> dict[str, Any]:
    """Store the messages in the state and, unless the chat is incognito, on disk."""
    conv = conversation(state, request)
    conv.messages = messages
    if not state.get("incognito"):
        store.save_if_started(conv, str(state.get("greeting") or ""))
    return {**state, "conv": conv.to_json()}


def usage_text(stats: GenerationStats) -> str:
    """'Context: used / size tokens' after a reply: its prompt (the history as the model saw it) and the reply."""
    backend = shared.model
    if backend is None:
        return "Context: no model loaded"
    used, size = stats.prompt_tokens + stats.new_tokens, backend.context_length
    return f"Context: {used} / {size} tokens ({100 * used // max(size, 1)}%)"


def build() -> ChatUI:
    """Create the chat's components (the events are wired once the parameters exist)."""
    conv = gr.State({})
    chatbot = gr.Chatbot(
        label="Chat",
        elem_id="chatbot",
        height=560,
        buttons=["copy", "copy_all"],
        editable="all",
        latex_delimiters=LATEX,
        placeholder="Say something.",
        feedback_options=None,
    )
    with gr.Row():
        image = gr.Image(
            type="filepath",
            label="Picture (vision models)",
            elem_id="chat-image",
            height=90,
            scale=1,
            sources=["upload", "clipboard"],
        )
        textbox = gr.Textbox(
            show_label=False, placeholder="Send a message", elem_id="chat-input", scale=7, lines=1, max_lines=10
        )  # one line: Enter sends, Shift+Enter adds a line (Gradio submits on Shift+Enter when lines > 1)
        send = gr.Button("Send", variant="primary", elem_id="send", scale=1)
        stop = gr.Button("Stop", variant="stop", elem_id="stop", scale=1)
    with gr.Row():
        regenerate = gr.Button("Regenerate", elem_id="regenerate", size="sm")
        prev_version = gr.Button("◀ version", elem_id="prev-version", size="sm")
        next_version = gr.Button("version ▶", elem_id="next-version", size="sm")
        cont = gr.Button("Continue", elem_id="continue", size="sm")
        impersonate = gr.Button("Impersonate", elem_id="impersonate", size="sm")
        remove = gr.Button("Remove last", elem_id="remove-last", size="sm")
        as_assistant = gr.Button("Send as assistant", elem_id="send-as-assistant", size="sm")
    with gr.Row():
        start_with = gr.Textbox(label="Start reply with", elem_id="start-with", scale=3)
        context = gr.Markdown(elem_id="context-usage")
    status = gr.Markdown("", elem_id="chat-status")
    show_all = gr.Checkbox(False, label=f"Show every message (long chats show the newest {WINDOW})", elem_id="show-all")
    with gr.Accordion("Chat settings", open=False, elem_id="chat-settings"):
        with gr.Row():
            mode = gr.Radio(
                list(MODES), value=str(shared.ui_defaults.get("mode", "instruct")), label="Mode", elem_id="chat-mode"
            )
            characters = list_characters()
            character = gr.Dropdown(
                characters,
                value=DEFAULT_CHARACTER if DEFAULT_CHARACTER in characters else None,
                label="Character",
                elem_id="character-dropdown",
                allow_custom_value=False,
            )
        system = gr.Textbox(
            value=str(shared.ui_defaults.get("system_message", DEFAULT_SYSTEM_MESSAGE)),
            label="System message (instruct mode; empty: the model's default system message, see the Model tab)",
            lines=2,
            elem_id="system-message",
        )
        with gr.Row():
            user_name = gr.Textbox(
                value=str(shared.ui_defaults.get("user_name", "You")), label="Your name", elem_id="user-name"
            )
            bio = gr.Textbox(
                value=str(shared.ui_defaults.get("user_bio", "")),
                label="Your persona (chat modes)",
                lines=2,
                elem_id="user-bio",
            )
        template = gr.Dropdown(
            [MODEL_TEMPLATE, *list_instruction_templates()], value=MODEL_TEMPLATE, label="Instruction template"
        )
        command = gr.Textbox(
            value=DEFAULT_CHAT_INSTRUCT_COMMAND, label="Chat-instruct command (<|character|>, <|prompt|>)", lines=2
        )
    return ChatUI(
        chatbot=chatbot, conv=conv, textbox=textbox, pending=gr.State(""), image=image, pending_image=gr.State(None), send=send, stop=stop, regenerate=regenerate,
        cont=cont, impersonate=impersonate, remove=remove, prev_version=prev_version, next_version=next_version,
        as_assistant=as_assistant, start_with=start_with, status=status, context=context, show_all=show_all,
        settings=[mode, character, user_name, bio, system, template, command],
    )  # fmt: skip


def wire(ui: ChatUI, params: ParamsUI) -> None:
    """Connect the chat's events; generation reads the Parameters tab."""
    n_settings = len(ui.settings)
    outputs = [ui.chatbot, ui.conv, ui.status, ui.context]

    def split(values: tuple[Any, ...]) -> tuple[list[Any], ChatOptions, Any]:
        settings = list(values[:n_settings])
        mode, character, user_name, bio, system, template, command = settings
        options = options_of(mode, character, user_name, bio, system, template, command, start_with=values[n_settings])
        return settings, options, params.to_params(*values[n_settings + 1 :])

    def run(
        updates: Iterator[engine.ChatUpdate], state: dict[str, Any], request: gr.Request
    ) -> Iterator[tuple[Any, ...]]:
        messages = list(state.get("conv", {}).get("messages", []))
        before = len(messages)
        shown_at = 0.0
        try:
            for update in updates:
                messages = update.history
                if update.stats is None:
                    if len(messages) > before and messages[-1]["role"] == "user":
                        before = len(messages)
                        state = persist(state, messages, request)  # the user's message is saved before the reply
                    elif time.monotonic() - shown_at < update_interval():
                        continue  # tokens keep coming; the page gets them with the next update
                    shown_at = time.monotonic()
                    yield display(messages, state.get("show_all", False)), state, "Generating...", gr.skip()
                else:
                    state = persist(state, messages, request)
                    yield (
                        display(messages, state.get("show_all", False)),
                        state,
                        update.stats.summary(),
                        usage_text(update.stats),
                    )
        except TextgenError as exc:
            gr.Warning(str(exc))
            state = persist(state, messages, request)
            yield display(messages, state.get("show_all", False)), state, f"Error: {exc}", gr.skip()
        except Exception as exc:  # an unexpected failure: keep the history, say what happened
            log.exception("chat generation failed")
            gr.Warning(f"Generation failed: {exc}")
            state = persist(state, messages, request)
            yield (
                display(messages, state.get("show_all", False)),
                state,
                f"Error: generation failed ({type(exc).__name__}: {exc})",
                gr.skip(),
            )

    def on_send(
        request: gr.Request, text: str, picture: str | None, state: dict[str, Any], *values: Any
    ) -> Iterator[tuple[Any, ...]]:
        _, options, gen = split(values)
        if not text.strip() and not picture:
            yield gr.skip(), state, "", gr.skip()
            return
        messages = list(state.get("conv", {}).get("messages", []))
        images = [store.store_image(Path(picture))] if picture else None
        updates = engine.send(messages, text, gen, options=options, images=images, key=request.session_hash)
        yield from run(updates, state, request)

    def on_history_action(action: Any) -> Any:
        """A handler running ``action`` (regenerate, continue) on the chat's history."""

        def handler(request: gr.Request, state: dict[str, Any], *values: Any) -> Iterator[tuple[Any, ...]]:
            _, options, gen = split(values)
            messages = list(state.get("conv", {}).get("messages", []))
            updates = action(messages, gen, options=options, key=request.session_hash)
            yield from run(updates, state, request)

        return handler

    on_regenerate = on_history_action(engine.regenerate)
    on_continue = on_history_action(engine.continue_reply)

    def on_impersonate(request: gr.Request, state: dict[str, Any], *values: Any) -> Iterator[str]:
        _, options, gen = split(values)
        messages = list(state.get("conv", {}).get("messages", []))
        try:
            yield from engine.impersonate(messages, gen, options=options, key=request.session_hash)
        except TextgenError as exc:
            gr.Warning(str(exc))

    def busy(request: gr.Request) -> bool:
        """True (and the user is told) while this session's reply streams: its final save would undo a change."""
        if shared.is_generating(request.session_hash or ""):
            gr.Info("A reply is being written: stop it or let it finish before changing the chat.")
            return True
        return False

    def on_version(step: int) -> Any:
        def change(state: dict[str, Any], request: gr.Request) -> tuple[Any, ...]:
            if busy(request):
                return gr.skip(), state
            messages = list(state.get("conv", {}).get("messages", []))
            index = next((i for i in range(len(messages) - 1, -1, -1) if messages[i].get("versions")), None)
            if index is None:
                gr.Info("This reply has no other versions: regenerate it first.")
                return gr.skip(), state
            messages = engine.set_version(messages, index, step)
            state = persist(state, messages, request)
            return display(messages, state.get("show_all", False)), state

        return change

    def on_edit(data: gr.EditData, state: dict[str, Any], request: gr.Request) -> tuple[Any, ...]:
        messages = list(state.get("conv", {}).get("messages", []))
        if busy(request):
            return display(messages, state.get("show_all", False)), state  # the edit is not kept
        shown = data.index if isinstance(data.index, int) else data.index[0]
        value = data.value if isinstance(data.value, str) else str((data.value or {}).get("text", data.value))
        try:
            messages = engine.edit_message(
                messages, display_index(messages, shown, state.get("show_all", False)), value
            )
        except (TextgenError, IndexError) as exc:
            gr.Warning(f"Cannot edit: {exc}")
            return display(messages, state.get("show_all", False)), state
        state = persist(state, messages, request)
        return display(messages, state.get("show_all", False)), state

    def on_remove(state: dict[str, Any], request: gr.Request) -> tuple[Any, ...]:
        if busy(request):
            return gr.skip(), state, gr.skip()
        messages, text = engine.remove_last(list(state.get("conv", {}).get("messages", [])))
        state = persist(state, messages, request)
        return display(messages, state.get("show_all", False)), state, text

    def on_as_assistant(text: str, state: dict[str, Any], request: gr.Request) -> tuple[Any, ...]:
        if busy(request):
            return gr.skip(), state, text
        try:
            messages = engine.send_as_assistant(list(state.get("conv", {}).get("messages", [])), text)
        except TextgenError as exc:
            gr.Warning(str(exc))
            return gr.skip(), state, text
        state = persist(state, messages, request)
        return display(messages, state.get("show_all", False)), state, ""

    def stop(request: gr.Request) -> None:
        shared.stop_generation(request.session_hash)

    gen_inputs = [*ui.settings, ui.start_with, *params.components]
    for trigger in (ui.send.click, ui.textbox.submit):
        trigger(
            lambda text, picture: ("", text, None, picture),
            [ui.textbox, ui.image],
            [ui.textbox, ui.pending, ui.image, ui.pending_image],
            queue=False,
        ).then(
            on_send,
            [ui.pending, ui.pending_image, ui.conv, *gen_inputs],
            outputs,
            concurrency_limit=None,
            show_progress="hidden",
        )
    ui.regenerate.click(on_regenerate, [ui.conv, *gen_inputs], outputs, concurrency_limit=None, show_progress="hidden")
    ui.cont.click(on_continue, [ui.conv, *gen_inputs], outputs, concurrency_limit=None, show_progress="hidden")
    ui.impersonate.click(
        on_impersonate, [ui.conv, *gen_inputs], ui.textbox, concurrency_limit=None, show_progress="hidden"
    )
    ui.prev_version.click(on_version(-1), ui.conv, [ui.chatbot, ui.conv], queue=False)
    ui.next_version.click(on_version(+1), ui.conv, [ui.chatbot, ui.conv], queue=False)
    ui.chatbot.edit(on_edit, ui.conv, [ui.chatbot, ui.conv], queue=False)
    ui.remove.click(on_remove, ui.conv, [ui.chatbot, ui.conv, ui.textbox], queue=False)
    ui.as_assistant.click(on_as_assistant, [ui.textbox, ui.conv], [ui.chatbot, ui.conv, ui.textbox], queue=False)
    ui.stop.click(stop, None, None, queue=False)

    def on_show_all(value: bool, state: dict[str, Any]) -> tuple[Any, ...]:
        state = {**state, "show_all": bool(value)}
        return display(list(state.get("conv", {}).get("messages", [])), state["show_all"]), state

    ui.show_all.change(on_show_all, [ui.show_all, ui.conv], [ui.chatbot, ui.conv], queue=False)
