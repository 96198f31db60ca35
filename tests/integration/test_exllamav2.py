"""ExLlamaV2: detection from an EXL2 quantization config, a clear refusal without CUDA, and (on a GPU) real runs."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest

from modules import models, shared
from modules.errors import BackendUnavailable
from modules.generation.params import GenerationParams


def fake_exl2(folder: Path) -> Path:
    folder.mkdir(parents=True)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "max_position_embeddings": 2048,
        "quantization_config": {"quant_method": "exl2", "bits": 4.0},
    }
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_exl2_without_cuda_is_refused_clearly(hub: object, models_dir: Path) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    fake_exl2(models_dir / "model-exl2")
    assert models.list_models()[0].loader == "exllamav2"
    with pytest.raises(BackendUnavailable, match="CUDA GPU"):
        models.load_model("model-exl2")
    assert shared.model is None and shared.loading_model is None


@pytest.mark.gpu
def test_exl2_generates_and_batches_on_a_gpu(hub: object) -> None:
    """Needs TEXTGEN_EXL2_MODEL: a folder holding an EXL2 model (no download happens in tests)."""
    folder = os.environ.get("TEXTGEN_EXL2_MODEL")
    if not folder:
        pytest.skip("set TEXTGEN_EXL2_MODEL to an EXL2 model folder")
    path = Path(folder)
    shared.settings.model_dir = path.parent
    backend = models.load_model(path.name, {"parallel": 4, "cache_8bit": True})
    ids = backend.encode("The capital of France is")
    results: dict[int, list[int]] = {}

    def run(i: int) -> None:
        events = backend.generate(ids, GenerationParams(temperature=0, max_new_tokens=16), threading.Event())
        results[i] = [e.token_id for e in events if e.token_id >= 0]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(len(r) == 16 for r in results.values()) and len({tuple(r) for r in results.values()}) == 1
