"""GGUF -> a smaller GGUF with ``llama_cpp.llama_model_quantize``, in process (K-quants, legacy and i-quants).

Types that need an importance matrix (IQ1_*, IQ2_XXS/XS/S, IQ3_XXS, Q2_K_S) are refused with that reason unless
an imatrix GGUF (from ``llama-imatrix``) is given. Bits per weight are measured from the written file, since
llama.cpp picks other types for tensors whose rows do not fit a type's block (SmolLM2's 576 is not a multiple
of 256, so most of its K-quant tensors fall back). The file is written as ``.NAME.partial`` and renamed at the end.
"""

from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from modules import jobs
from modules.errors import InvalidRequest, TextgenError
from modules.lifecycle.convert import partial_path

FTYPES: dict[str, int] = {
    "F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "Q5_0": 8, "Q5_1": 9, "Q2_K": 10, "Q3_K_S": 11,
    "Q3_K_M": 12, "Q3_K_L": 13, "Q4_K_S": 14, "Q4_K_M": 15, "Q5_K_S": 16, "Q5_K_M": 17, "Q6_K": 18,
    "IQ2_XXS": 19, "IQ2_XS": 20, "Q2_K_S": 21, "IQ3_XS": 22, "IQ3_XXS": 23, "IQ1_S": 24, "IQ4_NL": 25,
    "IQ3_S": 26, "IQ3_M": 27, "IQ2_S": 28, "IQ2_M": 29, "IQ4_XS": 30, "IQ1_M": 31, "BF16": 32, "TQ1_0": 36,
    "TQ2_0": 37,
}  # fmt: skip
"""llama.cpp's ``LLAMA_FTYPE_MOSTLY_*`` numbers (include/llama.h of the version we build)."""

NEEDS_IMATRIX = frozenset({"IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "Q2_K_S"})
"""Types whose tensors llama.cpp will not write without an importance matrix (llama-quant.cpp)."""


class QuantizeError(TextgenError):
    """llama.cpp could not quantize the file."""


@dataclass
class QuantizeArgs:
    """One GGUF to another type."""

    source: Path  # a GGUF file, best F16/BF16/F32 (requantizing a quantized file loses more)
    output: Path
    quant: str = "Q4_K_M"  # a key of FTYPES
    imatrix: Path | None = None  # an importance-matrix GGUF from llama-imatrix (needed for NEEDS_IMATRIX types)
    threads: int = 0  # 0: all cores


def ftype_of(quant: str) -> int:
    """The llama.cpp file-type number of a type name (any case); InvalidRequest for an unknown name."""
    key = quant.upper()
    if key not in FTYPES:
        raise InvalidRequest(f"unknown quantization type {quant!r}; choose one of {', '.join(FTYPES)}", "quant")
    return FTYPES[key]


def check_quant(quant: str, imatrix: Path | None) -> None:
    """Refuse a type that needs an importance matrix when none is given, saying so."""
    ftype_of(quant)
    if quant.upper() in NEEDS_IMATRIX and imatrix is None:
        raise InvalidRequest(
            f"{quant.upper()} needs an importance matrix (llama.cpp refuses it without one: its low-bit grids "
            "ruin the model otherwise). Give one with --imatrix FILE (made by llama-imatrix on a calibration text), "
            "or choose a K-quant such as Q4_K_M or Q3_K_M.",
            "quant",
        )


def load_imatrix(path: Path) -> dict[str, list[float]]:
    """An imatrix GGUF (``NAME.in_sum2`` and ``NAME.counts`` tensors) as mean squared activations per tensor."""
    import numpy as np
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    tensors = {t.name: np.asarray(t.data, dtype=np.float32).reshape(-1) for t in reader.tensors}
    result: dict[str, list[float]] = {}
    for name, sums in tensors.items():
        if not name.endswith(".in_sum2"):
            continue
        base = name[: -len(".in_sum2")]
        counts = tensors.get(base + ".counts")
        if counts is None or counts.size == 0:
            raise QuantizeError(f"{path.name}: {base} has sums but no counts; is this an imatrix file?")
        per = sums.reshape(counts.size, -1)
        values = np.where(counts[:, None] > 0, per / np.maximum(counts[:, None], 1), 1.0)
        result[base] = values.reshape(-1).tolist()
    if not result:
        raise QuantizeError(f"{path.name} holds no importance-matrix entries")
    return result


def _imatrix_array(data: dict[str, list[float]]) -> tuple[Any, list[Any]]:
    import llama_cpp

    keep: list[Any] = []
    array = (llama_cpp.llama_model_imatrix_data * (len(data) + 1))()
    for i, (name, values) in enumerate(data.items()):
        name_bytes = ctypes.create_string_buffer(name.encode())
        floats = (ctypes.c_float * len(values))(*values)
        keep += [name_bytes, floats]
        array[i].name = ctypes.cast(name_bytes, ctypes.c_char_p)
        array[i].data = ctypes.cast(floats, ctypes.POINTER(ctypes.c_float))
        array[i].size = len(values)
    array[len(data)].name = None  # the terminator llama.cpp looks for
    return array, keep


def quantize(args: QuantizeArgs, report: jobs.Reporter, cancel: threading.Event) -> Path:
    """Write ``args.source`` as ``args.quant``; returns the output path."""
    import llama_cpp

    check_quant(args.quant, args.imatrix)
    source, output = Path(args.source), Path(args.output)
    if not source.is_file():
        raise InvalidRequest(f"{source} is not a file", "source")
    jobs.check(cancel)
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype_of(args.quant)
    params.allow_requantize = True
    params.nthread = int(args.threads)
    keep: list[Any] = []
    if args.imatrix is not None:
        array, keep = _imatrix_array(load_imatrix(Path(args.imatrix)))
        params.imatrix = ctypes.cast(array, ctypes.POINTER(llama_cpp.llama_model_imatrix_data))
        keep.append(array)
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = partial_path(output)
    report(done=0, total=1, message=f"quantizing to {args.quant.upper()}")
    try:
        code = llama_cpp.llama_model_quantize(str(source).encode(), str(tmp).encode(), ctypes.byref(params))
        if code != 0 or not tmp.is_file():
            raise QuantizeError(f"llama.cpp could not quantize {source.name} to {args.quant.upper()} (code {code})")
        jobs.check(cancel)  # llama.cpp cannot be stopped mid-file: a cancel during it drops the result here
        tmp.replace(output)
    finally:
        tmp.unlink(missing_ok=True)
    report(done=1, total=1, message=f"wrote {output.name}")
    return output


def bits_per_weight(path: Path) -> float:
    """Bits per weight of a GGUF file: tensor data bytes * 8 / parameters (what the file really holds)."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    params = sum(int(t.n_elements) for t in reader.tensors)
    data = sum(int(t.n_bytes) for t in reader.tensors)
    return data * 8 / params if params else 0.0


def tensor_types(path: Path) -> dict[str, int]:
    """How many tensors of each type the file holds, e.g. ``{"Q4_K": 120, "Q5_0": 60, "F32": 61}``."""
    from gguf import GGUFReader

    counts: dict[str, int] = {}
    for tensor in GGUFReader(str(path)).tensors:
        counts[tensor.tensor_type.name] = counts.get(tensor.tensor_type.name, 0) + 1
    return counts
