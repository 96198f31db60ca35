"""The same weights in llama.cpp (an F16 GGUF) and in transformers give the same greedy tokens."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from modules.generation.params import GenerationParams
from modules.lifecycle.gguf import read_metadata
from modules.lifecycle.quantize import QuantizeArgs, quantize
from modules.loaders.llama_cpp import LlamaCppBackend
from modules.loaders.transformers import TransformersBackend
from tests.conftest import default_model_path

PROMPTS = [
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
    "The history of the printing press begins",
    "def fibonacci(n):\n",
    "<|im_start|>user\nList three fruits.<|im_end|>\n<|im_start|>assistant\n",
]
TOKENS = 32


@pytest.fixture(scope="module")
def f16_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("f16")
    args = QuantizeArgs(default_model_path(), folder / "SmolLM2-135M-Instruct.F16.gguf", "F16")
    path = quantize(args, lambda *a, **k: None, threading.Event())
    assert read_metadata(path).extra["file_type"] == 1
    return path


def greedy(backend, prompt: str) -> list[int]:  # type: ignore[no-untyped-def]
    ids = backend.encode(prompt, add_special=False)
    params = GenerationParams(temperature=0, max_new_tokens=TOKENS, ban_eos=True, seed=0)
    return [e.token_id for e in backend.generate(ids, params, threading.Event()) if e.token_id >= 0]


def test_llama_cpp_and_transformers_agree_on_greedy_tokens(f16_gguf: Path) -> None:
    llama = LlamaCppBackend.load(f16_gguf, {"n_ctx": 512, "parallel": 1})
    try:
        expected = {p: greedy(llama, p) for p in PROMPTS}
        prompt_ids = {p: llama.encode(p, add_special=False) for p in PROMPTS}
    finally:
        llama.unload()
    torch_backend = TransformersBackend.load(f16_gguf, {"n_ctx": 512, "dtype": "float32"})
    try:
        for prompt in PROMPTS:
            assert torch_backend.encode(prompt, add_special=False) == prompt_ids[prompt], "the tokenizers differ"
            got = greedy(torch_backend, prompt)
            assert len(got) == TOKENS
            assert got == expected[prompt], (
                f"first difference at token {next(i for i, (a, b) in enumerate(zip(got, expected[prompt], strict=True)) if a != b)} for {prompt!r}"
            )
    finally:
        torch_backend.unload()
