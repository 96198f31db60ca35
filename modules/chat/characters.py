"""Characters: user_data/characters/NAME.yaml|json with name, greeting, context and an optional picture."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from modules import shared
from modules.errors import InvalidRequest
from modules.paths import UnsafePath, safe_child
from modules.settings import SettingsError, read_yaml

DEFAULT_CHARACTER = "Assistant"
PICTURE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp")


@dataclass
class Character:
    """Who the model plays in chat modes."""

    key: str  # the file name without extension
    name: str
    context: str = ""
    greeting: str = ""
    picture: Path | None = None


def characters_dir() -> Path:
    """The folder characters live in."""
    return shared.user_data_dir() / "characters"


def list_characters() -> list[str]:
    """Character names (file stems), sorted."""
    folder = characters_dir()
    if not folder.is_dir():
        return []
    return sorted({p.stem for p in folder.iterdir() if p.suffix in (".yaml", ".yml", ".json")}, key=str.lower)


def _read(path: Path) -> dict[str, Any]:
    if path.suffix == ".json":
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except ValueError as exc:
            raise InvalidRequest(f"{path.name} is not valid JSON: {exc}", param="character") from exc
        if not isinstance(data, dict):
            raise InvalidRequest(f"{path.name} must hold a JSON object", param="character")
        return data
    try:
        return read_yaml(path)
    except SettingsError as exc:
        raise InvalidRequest(str(exc), param="character") from exc


def load_character(key: str) -> Character:
    """Read a character by file name; a missing or malformed one is an InvalidRequest."""
    folder = characters_dir()
    for suffix in (".yaml", ".yml", ".json"):
        try:
            path = safe_child(folder, key + suffix)
        except UnsafePath as exc:
            raise InvalidRequest(f"invalid character name: {exc}", param="character") from exc
        if path.is_file():
            data = _read(path)
            picture = next((path.with_suffix(s) for s in PICTURE_SUFFIXES if path.with_suffix(s).is_file()), None)
            return Character(
                key=key,
                name=str(data.get("name") or key),
                context=str(data.get("context") or ""),
                greeting=str(data.get("greeting") or ""),
                picture=picture,
            )
    raise InvalidRequest(
        f"character {key!r} does not exist (have: {', '.join(list_characters()) or 'none'})", param="character"
    )


def _character_path(key: str) -> Path:
    if not key.strip():
        raise InvalidRequest("the character needs a name", param="character")
    try:
        return safe_child(characters_dir(), key.strip() + ".yaml")
    except UnsafePath as exc:
        raise InvalidRequest(f"invalid character name: {exc}", param="character") from exc


def save_character(key: str, name: str, context: str, greeting: str = "", picture: bytes | None = None) -> Character:
    """Create or replace a character (YAML, and a PNG picture beside it), atomically."""
    from modules.fileio import atomic_write_bytes, atomic_write_yaml

    path = _character_path(key)
    atomic_write_yaml(path, {"name": name.strip() or key.strip(), "greeting": greeting, "context": context})
    if picture is not None:
        atomic_write_bytes(path.with_suffix(".png"), _as_png(picture))
    return load_character(path.stem)


def delete_character(key: str) -> None:
    """Delete a character's files (its YAML/JSON and picture)."""
    path = _character_path(key)
    found = False
    for suffix in (".yaml", ".yml", ".json", *PICTURE_SUFFIXES):
        candidate = path.with_suffix(suffix)
        if candidate.is_file():
            candidate.unlink()
            found = True
    if not found:
        raise InvalidRequest(f"character {key!r} does not exist", param="character")


def _as_png(data: bytes) -> bytes:
    import io

    from PIL import Image, UnidentifiedImageError

    try:
        image = Image.open(io.BytesIO(data))
        image.load()
    except (UnidentifiedImageError, OSError) as exc:
        raise InvalidRequest(f"the picture is not an image: {exc}", param="picture") from exc
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


@dataclass
class Card:
    """A TavernAI / SillyTavern character card, converted."""

    name: str
    context: str
    greeting: str


def parse_card(data: dict[str, Any]) -> Card:
    """A v1 or v2 (``chara_card_v2``) card's JSON as our character fields."""
    if data.get("spec") in ("chara_card_v2", "chara_card_v3") and isinstance(data.get("data"), dict):
        data = data["data"]
    name = str(data.get("name") or data.get("char_name") or "").strip()
    if not name:
        raise InvalidRequest("the card has no character name", param="card")
    parts = []
    description = str(data.get("description") or data.get("char_persona") or "").strip()
    if description:
        parts.append(description)
    personality = str(data.get("personality") or "").strip()
    if personality:
        parts.append(f"{{{{char}}}}'s personality: {personality}")
    scenario = str(data.get("scenario") or data.get("world_scenario") or "").strip()
    if scenario:
        parts.append(f"Scenario: {scenario}")
    examples = str(data.get("mes_example") or data.get("example_dialogue") or "").strip()
    if examples:
        parts.append(examples.replace("<START>", "").strip())
    greeting = str(data.get("first_mes") or data.get("char_greeting") or "")
    return Card(name=name, context="\n\n".join(parts), greeting=greeting)


def read_card(data: bytes) -> tuple[Card, bytes | None]:
    """A card from PNG bytes (the ``chara`` text chunk, base64 JSON) or JSON bytes; returns the picture too."""
    import base64
    import io

    if data[:8] == b"\x89PNG\r\n\x1a\n":
        from PIL import Image

        try:
            image = Image.open(io.BytesIO(data))
            image.load()
        except OSError as exc:
            raise InvalidRequest(f"the PNG cannot be read: {exc}", param="card") from exc
        texts = getattr(image, "text", {}) or {}
        raw = texts.get("ccv3") or texts.get("chara")
        if not raw:
            raise InvalidRequest("this PNG holds no character card (no 'chara' text chunk)", param="card")
        try:
            payload = json.loads(base64.b64decode(raw))
        except (ValueError, TypeError) as exc:
            raise InvalidRequest(f"the card's 'chara' chunk is not base64 JSON: {exc}", param="card") from exc
        return parse_card(payload), data
    try:
        payload = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise InvalidRequest("a card must be a PNG with a 'chara' chunk or a JSON file", param="card") from exc
    if not isinstance(payload, dict):
        raise InvalidRequest("the card's JSON must be an object", param="card")
    return parse_card(payload), None


def import_card(data: bytes, key: str | None = None) -> Character:
    """Import a TavernAI/SillyTavern card (PNG v1/v2 or JSON) as a character (a new file, or ``key``); returns it."""
    card, picture = read_card(data)
    if key is None:  # never overwrite a character already there: "Name (2)", "Name (3)"...
        taken = {k.lower() for k in list_characters()}
        key, n = card.name, 1
        while key.strip().lower() in taken:
            n += 1
            key = f"{card.name} ({n})"
    return save_character(key, card.name, card.context, card.greeting, picture)
