"""The lifecycle CLI's merge, export, quantize, card and push commands (registered in ``__main__.COMMANDS``).

Each runs the same job function as the Model tab and the Workbench with :func:`modules.jobs.run_foreground` (a tqdm
bar; Ctrl+C cancels the step).
``EXPORT_COMMANDS`` holds ``(name, help, configure, run)`` tuples; nothing heavy is imported until a command runs.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from modules import jobs


def _run_job(title: str, fn: Callable[[jobs.Reporter, threading.Event], Any], unit: str = "it") -> Any:
    return jobs.run_foreground(title, fn, unit=unit)  # Ctrl+C: the step stops, no half-written file keeps its name


def _print(data: Any, as_json: bool, text: str) -> None:
    print(json.dumps(data, indent=2, default=str) if as_json else text)


def _merge_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("base", type=Path, help="the base model's HF folder (bitsandbytes 4/8-bit is dequantized first)")
    p.add_argument("lora", type=Path, help="the PEFT adapter folder")
    p.add_argument("--output", type=Path, required=True, help="the merged model's folder")
    p.add_argument("--dtype", default="float16", choices=("float16", "bfloat16", "float32"))
    p.add_argument("--overwrite", action="store_true", help="replace OUTPUT if it exists")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def _merge(a: argparse.Namespace) -> int:
    from modules.lifecycle.merge import MergeArgs, merge

    args = MergeArgs(a.base, a.lora, a.output, a.dtype, a.overwrite)
    out = _run_job(f"merge {a.lora.name}", lambda r, c: merge(args, r, c))
    _print({"output": str(out)}, a.json, f"merged into {out}")
    return 0


def _export_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("source", type=Path, help="an HF folder (a GGUF file to requantize; a PEFT folder for gguf-lora)")
    p.add_argument("--format", default="gguf", choices=("gguf", "gguf-lora", "safetensors", "onnx", "mlx"))
    p.add_argument("--quant", default="F16", help="GGUF type: F16, BF16, Q8_0, Q6_K, Q5_K_M, Q4_K_M, Q4_0, ...")
    p.add_argument("--output", type=Path, help="the file (gguf) or folder to write (default: beside the source)")
    p.add_argument("--base", type=Path, help="gguf-lora: the base model's HF folder")
    p.add_argument("--imatrix", type=Path, help="an importance-matrix GGUF (needed for IQ1/IQ2, IQ3_XXS, Q2_K_S)")
    p.add_argument("--no-check", dest="check", action="store_false", help="skip the fidelity check")
    p.add_argument("--keep-f16", action="store_true", help="keep the intermediate F16 GGUF")
    p.add_argument("--overwrite", action="store_true", help="replace OUTPUT if it exists (else it is refused)")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def _export(a: argparse.Namespace) -> int:
    from dataclasses import asdict

    from modules.lifecycle import fidelity
    from modules.lifecycle.export import ExportArgs, export

    args = ExportArgs(a.source, a.format, a.quant, a.output, a.base, a.imatrix, a.check, a.keep_f16, a.overwrite)
    what = a.quant if a.format in ("gguf", "gguf-lora") else a.format
    result = _run_job(f"export {a.source.name} {what}", lambda r, c: export(args, r, c), unit="B")
    text = f"wrote {result.output}" + (f"\n{fidelity.summary(result.fidelity)}" if result.fidelity else "")
    for item in (result.fidelity or {}).get("agreement", []):
        if item["agreed"] < item["total"]:
            text += f"\n  parted at token {item['agreed']} (HF logit margin {item['margin']:.3f}): {item['prompt']!r}"
    _print(asdict(result), a.json, text)
    return 0


def _quantize_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("source", type=Path, help="a GGUF file (best F16/BF16)")
    p.add_argument("--quant", required=True, help="Q8_0, Q6_K, Q5_K_M, Q4_K_M, Q3_K_M, Q2_K, Q4_0, Q5_0, IQ4_XS, ...")
    p.add_argument("--output", type=Path, help="the file to write (default: beside the source)")
    p.add_argument("--imatrix", type=Path, help="an importance-matrix GGUF (needed for IQ1/IQ2, IQ3_XXS, Q2_K_S)")
    p.add_argument("--check", action="store_true", help="measure PPL and KLD against the source file")
    p.add_argument("--overwrite", action="store_true", help="replace OUTPUT if it exists (else it is refused)")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def _quantize(a: argparse.Namespace) -> int:
    from modules.lifecycle.export import ExportArgs, default_output, export

    args = ExportArgs(a.source, "gguf", a.quant, a.output, imatrix=a.imatrix, check=a.check, overwrite=a.overwrite)
    args.output = args.output or default_output(args)
    result = _run_job(f"quantize {a.source.name} {a.quant}", lambda r, c: export(args, r, c))
    from modules.lifecycle import fidelity, quantize

    bpw = quantize.bits_per_weight(Path(result.output))
    text = f"wrote {result.output} ({bpw:.2f} bits per weight)"
    text += f"\n{fidelity.summary(result.fidelity)}" if result.fidelity else ""
    _print({"output": result.output, "bits_per_weight": bpw, "fidelity": result.fidelity}, a.json, text)
    return 0


def _card_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("folder", type=Path, help="the folder (or the one file) that would be pushed")
    p.add_argument("--repo", required=True, help="ORG/NAME on the Hub")
    p.add_argument("--license", default="", help="the license id (apache-2.0, mit, ...)")
    p.add_argument("--base-model", default="", help="the original model's Hub id")
    p.add_argument("--write", action="store_true", help="write FOLDER/README.md (to edit; a push then sends it)")


def _card(a: argparse.Namespace) -> int:
    from modules.fileio import atomic_write_text
    from modules.lifecycle.publish import PushArgs, prepare

    _, files, text = prepare(PushArgs(a.folder, a.repo, license=a.license, base_model=a.base_model))
    if not a.write:
        print(text, end="")
        return 0
    readme = (a.folder if a.folder.is_dir() else a.folder.parent) / "README.md"
    if readme.exists():
        print(f"{readme} exists: a push sends it as it is (delete it for a new card)", file=sys.stderr)
        return 1
    atomic_write_text(readme, text)
    print(f"wrote {readme}; a push would upload: {', '.join(files)}")
    return 0


def _push_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("folder", type=Path, help="what to upload: an export's or a merge's folder, or one GGUF file")
    p.add_argument("repo", help="ORG/NAME on the Hub")
    group = p.add_mutually_exclusive_group()
    group.add_argument("--private", dest="private", action="store_true", default=None, help="make the repo private")
    group.add_argument("--public", dest="private", action="store_false", help="make the repo public")
    p.add_argument("--endpoint", help="the Hub's URL (default: HF_ENDPOINT or huggingface.co)")
    p.add_argument("--license", default="")
    p.add_argument("--base-model", default="")
    p.add_argument("--no-card", dest="card", action="store_false", help="send no model card")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def _token() -> str | None:
    """HF_TOKEN or the saved login (`hf auth login`), else a prompt on a terminal: never on the command line, where
    `ps` shows it to every user of the machine."""
    from huggingface_hub import get_token

    token = get_token()
    if not token and sys.stdin.isatty():
        import getpass

        token = getpass.getpass("Hugging Face write token (not shown): ").strip() or None
    return token


def _push(a: argparse.Namespace) -> int:
    from modules.lifecycle.publish import PushArgs, push

    args = PushArgs(a.folder, a.repo, a.private, _token(), a.endpoint, a.license, a.base_model, card=a.card)
    result = _run_job(f"push {a.repo}", lambda r, c: push(args, r, c))
    visibility = "private" if result["private"] else "public"
    _print(result, a.json, f"pushed {len(result['files'])} files to {result['url']} ({visibility})")
    return 0


EXPORT_COMMANDS: list[tuple[str, str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]]
EXPORT_COMMANDS = [
    ("merge", "merge a LoRA into its base (16 bit safetensors, tokenizer, chat template)", _merge_args, _merge),
    ("export", "export to GGUF (any type, fidelity-checked), a GGUF LoRA, safetensors, ONNX or MLX", _export_args,
     _export),
    ("quantize", "quantize a GGUF file with llama.cpp (K-quants, legacy, i-quants)", _quantize_args, _quantize),
    ("card", "print (or write) the model card a push would upload", _card_args, _card),
    ("push", "upload a folder with its model card to the Hugging Face Hub", _push_args, _push),
]  # fmt: skip
