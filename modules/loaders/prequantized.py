"""Checkpoints quantized before they were saved (GPTQ, AWQ), which transformers loads through another library.

The method is read from config.json's ``quantization_config``. Whether the library is there is asked of
transformers itself (its quantizer's ``validate_environment``), so the answer follows the installed version: in
transformers 5.x GPTQ needs optimum and gptqmodel (quantizers/quantizer_gptq.py) and AWQ needs gptqmodel and
accelerate (quantizers/quantizer_awq.py; older versions took autoawq). A missing one is a BackendUnavailable
naming the packages, before any weight is read.
"""

from __future__ import annotations

import importlib.util
from typing import Any

from modules.errors import BackendUnavailable

# quant_method -> (name shown, Python packages transformers 5.x delegates to, pip names)
METHODS: dict[str, tuple[str, tuple[str, ...]]] = {
    "gptq": ("GPTQ", ("optimum", "gptqmodel")),
    "awq": ("AWQ", ("gptqmodel", "accelerate")),
}


def quant_method(config: Any) -> str:
    """The ``quant_method`` of a transformers config (or of its ``quantization_config`` dict), lower case."""
    quant = getattr(config, "quantization_config", None) if not isinstance(config, dict) else config
    if quant is None:
        return ""
    if not isinstance(quant, dict):
        quant = quant.to_dict() if hasattr(quant, "to_dict") else vars(quant)
    return str(quant.get("quant_method") or "").lower()


def check(config: Any, name: str) -> str | None:
    """The label (GPTQ or AWQ) of such a checkpoint whose library is installed, None for any other model.

    Raises BackendUnavailable naming what to install when transformers cannot load it here.
    """
    method = quant_method(config)
    if method not in METHODS:
        return None
    label, packages = METHODS[method]
    quant: Any = getattr(config, "quantization_config", None) or {}
    try:
        from transformers.quantizers.auto import AutoHfQuantizer

        quantizer = AutoHfQuantizer.from_config(quant, pre_quantized=True)
        quantizer.validate_environment()
    except (ImportError, RuntimeError, ValueError) as exc:
        missing = [p for p in packages if importlib.util.find_spec(p) is None]
        hint = f" (pip install {' '.join(missing)})" if missing else ""
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise BackendUnavailable(
            f"{name} is a {label} checkpoint, which transformers loads through {' and '.join(packages)}: {reason}{hint}"
        ) from exc
    return label
