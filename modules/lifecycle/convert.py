"""HF folder -> GGUF and PEFT LoRA -> GGUF adapter with llama.cpp's own converters.

The converters come from the llama-cpp-python sdist that setup compiles (so they match the llama.cpp we run):
``make setup`` unpacks ``vendor/llama.cpp/{convert_hf_to_gguf.py,convert_lora_to_gguf.py,conversion,gguf-py}`` into
:data:`TOOLS_DIR`. They run in a child process with their own ``gguf-py`` first on ``PYTHONPATH``, so they never
clash with the ``gguf`` package textgen imports, and so a cancel can stop them at once. Nothing is cloned or
downloaded. Output goes to ``.NAME.partial`` and is renamed only when the converter succeeded.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from modules import jobs
from modules.errors import InvalidRequest, TextgenError

ROOT = Path(__file__).resolve().parents[2]
TOOLS_DIR = Path(os.environ.get("TEXTGEN_LLAMA_CPP_TOOLS", ROOT / ".venv" / "llama.cpp-tools"))
"""Where setup unpacks llama.cpp's converters (override with TEXTGEN_LLAMA_CPP_TOOLS)."""

CONVERTER_TYPES = ("F32", "F16", "BF16", "Q8_0")
"""The output types llama.cpp's converter writes itself; every other type is a quantize step after F16."""

_WRITING = re.compile(r"(\d+(?:\.\d+)?)([kMG]?)/(\d+(?:\.\d+)?)([kMG]?)\s*\[")
_SCALE = {"": 1.0, "k": 1e3, "M": 1e6, "G": 1e9}


class ConversionError(TextgenError):
    """llama.cpp's converter is missing or failed; the message says why (its last lines)."""


@dataclass
class ConvertArgs:
    """An HF folder to a GGUF file."""

    source: Path  # a Hugging Face model folder (config.json, safetensors, tokenizer)
    output: Path  # the GGUF file to write
    outtype: str = "F16"  # one of CONVERTER_TYPES


@dataclass
class LoraConvertArgs:
    """A PEFT LoRA folder to a llama.cpp GGUF adapter."""

    lora: Path  # the adapter folder (adapter_config.json, adapter_model.safetensors)
    base: Path  # the base model's HF folder (its config; no weights are read)
    output: Path  # the .gguf adapter to write
    outtype: str = "F16"  # F32, F16, BF16 or Q8_0


def tools_dir() -> Path:
    """The converter folder, or a :class:`ConversionError` that says how to get it."""
    if not (TOOLS_DIR / "convert_hf_to_gguf.py").is_file() or not (TOOLS_DIR / "gguf-py").is_dir():
        raise ConversionError(
            f"llama.cpp's converter is not in {TOOLS_DIR}. Run `make setup` (it unpacks it from the "
            "llama-cpp-python sdist), or set TEXTGEN_LLAMA_CPP_TOOLS to a llama.cpp checkout of the same version."
        )
    return TOOLS_DIR


def partial_path(output: Path) -> Path:
    """Where a file or folder is written before it is complete (renamed to ``output`` at the end): hidden, so no
    listing shows a half-written model, and the same name every time, so a run killed before it could clean up
    leaves nothing once the next one starts."""
    return output.with_name(f".{output.name}.partial")


def refuse_existing(output: Path, overwrite: bool) -> None:
    """Every writer's first check: an existing file or folder is replaced only when asked (``--overwrite``, the
    Model tab's Replace), so an export named like a model never wipes it."""
    if output.exists() and not overwrite:
        kind = "folder" if output.is_dir() else "file"
        raise InvalidRequest(
            f"{output} exists (a {kind}); choose another output, or ask to replace it (--overwrite)", "output"
        )


def refuse_overlap(output: Path, **inputs: Path) -> None:
    """An output may not be an input, lie inside one, or hold one (a replace would delete what it reads), even
    with ``--overwrite``; ``inputs`` by their argument names (source, base, lora)."""
    out = output.resolve()
    for name, given in inputs.items():
        path = Path(given).resolve()
        if out == path or path in out.parents or out in path.parents:
            raise InvalidRequest(
                f"the output {output} is the {name} {given}, inside it or holds it; choose another output", "output"
            )


