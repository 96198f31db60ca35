"""Presets: user_data/presets/NAME.yaml holding only the GenerationParams values that differ from defaults."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from modules import shared
from modules.errors import InvalidRequest
from modules.fileio import atomic_write_yaml
from modules.generation.params import GenerationParams
from modules.paths import UnsafePath, safe_child
from modules.settings import SettingsError, read_yaml


def presets_dir() -> Path:
    """The folder presets live in."""
    return shared.user_data_dir() / "presets"


def _preset_path(name: str) -> Path:
    try:
        return safe_child(presets_dir(), f"{name}.yaml")
    except UnsafePath as exc:
        raise InvalidRequest(f"invalid preset name: {exc}", param="preset") from exc


def list_presets() -> list[str]:
    """Preset names, sorted case-insensitively."""
    folder = presets_dir()
    if not folder.is_dir():
        return []
    return sorted((p.stem for p in folder.glob("*.yaml")), key=str.lower)


def load_preset(name: str) -> dict[str, Any]:
    """The preset's values (validated); raises InvalidRequest if it is missing or malformed."""
    path = _preset_path(name)
    if not path.is_file():
        raise InvalidRequest(
            f"preset {name!r} does not exist (have: {', '.join(list_presets()) or 'none'})", param="preset"
        )
    try:
        values = read_yaml(path)
    except SettingsError as exc:
        raise InvalidRequest(str(exc), param="preset") from exc
    known = GenerationParams.field_info()
    values = {k: v for k, v in values.items() if k in known}
    GenerationParams.from_dict(values)  # validate
    return values


def preset_params(name: str, **overrides: Any) -> GenerationParams:
    """GenerationParams from defaults < the preset < overrides."""
    return GenerationParams.from_dict({**load_preset(name), **overrides})


def save_preset(name: str, params: GenerationParams) -> Path:
    """Write the preset atomically, keeping only non-default values."""
    path = _preset_path(name)
    atomic_write_yaml(path, params.non_default())
    return path


def delete_preset(name: str) -> None:
    """Delete a preset; a missing one is an error."""
    path = _preset_path(name)
    if not path.is_file():
        raise InvalidRequest(f"preset {name!r} does not exist", param="preset")
    path.unlink()
