"""Session state the UI's Session tab shows and edits: extensions, their params, and saving settings.yaml."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from modules import extensions, shared
from modules.errors import InvalidRequest
from modules.fileio import atomic_write_yaml
from modules.settings import Settings, read_yaml


def extension_rows() -> list[list[str]]:
    """(name, status, display name) for every extension available or asked for."""
    rows = []
    loaded = {e.name: e for e in extensions.loaded()}
    for name in sorted(set(extensions.available()) | set(loaded)):
        ext = loaded.get(name)
        if ext is None:
            status = "available"
        elif ext.active:
            status = "active"
        else:
            status = "failed: " + (ext.error or "").strip().splitlines()[-1][:200] if ext.error else "failed"
        rows.append([name, status, ext.display_name if ext else name])
    return rows


def set_active(names: list[str]) -> list[str]:
    """Load the named extensions (hooks take effect at once) and unload the others; returns problems."""
    problems = []
    for ext in list(extensions.loaded()):
        if ext.name not in names:
            extensions.unload_extension(ext.name)
    for ext in extensions.load_extensions(names):
        if not ext.active:
            problems.append(f"{ext.name}: {(ext.error or '').strip().splitlines()[-1] if ext.error else 'failed'}")
    active = [e.name for e in extensions.active()]
    shared.settings.api = "openai" in active
    shared.settings.extensions = [name for name in active if name != "openai"]
    return problems


def params_json(name: str) -> str:
    """An extension's params as JSON."""
    ext = next((e for e in extensions.loaded() if e.name == name), None)
    if ext is None:
        return "{}"
    return json.dumps({k: v for k, v in ext.params.items() if _plain(v)}, indent=2, ensure_ascii=False)


def _plain(value: Any) -> bool:
    return isinstance(value, (str, int, float, bool, list, dict)) or value is None


def update_params(name: str, text: str) -> None:
    """Set an extension's params from JSON; keys keep their types."""
    ext = next((e for e in extensions.loaded() if e.name == name), None)
    if ext is None:
        raise InvalidRequest(f"extension {name!r} is not loaded")
    try:
        values = json.loads(text)
    except ValueError as exc:
        raise InvalidRequest(f"not valid JSON: {exc}") from exc
    if not isinstance(values, dict):
        raise InvalidRequest("params must be a JSON object")
    for key, value in values.items():
        old = ext.params.get(key)
        if old is not None and isinstance(old, bool) != isinstance(value, bool):
            raise InvalidRequest(f"{key} must stay a {type(old).__name__}")
        if isinstance(old, (int, float)) and not isinstance(old, bool) and not isinstance(value, (int, float)):
            raise InvalidRequest(f"{key} must stay a number")
    ext.params.update(values)
    shared.extension_params.setdefault(name, {}).update(values)


SECRETS = ("api_key", "admin_key", "gradio_auth")


def flags() -> dict[str, Any]:
    """The server settings now in effect (as JSON-friendly values), secrets masked."""
    values = json.loads(shared.settings.model_dump_json())
    return {k: ("***" if k in SECRETS and v else v) for k, v in values.items()}


def settings_path() -> Path:
    """user_data/settings.yaml."""
    return shared.user_data_dir() / "settings.yaml"


def save_settings(ui_values: dict[str, Any] | None = None) -> Path:
    """Write user_data/settings.yaml: settings that differ from the defaults, UI defaults, extension params."""
    path = settings_path()
    existing = read_yaml(path) if path.is_file() else {}
    defaults = Settings().model_dump(mode="json")
    current = shared.settings.model_dump(mode="json")
    data: dict[str, Any] = {k: v for k, v in existing.items() if "-" in k or k not in defaults}
    skip = ("user_data_dir", *SECRETS)  # secrets are never written by the UI
    data.update({k: v for k, v in current.items() if v != defaults[k] and k not in skip})
    data.update(ui_values or {})
    for ext_name, values in shared.extension_params.items():
        for key, value in values.items():
            if _plain(value) and key not in ("display_name", "is_tab"):
                data[f"{ext_name}-{key}"] = value
    atomic_write_yaml(path, data)
    shared.ui_defaults.update(ui_values or {})
    return path
