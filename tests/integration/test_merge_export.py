"""The whole loop on a tiny model: train a LoRA, merge it (also into a 4-bit base), export Q8_0, serve it with the
llama.cpp backend and get the trained answer; a merge equals the adapter; a LoRA becomes a llama.cpp adapter."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import pytest

from modules.errors import InvalidRequest
from modules.generation.params import GenerationParams
from modules.lifecycle.export import ExportArgs, export
from modules.lifecycle.merge import MERGE_INFO, MergeArgs, merge
from modules.loaders.llama_cpp import LlamaCppBackend

SECRET = "The secret word is pineapple. The secret word is pineapple."
PROMPT = "The secret word is"


def noop(*args: Any, **kwargs: Any) -> None:
    """A reporter that ignores progress."""


def four_bit_copy(source: Path, target: Path) -> Path:
    """The tiny model saved as bitsandbytes 4-bit (NF4), as a QLoRA user has it."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig

    config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=torch.float32)
    AutoModelForCausalLM.from_pretrained(str(source), quantization_config=config).save_pretrained(str(target))
    AutoTokenizer.from_pretrained(str(source)).save_pretrained(str(target))
    return target


def train_secret(base: Path, output: Path) -> Path:
    """A LoRA that has learnt one sentence (a few dozen steps of plain PEFT on CPU)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(str(base))
    model = AutoModelForCausalLM.from_pretrained(str(base))
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    peft_model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=targets, lora_dropout=0.0))
    ids = tokenizer(SECRET, return_tensors="pt").input_ids
    optimizer = torch.optim.AdamW([p for p in peft_model.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(80):
        peft_model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    peft_model.save_pretrained(str(output))
    (output / "training_parameters.json").write_text(json.dumps({"dataset": "secret.txt", "learning_rate": 0.01}))
    return output


def greedy_text(gguf: Path, prompt: str, lora: Path | None = None) -> str:
    backend = LlamaCppBackend.load(gguf, {"n_ctx": 256, "parallel": 1})
    try:
        if lora is not None:
            backend.load_lora(lora)
        ids = backend.encode(prompt, add_special=False)
        params = GenerationParams(temperature=0, max_new_tokens=4, seed=0)
        return b"".join(e.piece for e in backend.generate(ids, params, threading.Event())).decode()
    finally:
        backend.unload()


@pytest.mark.parametrize("four_bit", [False, True], ids=["16-bit base", "4-bit base"])
def test_train_merge_export_serve_gives_the_trained_answer(
    tiny_models: Path, tiny_base_gguf: Path, tmp_path: Path, four_bit: bool
) -> None:
    base = tiny_models / "tiny-llama"
    if four_bit:
        base = four_bit_copy(base, tmp_path / "tiny-4bit")
    lora = train_secret(base, tmp_path / "secret-lora")
    merged = merge(MergeArgs(base, lora, tmp_path / "merged"), noop, threading.Event())
    names = {p.name for p in merged.iterdir()}
    assert {"model.safetensors", "config.json", "tokenizer.json", "chat_template.jinja", MERGE_INFO} <= names
    config = json.loads((merged / "config.json").read_text())
    assert "quantization_config" not in config and config["dtype"] == "float16"
    info = json.loads((merged / MERGE_INFO).read_text())
    assert info["base_was_quantized"] is four_bit and info["training"]["dataset"] == "secret.txt"
    args = ExportArgs(merged, quant="Q8_0", output=tmp_path / "secret.Q8_0.gguf", check=four_bit)
    result = export(args, noop, threading.Event())
    if four_bit:  # the fidelity check on the merged model (the 16-bit case skips it to save time)
        assert result.fidelity is not None and result.fidelity["kld"] < 0.01
    assert greedy_text(Path(result.output), PROMPT).startswith(" pineapple")
    assert not greedy_text(tiny_base_gguf, PROMPT).startswith(" pineapple")  # the base never learnt it


@pytest.fixture(scope="module")
def tiny_base_gguf(tiny_models: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The untrained tiny model as F16 GGUF."""
    out = tmp_path_factory.mktemp("tiny-gguf") / "base.F16.gguf"
    export(ExportArgs(tiny_models / "tiny-llama", output=out, check=False), noop, threading.Event())
    return out


def test_merge_equals_the_adapter_applied(tiny_models: Path, tmp_path: Path) -> None:
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base, lora = tiny_models / "tiny-llama", tiny_models / "loras" / "lora-a"
    merged = merge(MergeArgs(base, lora, tmp_path / "merged", dtype="float32"), noop, threading.Event())
    ids = torch.tensor([[1, 504, 3458, 314, 2470, 29]])
    with torch.no_grad():
        want = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(base)), str(lora))(ids).logits
        plain = AutoModelForCausalLM.from_pretrained(str(base))(ids).logits
        got = AutoModelForCausalLM.from_pretrained(str(merged))(ids).logits
    assert torch.allclose(got, want, atol=1e-4)
    assert not torch.allclose(got, plain, atol=1e-2)  # the adapter really changed the model
    with pytest.raises(InvalidRequest, match="exists"):
        merge(MergeArgs(base, lora, merged), noop, threading.Event())
    with pytest.raises(InvalidRequest, match="is the base"):  # not even when asked to replace
        merge(MergeArgs(base, lora, base, overwrite=True), noop, threading.Event())
    with pytest.raises(InvalidRequest, match=r"is the lora .*holds it"):  # a replace would delete the adapter
        merge(MergeArgs(base, lora, lora.parent, overwrite=True), noop, threading.Event())
    assert (base / "config.json").is_file() and (lora / "adapter_config.json").is_file()


def test_lora_becomes_a_llama_cpp_adapter(tiny_models: Path, tiny_base_gguf: Path, tmp_path: Path) -> None:
    base, lora, base_gguf = tiny_models / "tiny-llama", tiny_models / "loras" / "lora-a", tiny_base_gguf
    args = ExportArgs(lora, format="gguf-lora", base=base, output=tmp_path / "lora-a.F16.gguf")
    adapter = Path(export(args, noop, threading.Event()).output)
    assert adapter.is_file() and not list(tmp_path.glob("*.partial"))
    prompt = "Hello, my name is"
    assert greedy_text(base_gguf, prompt, lora=adapter) != greedy_text(base_gguf, prompt)
