"""Atomic writes for files the user owns: temp file in the same folder, fsync, rename; and the sweep that removes
the temp files an interrupted write left behind."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

log = logging.getLogger(__name__)

TEMP_SUFFIX = ".tmp"
# What atomic_write_bytes names its temp file: ".NAME." + mkstemp's 8 random characters + ".tmp"
TEMP_NAME = re.compile(r"^\..+\.[a-z0-9_]{8}\.tmp$")
STALE_AFTER_S = 60.0  # a write in progress holds its temp file for milliseconds; older ones were interrupted


def _umask() -> int:
    """The process umask, read without changing it (os.umask would, for every thread, for a moment)."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    return 0o022


def _mode_for(path: Path) -> int:
    """The mode a rewritten file keeps (its own), or a new file gets (0666 less the umask, as open() would)."""
    try:
        return path.stat().st_mode & 0o7777
    except OSError:
        return 0o666 & ~_umask()


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that a crash leaves either the old or the new file, never half of one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=TEMP_SUFFIX, dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            os.fchmod(handle.fileno(), _mode_for(path))  # mkstemp's 0600 would otherwise replace the file's mode
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    try:  # make the rename itself durable
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except OSError:
        pass


def atomic_write_text(path: Path, text: str) -> None:
    """Atomically write UTF-8 text."""
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_yaml(path: Path, data: Any) -> None:
    """Atomically write a YAML document (keys in the given order, unicode kept)."""
    atomic_write_text(path, yaml.safe_dump(data, sort_keys=False, allow_unicode=True))


def remove_stale_temp_files(root: Path, older_than_s: float = STALE_AFTER_S) -> list[Path]:
    """Delete the temp files that interrupted atomic writes left under ``root``; returns what was removed.

    Only regular files named like :func:`atomic_write_bytes`'s temp files (``.NAME.xxxxxxxx.tmp``) and not modified
    for ``older_than_s`` seconds are removed; symlinks are neither followed nor removed, nothing else is touched.
    """
    removed: list[Path] = []
    if not root.is_dir():
        return removed
    cutoff = time.time() - older_than_s
    for folder, _dirs, files in os.walk(root):  # followlinks=False: a linked folder is not ours to sweep
        for name in files:
            if not TEMP_NAME.match(name):
                continue
            path = Path(folder) / name
            try:
                info = path.lstat()
                if not path.is_symlink() and path.is_file() and info.st_mtime < cutoff:
                    path.unlink()
                    removed.append(path)
            except OSError as exc:  # gone meanwhile, or not ours to delete: leave it
                log.debug("could not remove %s: %s", path, exc)
    if removed:
        log.info(
            "Removed %d temp file%s left by interrupted writes under %s", len(removed), "s" * (len(removed) != 1), root
        )
    return removed
