"""A trained PEFT adapter as a GGUF LoRA for llama.cpp (llama-family models), through lifecycle.gguf.write_lora_gguf.

Tensor names follow llama.cpp's converter (``model.layers.3.self_attn.q_proj`` -> ``blk.3.attn_q.weight``), and the
B matrices of q and k get the same row permutation llama.cpp's converter applies to those weights.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from modules.lifecycle.gguf import write_lora_gguf

ARCHITECTURES = {"llama": "llama", "mistral": "llama"}  # HF model_type -> GGUF architecture
NAMES = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}  # fmt: skip
KEY = re.compile(r"layers\.(\d+)\.(.+)\.lora_([AB])(?:\.default)?\.weight$")


class GgufNotSupported(Exception):
    """This adapter cannot be written for llama.cpp here (architecture, bias or layer not mapped)."""


def permute(rows: Any, heads: int) -> Any:
    """llama.cpp's q/k row order (interleaved rotary halves), applied to a LoRA B matrix of shape (out, rank)."""
    return rows.reshape(heads, 2, rows.shape[0] // heads // 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def convert(state: dict[str, Any], config: Any, alpha: float, target: Path, name: str) -> Path:
    """Write ``state`` (a PEFT adapter's tensors) for the model ``config`` as a GGUF LoRA at ``target``."""
    arch = ARCHITECTURES.get(getattr(config, "model_type", ""))
    if arch is None:
        raise GgufNotSupported(f"no GGUF LoRA mapping for model type {config.model_type!r} yet")
    pairs: dict[str, dict[str, Any]] = {}
    for key, tensor in state.items():
        match = KEY.search(key)
        if match is None:
            raise GgufNotSupported(f"{key}: only LoRA A/B matrices of the decoder layers can go to llama.cpp")
        layer, module, which = match.groups()
        if module not in NAMES:
            raise GgufNotSupported(f"{key}: {module} has no llama.cpp name")
        pairs.setdefault(f"blk.{layer}.{NAMES[module]}.weight", {})[which] = tensor.float().cpu().numpy()
    heads, kv_heads = (
        config.num_attention_heads,
        getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
    )
    tensors = {}
    for base, ab in pairs.items():
        b = ab["B"]
        if base.endswith("attn_q.weight"):
            b = permute(b, heads)
        elif base.endswith("attn_k.weight"):
            b = permute(b, kv_heads)
        tensors[base] = (ab["A"], b)
    return write_lora_gguf(target, arch, alpha, tensors, name=name)
