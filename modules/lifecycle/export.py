"""Export a model: HF -> GGUF (any type, with the fidelity check), LoRA -> GGUF adapter, safetensors, ONNX, MLX.

One job function, :func:`export`, over :class:`ExportArgs`; the CLI, the Model tab and the Workbench all call it.
GGUF: llama.cpp's converter writes F32/F16/BF16/Q8_0 from the HF folder; any other type is F16 first, then
``llama_model_quantize``. After writing, the file is loaded with llama.cpp and compared with the source (see
:mod:`modules.lifecycle.fidelity`); the report is returned and written beside the file as ``FILE.fidelity.json``.
Every file appears under its final name only when complete.
"""

from __future__ import annotations

import json
import platform
import shutil
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from modules import jobs
from modules.errors import BackendUnavailable, InvalidRequest
from modules.fileio import atomic_write_text
from modules.lifecycle import convert, quantize

FORMATS = ("gguf", "gguf-lora", "safetensors", "onnx", "mlx")
GGUF_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q6_K", "Q5_K_M", "Q5_K_S", "Q4_K_M", "Q4_K_S", "Q3_K_M", "Q3_K_L",
              "Q3_K_S", "Q2_K", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "IQ4_NL", "IQ4_XS", "IQ3_M", "IQ3_S", "IQ2_M")  # fmt: skip
"""The types offered in the UI (any llama.cpp type name in quantize.FTYPES is accepted)."""


@dataclass
class ExportArgs:
    """What to export, to what, and how to check it."""

    source: Path  # an HF folder (or a GGUF file, to requantize; or a PEFT folder for gguf-lora)
    format: str = "gguf"  # one of FORMATS
    quant: str = "F16"  # GGUF type (gguf, gguf-lora: F32/F16/BF16/Q8_0)
    output: Path | None = None  # file (gguf) or folder (safetensors, onnx, mlx); default: beside the source
    base: Path | None = None  # gguf-lora: the base model's HF folder
    imatrix: Path | None = None  # importance matrix for IQ1/IQ2/IQ3_XXS/Q2_K_S
    check: bool = True  # run the fidelity check after writing a GGUF
    keep_f16: bool = False  # keep the intermediate F16 GGUF beside the output
    overwrite: bool = False  # replace an existing output (else it is refused before anything runs)


@dataclass
class ExportResult:
    """What was written and what the check found."""

    output: str
    format: str
    quant: str | None = None
    fidelity: dict[str, Any] | None = None
    files: list[str] = field(default_factory=list)


def default_output(args: ExportArgs) -> Path:
    """Beside the source: ``NAME.QUANT.gguf``, ``NAME-lora.F16.gguf`` or ``NAME-FORMAT/``."""
    source = Path(args.source)
    stem = source.stem if source.is_file() else source.name
    for suffix in (".F16", ".BF16", ".F32"):
        stem = stem.removesuffix(suffix)
    if args.format == "gguf":
        return source.parent / f"{stem}.{args.quant.upper()}.gguf"
    if args.format == "gguf-lora":
        return source.parent / f"{stem}.{args.quant.upper()}.gguf"
    return source.parent / f"{stem}-{args.format}"


def validate(args: ExportArgs) -> None:
    """Refuse bad arguments before anything runs (format, type, imatrix, source kind)."""
    if args.format not in FORMATS:
        raise InvalidRequest(f"format must be one of {', '.join(FORMATS)}, not {args.format!r}", "format")
    source = Path(args.source)
    if not source.exists():
        raise InvalidRequest(f"{source} does not exist", "source")
    if args.format == "gguf":
        quantize.check_quant(args.quant, args.imatrix)
        if source.is_file() and source.suffix != ".gguf":
            raise InvalidRequest(f"{source.name} is neither an HF folder nor a GGUF file", "source")
    elif args.format == "gguf-lora":
        if args.base is None:
            raise InvalidRequest("a LoRA export needs the base model's HF folder (--base)", "base")
    elif not (source / "config.json").is_file():
        raise InvalidRequest(f"{source} is not a Hugging Face model folder (no config.json)", "source")


