"""Where user_data/, models/ and loras/ live, and safe_child() for every user-supplied name."""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


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