@contextlib.contextmanager
def staged_folder(output: Path, cancel: threading.Event, overwrite: bool = False) -> Iterator[Path]:
    """A folder to write ``output`` into (``.OUTPUT.partial``, beside it); it takes the final name when the block
    ends without an error or a cancel, and is removed otherwise: nothing half-written ever has the final name. An
    existing ``output`` is refused unless ``overwrite``; when replaced, it is moved aside and deleted only after the
    new folder has its name (a failed rename puts it back)."""
    refuse_existing(output, overwrite)
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = partial_path(output)
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        yield tmp
        jobs.check(cancel)
        if not tmp.is_dir():
            raise TextgenError(f"nothing was written for {output.name}")
        refuse_existing(output, overwrite)  # created meanwhile by someone else
        old = output.with_name(f".{output.name}.replaced")
        _remove(old)
        if output.exists():
            output.replace(old)
        try:
            tmp.replace(output)
        except OSError:
            if old.exists():
                old.replace(output)
            raise
        _remove(old)  # a file replaced by a folder too
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _remove(path: Path) -> None:
    """Delete a file or a folder, if there is one."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _run(command: list[str], output: Path, report: jobs.Reporter, cancel: threading.Event, label: str) -> Path:
    tools = tools_dir()
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = partial_path(output)
    tmp.unlink(missing_ok=True)
    path = os.pathsep.join([str(tools / "gguf-py"), str(tools)])
    env = {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen(
        [sys.executable, *command, "--outfile", str(tmp)],
        cwd=tools,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    tail: list[str] = []

    def read() -> None:
        assert proc.stdout is not None
        buffer = b""
        while chunk := proc.stdout.read1(4096):  # type: ignore[attr-defined]
            buffer += chunk
            *pieces, buffer = re.split(rb"[\r\n]", buffer)
            for piece in pieces:
                line = piece.decode("utf-8", "replace").strip()
                if not line:
                    continue
                match = _WRITING.search(line)
                if match:
                    done = float(match[1]) * _SCALE[match[2]]
                    report(done=done, total=float(match[3]) * _SCALE[match[4]], message=f"{label}: writing")
                else:
                    tail.append(line)
                    del tail[:-20]

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    report(done=0, message=f"{label}: reading tensors")
    try:
        while proc.poll() is None:
            if cancel.is_set():
                proc.kill()
                proc.wait()
                raise jobs.Cancelled()
            time.sleep(0.1)
        reader.join(5)
        if proc.returncode != 0 or not tmp.is_file():
            detail = "\n".join(line for line in tail if "Traceback" not in line)[-1500:]
            raise ConversionError(f"llama.cpp's converter failed on {label} (exit {proc.returncode}):\n{detail}")
        tmp.replace(output)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        tmp.unlink(missing_ok=True)
    return output


def _outtype(name: str) -> str:
    upper = name.upper()
    if upper not in CONVERTER_TYPES:
        raise ConversionError(f"llama.cpp's converter writes {', '.join(CONVERTER_TYPES)}, not {name}")
    return upper.lower()


def convert_hf_to_gguf(args: ConvertArgs, report: jobs.Reporter, cancel: threading.Event) -> Path:
    """Convert an HF folder with ``convert_hf_to_gguf.py``; returns the GGUF path."""
    source = Path(args.source)
    if not (source / "config.json").is_file():
        raise ConversionError(f"{source} is not a Hugging Face model folder (no config.json)")
    script = tools_dir() / "convert_hf_to_gguf.py"
    command = [str(script), str(source.resolve()), "--outtype", _outtype(args.outtype)]
    return _run(command, Path(args.output), report, cancel, source.name)


def convert_lora_to_gguf(args: LoraConvertArgs, report: jobs.Reporter, cancel: threading.Event) -> Path:
    """Convert a PEFT adapter with ``convert_lora_to_gguf.py`` (for llama.cpp's LoRA loading)."""
    lora = Path(args.lora)
    if not (lora / "adapter_config.json").is_file():
        raise ConversionError(f"{lora} is not a PEFT adapter folder (no adapter_config.json)")
    script = tools_dir() / "convert_lora_to_gguf.py"
    command = [str(script), str(lora.resolve()), "--base", str(Path(args.base).resolve())]
    command += ["--outtype", _outtype(args.outtype)]
    return _run(command, Path(args.output), report, cancel, lora.name)