def export(args: ExportArgs, report: jobs.Reporter, cancel: threading.Event) -> ExportResult:
    """Run the export ``args`` describes; the job function behind CLI, UI and Workbench."""
    validate(args)
    output = Path(args.output) if args.output else default_output(args)
    source = Path(args.source).resolve()
    convert.refuse_overlap(output, source=source)
    if args.format in ("gguf", "gguf-lora") and output.is_dir():  # found now, not after the whole conversion
        raise InvalidRequest(f"{output} is a folder and a GGUF is one file; choose another output", "output")
    convert.refuse_existing(output, args.overwrite)
    if args.keep_f16:
        convert.refuse_existing(_kept_f16(output, args.quant.upper()), args.overwrite)
    if args.format == "gguf":
        return _gguf(args, output, report, cancel)
    if args.format == "gguf-lora":
        assert args.base is not None
        lora = convert.LoraConvertArgs(Path(args.source), Path(args.base), output, args.quant)
        path = convert.convert_lora_to_gguf(lora, report, cancel)
        return ExportResult(output=str(path), format="gguf-lora", quant=args.quant.upper(), files=[str(path)])
    if args.format == "safetensors":
        return _safetensors(Path(args.source), output, args.overwrite, report, cancel)
    if args.format == "onnx":
        return _onnx(Path(args.source), output, args.overwrite, report, cancel)
    return _mlx(Path(args.source), output, args.quant, args.overwrite, report, cancel)


def _kept_f16(output: Path, quant: str) -> Path:
    """Where ``keep_f16`` puts the intermediate F16 file: beside the output, ``NAME.F16.gguf``."""
    if f".{quant}." in output.name:
        return output.with_name(output.name.replace(f".{quant}.", ".F16."))
    return output.with_suffix(".F16.gguf")


def _gguf(args: ExportArgs, output: Path, report: jobs.Reporter, cancel: threading.Event) -> ExportResult:
    """Everything is written into a work folder beside ``output`` (the F16 step, the file, its fidelity report) and
    takes its final name only when complete and checked; the work folder goes in every case."""
    from modules.lifecycle import fidelity

    source, quant = Path(args.source), args.quant.upper()
    output.parent.mkdir(parents=True, exist_ok=True)  # the intermediate F16 goes beside the output, never to /tmp
    work = output.with_name(f".{output.name}.work")  # one name: a killed run's folder goes when the next starts
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    try:
        hf_source = source if source.is_dir() else None
        staged = work / output.name
        if hf_source is None:
            f16 = source  # a GGUF given: requantize it (and compare with it)
        elif quant in ("F32", "F16", "BF16"):  # the converter's own (Q8_0 goes through F16, to be compared with it)
            f16 = convert.convert_hf_to_gguf(convert.ConvertArgs(source, staged, quant), report, cancel)
        else:
            f16 = convert.convert_hf_to_gguf(convert.ConvertArgs(source, work / "model.F16.gguf"), report, cancel)
        jobs.check(cancel)
        if f16 != staged:
            qargs = quantize.QuantizeArgs(f16, staged, quant, imatrix=args.imatrix)
            quantize.quantize(qargs, report, cancel)
        result = ExportResult(output=str(output), format="gguf", quant=quant, files=[str(output)])
        report_file = staged.with_name(staged.name + ".fidelity.json")
        if args.check:
            jobs.check(cancel)
            report(message="fidelity check: loading the exported file in llama.cpp")
            result.fidelity = check(staged, hf_source, f16 if f16 != staged else None)
            problem = fidelity.verdict(result.fidelity, quant)
            if problem:  # the work folder, and the file in it, go: nothing is left under the output's name
                raise fidelity.FidelityFailed(
                    f"not written: {output.name} is not the model it came from: {problem} "
                    f"({fidelity.summary(result.fidelity)}). Export with --no-check to keep such a file anyway."
                )
            atomic_write_text(report_file, json.dumps(result.fidelity, indent=2))
            report(message="checked: " + fidelity.summary(result.fidelity))
        jobs.check(cancel)
        convert.refuse_existing(output, args.overwrite)  # written meanwhile by someone else
        staged.replace(output)
        if report_file.is_file():
            report_file.replace(output.with_name(report_file.name))
        else:  # replaced without a check: the old file's report must not describe the new one
            output.with_name(report_file.name).unlink(missing_ok=True)
        if args.keep_f16 and f16.parent == work:
            kept = _kept_f16(output, quant)
            f16.replace(kept)
            result.files.append(str(kept))
        return result
    finally:
        shutil.rmtree(work, ignore_errors=True)


