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
