"""The chat's side panel: past chats (new, open, search, rename, delete, branch, upload/download, incognito)
and characters (edit, delete, import a TavernAI/SillyTavern card)."""

from __future__ import annotations

import contextlib
import json
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gradio as gr

from modules.chat import characters as chars
from modules.chat import history as store
from modules.errors import TextgenError
from modules.ui.admin import admin_control, admin_only
from modules.ui.chat_tab import ChatUI, conversation, display, new_state, persist, user_of


@dataclass
class SidebarUI:
    """The side panel's components."""

    chats: Any
    search: Any
    new: Any
    incognito: Any
    title: Any
    rename: Any
    delete: Any
    branch_index: Any
    branch: Any
    download: Any
    upload: Any
    message: Any
    char_name: Any
    char_context: Any
    char_greeting: Any
    char_picture: Any
    char_save: Any
    char_delete: Any
    card: Any


def build() -> SidebarUI:
    """Create the panel's components."""
    with gr.Accordion("Past chats", open=True, elem_id="past-chats"):
        with gr.Row():
            new = gr.Button("New chat", elem_id="new-chat", size="sm")
            incognito = gr.Checkbox(label="Incognito (not saved)", elem_id="incognito")
        search = gr.Textbox(label="Search", placeholder="words in titles or messages", elem_id="chat-search")
        chats = gr.Dropdown([], label="Chats", elem_id="chat-list", allow_custom_value=False)
        with gr.Row():
            title = gr.Textbox(label="Title", elem_id="chat-title", scale=3)
            rename = gr.Button("Rename", elem_id="chat-rename", size="sm", scale=1)
        with gr.Row():
            branch_index = gr.Number(
                label="Branch from message #", precision=0, value=1, minimum=1, elem_id="branch-index"
            )
            branch = gr.Button("Branch", elem_id="chat-branch", size="sm")
        with gr.Row():
            download = gr.DownloadButton("Download JSON", elem_id="chat-download", size="sm")
            upload = gr.UploadButton("Upload JSON", file_types=[".json"], elem_id="chat-upload", size="sm")
            delete = gr.Button("Delete chat", variant="stop", elem_id="chat-delete", size="sm")
        message = gr.Markdown(elem_id="sidebar-message")
    with gr.Accordion("Character", open=False, elem_id="character-editor"):
        char_name = gr.Textbox(label="Name", elem_id="char-name")
        char_context = gr.Textbox(label="Context (who the character is)", lines=4, elem_id="char-context")
        char_greeting = gr.Textbox(label="Greeting", lines=2, elem_id="char-greeting")
        char_picture = gr.Image(label="Picture", type="filepath", height=160, elem_id="char-picture")
        with gr.Row():
            char_save = admin_control(gr.Button("Save character", elem_id="char-save", size="sm"))
            char_delete = admin_control(gr.Button("Delete character", variant="stop", elem_id="char-delete", size="sm"))
        card = admin_control(
            gr.UploadButton(
                "Import a TavernAI / SillyTavern card (PNG or JSON)",
                file_types=[".png", ".json"],
                elem_id="card-upload",
                size="sm",
            )
        )
    return SidebarUI(chats, search, new, incognito, title, rename, delete, branch_index, branch, download, upload, message,
                     char_name, char_context, char_greeting, char_picture, char_save, char_delete, card)  # fmt: skip


def _choices(user: str, character: str | None, query: str = "") -> list[tuple[str, str]]:
    found = store.search(user, query, character) if query.strip() else store.list_conversations(user, character)
    return [(f"{c['title']} ({c['messages']})", c["id"]) for c in found]


