"""The quantization table: one HF model exported to several GGUF types, each measured against the F16 file.

Rows: type, file size, bits per weight (from the file), perplexity on the shipped fidelity text, KL divergence and
top-token agreement against F16, and llama.cpp's generation speed. ``bench/quant_table.py`` prints it for the
default model; the Model tab shows it (with a size-against-perplexity plot) for any model the user exports.
"""

from __future__ import annotations

import threading
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from modules import jobs
from modules.lifecycle import convert, fidelity, quantize

DEFAULT_TYPES = ("F16", "Q8_0", "Q6_K", "Q5_K_M", "Q4_K_M", "Q4_0")


@dataclass
class TableArgs:
    """Which model, which types, where the files go."""

    source: Path  # an HF folder
    folder: Path  # where NAME.TYPE.gguf files are written (kept, so the user can pick one)
    types: tuple[str, ...] = DEFAULT_TYPES
    overwrite: bool = False  # replace an existing folder (refused otherwise)


@dataclass
class Row:
    """One exported type."""

    quant: str
    file: str
    size_mb: float
    bits_per_weight: float
    perplexity: float
    ppl_ratio: float  # perplexity / F16's
    kld: float
    top1_same: float
    tokens_per_s: float


def build(args: TableArgs, report: jobs.Reporter, cancel: threading.Event) -> list[dict[str, Any]]:
    """Export every type in ``args.types`` (F16 first) and measure it; returns the rows as dicts."""
    for quant in args.types:
        quantize.check_quant(quant, None)
    source, final = Path(args.source), Path(args.folder)
    with convert.staged_folder(final, cancel, args.overwrite) as folder:  # the folder takes its name when complete
        folder.mkdir()
        rows = _build(source, folder, args.types, report, cancel)
    for row in rows:
        row.file = str(final / Path(row.file).name)
    return [asdict(r) for r in rows]


def _build(
    source: Path, folder: Path, types: tuple[str, ...], report: jobs.Reporter, cancel: threading.Event
) -> list[Row]:
    f16 = folder / f"{source.name}.F16.gguf"
    steps = len(types) + 1
    report(done=0, total=steps, message="F16 with llama.cpp's converter")
    convert.convert_hf_to_gguf(convert.ConvertArgs(source, f16), jobs_silent, cancel)
    jobs.check(cancel)
    reference = fidelity.reference(f16)
    rows: list[Row] = []
    base_ppl = fidelity.perplexity(reference[1], reference[0])
    for i, quant in enumerate(types, start=1):
        report(done=i, total=steps, message=f"{quant}: quantize and measure")
        path = f16
        if quant.upper() != "F16":
            path = folder / f"{source.name}.{quant.upper()}.gguf"
            quantize.quantize(quantize.QuantizeArgs(f16, path, quant), jobs_silent, cancel)
        jobs.check(cancel)
        measured, _ = fidelity.check_gguf(path, reference=reference, prompts=fidelity.PROMPTS[:2], n=64)
        rows.append(Row(
            quant=quant.upper(), file=str(path), size_mb=path.stat().st_size / 1e6,
            bits_per_weight=measured.bits_per_weight, perplexity=measured.perplexity or 0.0,
            ppl_ratio=(measured.perplexity or 0.0) / base_ppl, kld=measured.kld or 0.0,
            top1_same=measured.top1_same or 0.0, tokens_per_s=measured.tokens_per_s or 0.0,
        ))  # fmt: skip
    report(done=steps, total=steps, message="done")
    return rows


def jobs_silent(*args: Any, **kwargs: Any) -> None:
    """A reporter for inner steps (the table reports per type)."""


def markdown(rows: list[dict[str, Any]]) -> str:
    """The table as Markdown."""
    out = ["| type | size MB | bits/weight | PPL | PPL / F16 | KLD vs F16 | same top token | tokens/s |",
           "|---|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for r in rows:
        out.append(
            f"| {r['quant']} | {r['size_mb']:.1f} | {r['bits_per_weight']:.2f} | {r['perplexity']:.3f} | "
            f"{r['ppl_ratio']:.4f} | {r['kld']:.5f} | {r['top1_same']:.1%} | {r['tokens_per_s']:.1f} |"
        )
    return "\n".join(out)
