"""ExLlamaV2/V3: detection from an EXL2/EXL3 quantization config, a clear refusal without the library or CUDA,
and (on a GPU) real runs."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest

from modules import models, shared
from modules.errors import BackendUnavailable
from modules.generation.params import GenerationParams


def fake_exl(folder: Path, method: str = "exl2") -> Path:
    folder.mkdir(parents=True)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "max_position_embeddings": 2048,
        "quantization_config": {"quant_method": method, "bits": 4.0},
    }
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize(("method", "loader"), [("exl2", "exllamav2"), ("exl3", "exllamav3")])
def test_exl_without_the_library_or_cuda_is_refused_clearly(
    hub: object, models_dir: Path, method: str, loader: str
) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    fake_exl(models_dir / f"model-{method}", method)
    assert models.list_models()[0].loader == loader
    with pytest.raises(BackendUnavailable, match=f"needs the Python package '{loader}'|CUDA GPU"):
        models.load_model(f"model-{method}")
    assert shared.model is None and shared.loading_model is None


@pytest.mark.gpu
@pytest.mark.parametrize("variable", ["TEXTGEN_EXL2_MODEL", "TEXTGEN_EXL3_MODEL"])
def test_exl_generates_and_batches_on_a_gpu(hub: object, variable: str) -> None:
    """Needs TEXTGEN_EXL2_MODEL / TEXTGEN_EXL3_MODEL: a folder holding such a model (nothing is downloaded)."""
    folder = os.environ.get(variable)
    if not folder:
        pytest.skip(f"set {variable} to a model folder")
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
