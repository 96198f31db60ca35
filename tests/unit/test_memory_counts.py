"""Parameter counts and bytes without loading weights: config.json arithmetic against a model built on the meta
device, safetensors headers against the real tensors, a GGUF's tensor table against the gguf package's reader."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from modules.lifecycle import analyzer, memory
from tests.conftest import default_model_path, hf_default_model
from tests.fixtures.real_configs import ALL, GEMMA2_2B, LLAMA_3_8B, MIXTRAL_8X7B, QWEN1_5_MOE_A2_7B, QWEN2_0_5B


def meta_count(config: dict[str, Any]) -> int:
    """Parameters of the model transformers builds from ``config``, on the meta device (no memory, no weights)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config))
    return sum(p.numel() for p in model.parameters())  # tied parameters are one parameter


TINY = {
    "tiny-llama-tied": {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1000,
                        "tie_word_embeddings": True},
    "tiny-llama-biases": {"model_type": "llama", "hidden_size": 48, "intermediate_size": 96, "num_hidden_layers": 3,
                          "num_attention_heads": 6, "num_key_value_heads": 3, "vocab_size": 500,
                          "attention_bias": True, "mlp_bias": True},
    "tiny-mixtral": {"model_type": "mixtral", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                     "num_attention_heads": 4, "num_key_value_heads": 1, "num_local_experts": 4,
                     "num_experts_per_tok": 2, "vocab_size": 300},
    "tiny-qwen2-moe-sparse-step": {"model_type": "qwen2_moe", "hidden_size": 32, "intermediate_size": 80,
                                   "moe_intermediate_size": 16, "shared_expert_intermediate_size": 24,
                                   "num_experts": 6, "num_experts_per_tok": 2, "decoder_sparse_step": 2,
                                   "mlp_only_layers": [3], "num_hidden_layers": 4, "num_attention_heads": 4,
                                   "num_key_value_heads": 2, "vocab_size": 200},
}  # fmt: skip


@pytest.mark.parametrize("name", [*TINY, *ALL])
def test_config_count_equals_the_model_built_from_it(name: str) -> None:
    config = {**TINY, **ALL}[name]
    count = memory.count_from_config(config)
    assert count.exact
    assert count.total == meta_count(config)


def test_tied_gqa_and_moe_counts_match_the_published_sizes() -> None:
    assert memory.count_from_config(LLAMA_3_8B).total == 8_030_261_248  # "8B"
    qwen = memory.count_from_config(QWEN2_0_5B)
    assert qwen.total == 494_032_768  # "0.5B" stays 0.5B: the 136M embedding is counted once
    assert qwen.total < memory.count_from_config({**QWEN2_0_5B, "tie_word_embeddings": False}).total
    mixtral = memory.count_from_config(MIXTRAL_8X7B)
    assert round(mixtral.total / 1e9, 1) == 46.7 and round(mixtral.active / 1e9, 1) == 12.9
    moe = memory.count_from_config(QWEN1_5_MOE_A2_7B)
    assert round(moe.total / 1e9, 1) == 14.3 and round(moe.active / 1e9, 1) == 2.7  # "A2.7B": the shared expert
    gemma = memory.shape_from_config(GEMMA2_2B)
    assert gemma.tied_embeddings  # Gemma's default, with no key in config.json


def test_kv_bytes_per_token_use_the_kv_heads() -> None:
    llama = memory.shape_from_config(LLAMA_3_8B)
    assert memory.kv_bytes_per_token(llama) == 2 * 32 * 8 * 128 * 2  # 128 KiB per token at f16, not 512 (32 heads)
    assert memory.kv_bytes_per_token(memory.shape_from_config(GEMMA2_2B)) == 2 * 26 * 4 * 256 * 2


def test_safetensors_headers_count_the_tensors_on_disk() -> None:
    import torch
    from safetensors.torch import load_file

    folder = hf_default_model()
    files = sorted(folder.glob("*.safetensors"))
    count, weight_bytes, by_dtype = memory.count_from_safetensors(files)
    tensors = {k: v for f in files for k, v in load_file(f).items()}
    assert count.total == sum(t.numel() for t in tensors.values())
    assert weight_bytes == sum(t.numel() * t.element_size() for t in tensors.values())
    assert set(by_dtype) == {"F32"} and all(t.dtype == torch.float32 for t in tensors.values())
    config = json.loads((folder / "config.json").read_text())
    assert memory.count_from_config(config).total == count.total  # the arithmetic agrees with the files


