"""GPTQ and AWQ checkpoints: told apart by config.json's quantization_config, refused with the packages to install
when the library transformers delegates to is missing (as on this machine), and never listed as EXL2/EXL3."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from modules import models, shared
from modules.errors import BackendUnavailable

TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "vocab_size": 256,
    "max_position_embeddings": 512,
}
QUANT = {
    "gptq": {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True},
    "awq": {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"},
}


def checkpoint(folder: Path, method: str) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({**TINY_LLAMA, "quantization_config": QUANT[method]}))
    (folder / "model.safetensors").write_bytes(b"")  # never read: the check comes first
    return folder


@pytest.mark.parametrize(
    ("method", "packages"), [("gptq", ["optimum", "gptqmodel"]), ("awq", ["gptqmodel", "accelerate"])]
)
def test_a_prequantized_checkpoint_without_its_library_names_the_packages(
    hub: object, models_dir: Path, method: str, packages: list[str]
) -> None:
    if all(importlib.util.find_spec(p) for p in packages):
        pytest.skip(f"{' and '.join(packages)} are installed here")
    checkpoint(models_dir / f"tiny-{method}", method)
    assert models.list_models()[0].loader == "transformers"
    with pytest.raises(BackendUnavailable) as caught:
        models.load_model(f"tiny-{method}")
    message = str(caught.value)
    assert f"tiny-{method} is a {method.upper()} checkpoint" in message
    missing = [p for p in packages if importlib.util.find_spec(p) is None]
    assert all(p in message for p in packages) and f"(pip install {' '.join(missing)})" in message
    assert shared.model is None and shared.loading_model is None