def wire(chat: ChatUI, side: SidebarUI) -> tuple[Any, list[Any], list[Any]]:
    """Connect the panel's events; returns the page-load handler (restore the latest chat) with its inputs and outputs."""
    mode, character = chat.settings[0], chat.settings[1]

    def greeting_of(name: str, mode_value: str) -> str:
        if mode_value == "instruct" or not name:
            return ""
        try:
            return chars.load_character(name).greeting
        except TextgenError:
            return ""

    def restore(name: str, mode_value: str, request: gr.Request) -> tuple[Any, ...]:
        """On page load and character change: the character's latest chat, or a new one with its greeting."""
        user, forced = user_of(request)
        character_key = name or chars.DEFAULT_CHARACTER
        found = store.list_conversations(user, character_key)
        if found and not forced:
            conv = store.load(user, character_key, found[0]["id"])
            state = {"conv": conv.to_json(), "incognito": False}
        else:
            state = new_state(request, character_key, mode_value, greeting_of(character_key, mode_value))
            conv = conversation(state, request)
        return (
            display(conv.messages), state, gr.update(choices=_choices(user, character_key), value=conv.id if found else None),
            conv.title, forced, *_character_fields(character_key),
        )  # fmt: skip

    def _character_fields(name: str) -> list[Any]:
        try:
            c = chars.load_character(name)
        except TextgenError:
            return [name, "", "", None]
        return [c.name, c.context, c.greeting, str(c.picture) if c.picture else None]

    restore_outputs = [
        chat.chatbot,
        chat.conv,
        side.chats,
        side.title,
        side.incognito,
        side.char_name,
        side.char_context,
        side.char_greeting,
        side.char_picture,
    ]
    character.change(restore, [character, mode], restore_outputs, queue=False)

    def new_chat(name: str, mode_value: str, incognito: bool, request: gr.Request) -> tuple[Any, ...]:
        state = new_state(request, name, mode_value, greeting_of(name, mode_value))
        state["incognito"] = incognito or state["incognito"]
        return display(state["conv"]["messages"]), state, gr.update(value=None), "New chat", ""

    side.new.click(
        new_chat,
        [character, mode, side.incognito],
        [chat.chatbot, chat.conv, side.chats, side.title, chat.status],
        queue=False,
    )

    def set_incognito(value: bool, state: dict[str, Any], request: gr.Request) -> dict[str, Any]:
        _, forced = user_of(request)
        return {**state, "incognito": bool(value) or forced}

    side.incognito.change(set_incognito, [side.incognito, chat.conv], chat.conv, queue=False)

    def open_chat(conv_id: str | None, name: str, request: gr.Request) -> tuple[Any, ...]:
        if not conv_id:
            return gr.skip(), gr.skip(), gr.skip()
        user, _ = user_of(request)
        try:
            conv = store.load(user, name or chars.DEFAULT_CHARACTER, conv_id)
        except TextgenError as exc:
            gr.Warning(str(exc))
            return gr.skip(), gr.skip(), gr.skip()
        return display(conv.messages), {"conv": conv.to_json(), "incognito": False}, conv.title

    side.chats.input(open_chat, [side.chats, character], [chat.chatbot, chat.conv, side.title], queue=False)

    def do_search(query: str, name: str, request: gr.Request) -> Any:
        user, _ = user_of(request)
        return gr.update(choices=_choices(user, name or None, query), value=None)

    side.search.submit(do_search, [side.search, character], side.chats, queue=False)

    def refresh_list(state: dict[str, Any], request: gr.Request) -> tuple[Any, Any]:
        user, _ = user_of(request)
        conv = state.get("conv") or {}
        return gr.update(choices=_choices(user, conv.get("character")), value=conv.get("id")), conv.get("title", "")

    chat.status.change(refresh_list, chat.conv, [side.chats, side.title], queue=False, show_progress="hidden")

    def do_rename(title: str, state: dict[str, Any], request: gr.Request) -> tuple[Any, ...]:
        conv = conversation(state, request)
        if not title.strip():
            return state, gr.skip(), "The title must not be empty."
        conv.title = title.strip()[:200]
        state = persist({**state, "conv": conv.to_json()}, conv.messages, request)  # saved by the usual rule
        user, _ = user_of(request)
        return (
            state,
            gr.update(choices=_choices(user, conv.character), value=conv.id),
            "Renamed.",
        )

    side.rename.click(do_rename, [side.title, chat.conv], [chat.conv, side.chats, side.message], queue=False)

    def do_delete(state: dict[str, Any], name: str, mode_value: str, request: gr.Request) -> tuple[Any, ...]:
        conv = conversation(state, request)
        with contextlib.suppress(TextgenError):  # never saved (incognito or empty): just start over
            store.delete(conv.user, conv.character, conv.id)
        fresh = new_state(request, name, mode_value, greeting_of(name, mode_value))
        user, _ = user_of(request)
        return (
            display(fresh["conv"]["messages"]),
            fresh,
            gr.update(choices=_choices(user, name), value=None),
            "Deleted.",
        )

    side.delete.click(
        do_delete, [chat.conv, character, mode], [chat.chatbot, chat.conv, side.chats, side.message], queue=False
    )

    def do_branch(number: float | None, state: dict[str, Any], request: gr.Request) -> tuple[Any, ...]:
        conv = conversation(state, request)
        shown = [i for i, m in enumerate(conv.messages) if m["role"] in ("user", "assistant")]
        position = int(number or 0) - 1
        if not 0 <= position < len(shown):
            return gr.skip(), state, gr.skip(), f"Pick a message between 1 and {len(shown)}."
        copy = store.branch(conv, shown[position])
        new = {"conv": copy.to_json(), "incognito": state.get("incognito", False)}
        new = persist(new, copy.messages, request)
        user, _ = user_of(request)
        return (
            display(copy.messages),
            new,
            gr.update(choices=_choices(user, copy.character), value=copy.id),
            f"Branched at message {position + 1}.",
        )

    side.branch.click(
        do_branch, [side.branch_index, chat.conv], [chat.chatbot, chat.conv, side.chats, side.message], queue=False
    )

    def do_download(state: dict[str, Any], request: gr.Request) -> str:
        conv = conversation(state, request)
        folder = Path(tempfile.mkdtemp(prefix="textgen-chat-"))
        path = folder / f"{conv.id}.json"
        path.write_text(json.dumps(conv.to_json(), ensure_ascii=False, indent=1))
        return str(path)

    side.download.click(do_download, chat.conv, side.download, queue=False)

    def do_upload(file: str | None, name: str, request: gr.Request) -> tuple[Any, ...]:
        if not file:
            return gr.skip(), gr.skip(), gr.skip(), "No file."
        user, _ = user_of(request)
        try:
            data = json.loads(Path(file).read_text(encoding="utf-8"))
            conv = store.from_json(data, user=user, character=name or chars.DEFAULT_CHARACTER)
        except (ValueError, TextgenError) as exc:
            return gr.skip(), gr.skip(), gr.skip(), f"Not a chat history: {exc}"
        conv.id = store.new_id()
        state = persist({"conv": conv.to_json(), "incognito": False}, conv.messages, request)
        return (
            display(conv.messages),
            state,
            gr.update(choices=_choices(user, conv.character), value=conv.id),
            f"Imported {len(conv.messages)} messages.",
        )

    side.upload.upload(
        do_upload, [side.upload, character], [chat.chatbot, chat.conv, side.chats, side.message], queue=False
    )

    # characters
    def save_character(name: str, context: str, greeting: str, picture: str | None) -> tuple[Any, str]:
        try:
            data = Path(picture).read_bytes() if picture else None
            saved = chars.save_character(name, name, context, greeting, data)
        except (TextgenError, OSError) as exc:
            return gr.skip(), f"Error: {exc}"
        return gr.update(choices=chars.list_characters(), value=saved.key), f"Saved {saved.key}."

    side.char_save.click(
        admin_only("save characters")(save_character),
        [side.char_name, side.char_context, side.char_greeting, side.char_picture],
        [character, side.message],
        queue=False,
    )

    def delete_character(name: str) -> tuple[Any, str]:
        try:
            chars.delete_character(name)
        except TextgenError as exc:
            return gr.skip(), f"Error: {exc}"
        remaining = chars.list_characters()
        return gr.update(choices=remaining, value=remaining[0] if remaining else None), f"Deleted {name}."

    side.char_delete.click(
        admin_only("delete characters")(delete_character), character, [character, side.message], queue=False
    )

    def import_card(file: str | None) -> tuple[Any, str]:
        if not file:
            return gr.skip(), "No file."
        try:
            imported = chars.import_card(Path(file).read_bytes())
        except (TextgenError, OSError) as exc:
            return gr.skip(), f"Error: {exc}"
        return gr.update(choices=chars.list_characters(), value=imported.key), f"Imported {imported.name}."

    side.card.upload(admin_only("import characters")(import_card), side.card, [character, side.message], queue=False)
    return restore, [character, mode], restore_outputs
