"""Chat histories: one JSON file per conversation under user_data/logs/USER/CHARACTER/, written atomically.

A conversation holds its messages (``role``, ``content``, optional ``visible`` and, for regenerated replies,
``versions`` with the index of the one shown), a title, the character and mode, and timestamps.
"""

from __future__ import annotations

import hashlib
import json
import re
import secrets
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from modules import shared
from modules.errors import InvalidRequest
from modules.fileio import atomic_write_text
from modules.images import in_folder
from modules.paths import UnsafePath, safe_child

DEFAULT_USER = "default"
ROLES = ("system", "user", "assistant")
_NAME = re.compile(r"[^\w.\- ]+", re.UNICODE)
_HASHED = re.compile(r"-[0-9a-f]{12}$")  # the suffix _folder_name adds; a name ending so gets its own hash


@dataclass
class Conversation:
    """A saved chat."""

    id: str
    character: str
    user: str = DEFAULT_USER
    title: str = "New chat"
    mode: str = "instruct"
    created: float = field(default_factory=time.time)
    updated: float = field(default_factory=time.time)
    messages: list[dict[str, Any]] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        """The file's contents."""
        return asdict(self)


def _folder_name(value: str) -> str:
    """A folder name for a user or character: the name itself when it is a plain one, else a readable version
    with a hash of the original, so two different names never share a folder ("bob?" and "bob!")."""
    cleaned = _NAME.sub("_", value).strip(" .")
    if cleaned == value and len(value) <= 80 and not _HASHED.search(value):
        return value
    digest = hashlib.sha256(value.encode("utf-8")).hexdigest()[:12]
    return f"{cleaned[:60] or '_'}-{digest}"


def logs_dir() -> Path:
    """user_data/logs."""
    return shared.user_data_dir() / "logs"


def _dir(user: str, character: str) -> Path:
    try:
        return safe_child(safe_child(logs_dir(), _folder_name(user)), _folder_name(character))
    except UnsafePath as exc:
        raise InvalidRequest(f"invalid user or character name: {exc}") from exc


def _path(user: str, character: str, conv_id: str) -> Path:
    if not re.fullmatch(r"[0-9A-Za-z_-]{1,64}", conv_id):
        raise InvalidRequest(f"invalid conversation id {conv_id!r}")
    return _dir(user, character) / f"{conv_id}.json"


def new_id() -> str:
    """A sortable, unique conversation id."""
    return time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(3)


def new_conversation(
    character: str, user: str = DEFAULT_USER, mode: str = "instruct", greeting: str = ""
) -> Conversation:
    """A fresh conversation (not saved until it has a message)."""
    conv = Conversation(id=new_id(), character=character, user=user, mode=mode)
    if greeting:
        conv.messages.append({"role": "assistant", "content": greeting})
    return conv


def validate_messages(messages: Any) -> list[dict[str, Any]]:
    """Messages from a file or an upload, checked; raises InvalidRequest naming what is wrong."""
    if not isinstance(messages, list):
        raise InvalidRequest("messages must be a list")
    checked = []
    for i, message in enumerate(messages):
        if (
            not isinstance(message, dict)
            or message.get("role") not in ROLES
            or not isinstance(message.get("content"), str)
        ):
            raise InvalidRequest(f"message {i} needs a role ({', '.join(ROLES)}) and a text content")
        entry: dict[str, Any] = {"role": message["role"], "content": message["content"]}
        if isinstance(message.get("visible"), str):
            entry["visible"] = message["visible"]
        images = message.get("images")
        if isinstance(images, list):  # only pictures kept by textgen: an uploaded file cannot point elsewhere
            kept = [i for i in images if isinstance(i, str) and in_folder(i, images_dir())]
            if kept:
                entry["images"] = kept
        versions = message.get("versions")
        if isinstance(versions, list) and versions and all(isinstance(v, str) for v in versions):
            entry["versions"] = list(versions)
            index = message.get("version", len(versions) - 1)
            entry["version"] = index if isinstance(index, int) and 0 <= index < len(versions) else len(versions) - 1
        checked.append(entry)
    return checked


def title_for(messages: list[dict[str, Any]]) -> str:
    """A title from the first user message."""
    first = next((m["content"] for m in messages if m["role"] == "user"), "")
    text = " ".join(str(first).split())
    return (text[:60] + "...") if len(text) > 60 else (text or "New chat")


def save(conv: Conversation) -> Path:
    """Write the conversation atomically (a crash leaves the old file or the new one, never half)."""
    conv.updated = time.time()
    if conv.title == "New chat":
        conv.title = title_for(conv.messages)
    path = _path(conv.user, conv.character, conv.id)
    atomic_write_text(path, json.dumps(conv.to_json(), ensure_ascii=False, indent=1))
    return path