def test_gguf_sizes_equal_the_files_tensor_bytes() -> None:
    import llama_cpp

    from modules.formats.gguf import read_header
    from modules.loaders.llama_cpp import _init_backend

    path = default_model_path()
    analysis = analyzer.analyze_gguf(path)
    _init_backend(False)
    model = llama_cpp.llama_model_load_from_file(str(path).encode(), llama_cpp.llama_model_default_params())
    try:  # llama.cpp's own count of the model it loaded
        assert analysis.weight_bytes == llama_cpp.llama_model_size(model)
        assert analysis.parameters == llama_cpp.llama_model_n_params(model)
    finally:
        llama_cpp.llama_model_free(model)
    _, tensors, data_start = read_header(path)
    assert path.stat().st_size - data_start - analysis.weight_bytes < 32 * len(tensors)  # the rest is only padding
    assert analysis.tied_embeddings and analysis.quantization == "Q4_1"
    assert analysis.kv_bytes_per_token == 2 * 30 * 3 * 64 * 2


def test_bytes_per_weight_for_dtypes_and_gguf_types() -> None:
    assert memory.bytes_per_weight("BF16") == 2 and memory.bytes_per_weight("torch.float32") == 4
    assert memory.bytes_per_weight("F8_E4M3") == 1 and memory.bytes_per_weight("F4") == 0.5
    assert memory.bytes_per_weight("Q4_K") == 144 / 256 and memory.bytes_per_weight("Q8_0") == 34 / 32
    assert memory.bytes_per_weight("Q4_K_M") == pytest.approx(4.89 / 8)
    with pytest.raises(ValueError, match="unknown dtype"):
        memory.bytes_per_weight("Q9_Z")


def test_inspect_works_on_a_folder_with_only_config_json(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(MIXTRAL_8X7B))
    analysis = analyzer.analyze(str(tmp_path))
    assert analysis.format == "config" and analysis.parameters == 46_702_792_704
    assert analysis.active_parameters == 12_879_925_248 and analysis.experts == 8 and analysis.experts_used == 2
    assert analysis.weight_bytes == 46_702_792_704 * 2  # bfloat16, from config.json
    assert analysis.context_length == 32768 and not analysis.remote_code


# ---------------------------------------------------------------- the model built on the meta device (issue #28)
def test_meta_counts_are_the_published_sizes() -> None:
    llama = memory.count_from_meta(LLAMA_3_8B)
    assert llama is not None and llama.source == memory.META_SOURCE
    assert llama.total == 8_030_261_248 and llama.embedding == 128256 * 4096
    mixtral = memory.count_from_meta(MIXTRAL_8X7B)
    assert mixtral is not None and mixtral.total == 46_702_792_704  # every expert in the total
    assert round(mixtral.active / 1e9, 1) == 12.9  # 2 of 8 experts per token
    qwen = memory.count_from_meta(QWEN2_0_5B)
    assert qwen is not None and qwen.total == 494_032_768  # the tied output head is the embedding, counted once
    moe = memory.count_from_meta(QWEN1_5_MOE_A2_7B)
    assert moe is not None and round(moe.active / 1e9, 1) == 2.7  # the shared expert is not a routed one


def test_meta_count_of_the_default_model_equals_its_safetensors() -> None:
    folder = hf_default_model()
    header_count, _, _ = memory.count_from_safetensors(sorted(folder.glob("*.safetensors")))
    meta = memory.count_from_meta(json.loads((folder / "config.json").read_text()))
    assert meta is not None and meta.total == header_count.total and meta.embedding == header_count.embedding


def test_meta_count_is_exact_where_the_arithmetic_is_not() -> None:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    config = {"model_type": "gpt2", "n_embd": 32, "n_layer": 2, "n_head": 4, "vocab_size": 300, "n_positions": 64}
    torch.manual_seed(0)
    real = GPT2LMHeadModel(GPT2Config(**config))  # a real tiny model, allocated: its own count
    meta = memory.count_parameters(config)
    assert meta.source == memory.META_SOURCE and meta.exact
    assert meta.total == real.num_parameters() == sum(p.numel() for p in real.parameters())


def test_unknown_model_type_falls_back_to_the_arithmetic_and_runs_no_remote_code(tmp_path: Path) -> None:
    config = {**LLAMA_3_8B, "model_type": "my_private_llama", "auto_map": {"AutoModelForCausalLM": "boom.Model"}}
    (tmp_path / "boom.py").write_text("raise SystemExit('remote code ran')\n")
    assert memory.count_from_meta(config) is None
    count = memory.count_parameters(config)
    assert "arithmetic" in count.source and "my_private_llama" in count.source and not count.exact
    assert count.total == memory.count_from_config(LLAMA_3_8B).total
    (tmp_path / "config.json").write_text(json.dumps(config))
    analysis = analyzer.analyze(str(tmp_path))
    assert "arithmetic" in analysis.parameters_source and not analysis.parameters_exact


def test_a_config_only_folder_is_counted_on_the_meta_device(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(GEMMA2_2B))
    analysis = analyzer.analyze(str(tmp_path))
    assert analysis.parameters_source == memory.META_SOURCE and analysis.parameters == 2_614_341_888