def check(path: Path, hf_source: Path | None, f16: Path | None) -> dict[str, Any]:
    """The fidelity numbers of an exported GGUF: agreement with the HF model, PPL, and KLD against ``f16``."""
    from modules.lifecycle import fidelity

    reference = fidelity.reference(f16) if f16 is not None else None
    report, _ = fidelity.check_gguf(path, hf_source=hf_source, reference=reference)
    return report.to_dict()


def _safetensors(
    source: Path, output: Path, overwrite: bool, report: jobs.Reporter, cancel: threading.Event
) -> ExportResult:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    report(done=0, total=2, message="loading")
    model = AutoModelForCausalLM.from_pretrained(str(source), dtype=torch.float16, local_files_only=True)
    jobs.check(cancel)
    with convert.staged_folder(output, cancel, overwrite) as tmp:
        report(done=1, total=2, message="saving safetensors")
        model.save_pretrained(str(tmp), safe_serialization=True)
        AutoTokenizer.from_pretrained(str(source), local_files_only=True).save_pretrained(str(tmp))
    report(done=2, total=2, message="done")
    return ExportResult(output=str(output), format="safetensors", files=sorted(str(p) for p in output.iterdir()))


def _onnx(source: Path, output: Path, overwrite: bool, report: jobs.Reporter, cancel: threading.Event) -> ExportResult:
    """optimum's exporter where it is installed (with a KV cache, unchecked), else torch.onnx.export checked with
    onnxruntime (:mod:`modules.lifecycle.onnx_export`; no KV cache)."""
    try:
        from optimum.exporters.onnx import main_export
    except ImportError:
        from modules.lifecycle import onnx_export

        result = onnx_export.export_onnx(source, output, report, cancel, overwrite)
        files = sorted(str(p) for p in output.iterdir())
        return ExportResult(output=str(output), format="onnx", quant="F32", fidelity=result, files=files)
    with convert.staged_folder(output, cancel, overwrite) as tmp:
        report(done=0, total=1, message="exporting to ONNX (optimum)")
        main_export(str(source), output=str(tmp), task="text-generation-with-past", device="cpu", local_files_only=True)
    report(done=1, total=1, message="done")
    return ExportResult(output=str(output), format="onnx", files=sorted(str(p) for p in output.iterdir()))


def _mlx(
    source: Path, output: Path, quant: str, overwrite: bool, report: jobs.Reporter, cancel: threading.Event
) -> ExportResult:
    if sys.platform != "darwin" or platform.machine() != "arm64":
        raise BackendUnavailable("MLX runs on Apple silicon (macOS on arm64) only; this machine cannot export to it")
    try:
        from mlx_lm import convert as mlx_convert
    except ImportError as exc:
        raise BackendUnavailable("MLX export needs the optional package mlx-lm: `pip install mlx-lm`") from exc
    with convert.staged_folder(output, cancel, overwrite) as tmp:
        report(done=0, total=1, message="converting to MLX")
        bits = {"Q4_0": 4, "Q4_K_M": 4, "Q8_0": 8}.get(quant.upper())
        mlx_convert(str(source), mlx_path=str(tmp), quantize=bits is not None, q_bits=bits or 4)
    return ExportResult(output=str(output), format="mlx", files=sorted(str(p) for p in output.iterdir()))