def save_if_started(conv: Conversation, greeting: str = "") -> bool:
    """Save a chat that has more than its greeting, or that was saved before (a removal must reach the file too).

    A fresh chat showing only the character's greeting is not written, so opening chats leaves no empty files.
    """
    shown = [(m["role"], m["content"]) for m in conv.messages]
    pristine = shown in ([], [("assistant", greeting)])
    if pristine and not _path(conv.user, conv.character, conv.id).is_file():
        return False
    save(conv)
    return True


def load(user: str, character: str, conv_id: str) -> Conversation:
    """Read a saved conversation."""
    path = _path(user, character, conv_id)
    if not path.is_file():
        raise InvalidRequest(f"no conversation {conv_id!r} for {character}")
    return from_json(json.loads(path.read_text(encoding="utf-8")), user=user, character=character)


def from_json(data: Any, *, user: str, character: str) -> Conversation:
    """A conversation from parsed JSON (a saved file or an upload); a bare message list is accepted too."""
    if isinstance(data, list):
        data = {"messages": data}
    if not isinstance(data, dict):
        raise InvalidRequest("a chat history must be a JSON object with 'messages' (or a list of messages)")
    conv = Conversation(
        id=str(data.get("id") or new_id()),
        character=character,
        user=user,
        title=str(data.get("title") or "New chat"),
        mode=str(data.get("mode") or "instruct"),
        created=float(data.get("created") or time.time()),
        updated=float(data.get("updated") or time.time()),
        messages=validate_messages(data.get("messages", [])),
    )
    if not re.fullmatch(r"[0-9A-Za-z_-]{1,64}", conv.id):
        conv.id = new_id()
    return conv


def list_conversations(user: str, character: str | None = None) -> list[dict[str, Any]]:
    """Saved conversations (newest first): id, title, character, updated, message count."""
    root = safe_child(logs_dir(), _folder_name(user)) if logs_dir().is_dir() else None
    if root is None or not root.is_dir():
        return []
    folders = [_dir(user, character)] if character else [p for p in root.iterdir() if p.is_dir()]
    found = []
    for folder in folders:
        for path in folder.glob("*.json"):
            try:
                data = json.loads(path.read_text(encoding="utf-8"))
            except (OSError, ValueError):
                continue  # an unreadable file is skipped, not fatal
            found.append(
                {
                    "id": path.stem,
                    "title": str(data.get("title", path.stem)),
                    "character": str(data.get("character", folder.name)),
                    "updated": float(data.get("updated", path.stat().st_mtime)),
                    "messages": len(data.get("messages", [])),
                }
            )
    return sorted(found, key=lambda c: c["updated"], reverse=True)


def search(user: str, query: str, character: str | None = None) -> list[dict[str, Any]]:
    """Conversations whose title or messages contain ``query`` (case-insensitive)."""
    needle = query.strip().lower()
    if not needle:
        return list_conversations(user, character)
    hits = []
    for info in list_conversations(user, character):
        conv = load(user, info["character"], info["id"])
        text = conv.title + "\n" + "\n".join(str(m["content"]) for m in conv.messages)
        if needle in text.lower():
            hits.append(info)
    return hits


def rename(user: str, character: str, conv_id: str, title: str) -> Conversation:
    """Give a conversation a new title."""
    if not title.strip():
        raise InvalidRequest("the title must not be empty")
    conv = load(user, character, conv_id)
    conv.title = title.strip()[:200]
    save(conv)
    return conv


def delete(user: str, character: str, conv_id: str) -> None:
    """Delete a conversation's file."""
    path = _path(user, character, conv_id)
    if not path.is_file():
        raise InvalidRequest(f"no conversation {conv_id!r} for {character}")
    path.unlink()


def branch(conv: Conversation, index: int) -> Conversation:
    """A new conversation holding the messages up to and including ``index``."""
    if not 0 <= index < len(conv.messages):
        raise InvalidRequest(f"message {index} does not exist (the chat has {len(conv.messages)})")
    copy = Conversation(
        id=new_id(),
        character=conv.character,
        user=conv.user,
        title=f"{conv.title} (branch)",
        mode=conv.mode,
        messages=json.loads(json.dumps(conv.messages[: index + 1])),
    )
    return copy


IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".gif")


def images_dir() -> Path:
    """Where pictures attached to chat messages are kept (random names; the web UI may serve this folder only)."""
    return shared.user_data_dir() / "cache" / "chat-images"


def store_image(source: Path) -> str:
    """Copy a picture attached to a message; returns the stored file's path."""
    from modules.fileio import atomic_write_bytes

    suffix = source.suffix.lower() if source.suffix.lower() in IMAGE_SUFFIXES else ".png"
    target = images_dir() / f"{secrets.token_hex(16)}{suffix}"
    atomic_write_bytes(target, source.read_bytes())
    return str(target)
