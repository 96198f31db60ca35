"""transformers backend benchmark: textgen's pipeline against raw ``model.generate`` on the same loaded model,
128 new tokens, greedy, end-of-sequence never chosen; runs alternate, medians compared (target ratio >= 0.95)."""

from __future__ import annotations

import statistics
import threading
import time
from typing import Any

from bench.common import ROOT

NEW_TOKENS = 128
PROMPT = "Write a long, detailed story about a lighthouse keeper who finds a message in a bottle."


def pipeline_vs_generate(rounds: int = 5) -> dict[str, Any]:
    import torch

    from modules import shared
    from modules.generation.params import GenerationParams
    from modules.generation.pipeline import generate_text
    from modules.lifecycle.default_model import make_hf_folder
    from modules.loaders.transformers import TransformersBackend
    from modules.settings import load_settings

    shared.init(load_settings([], env={}))
    backend = TransformersBackend.load(make_hf_folder(ROOT / "models"), {"dtype": "float32"})
    model, tokenizer = backend.model, backend.tokenizer
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    eos = list(backend.metadata.eos_token_ids)
    params = GenerationParams(temperature=0, max_new_tokens=NEW_TOKENS, ban_eos=True)
    raw: list[float] = []
    ours: list[float] = []
    with torch.inference_mode():
        model.generate(ids, max_new_tokens=4, do_sample=False)
        generate_text(ids[0].tolist(), params.replace(max_new_tokens=4), backend=backend)
        for _ in range(rounds):
            started = time.perf_counter()
            out = model.generate(
                ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False, suppress_tokens=eos
            )
            raw.append((out.shape[1] - ids.shape[1]) / (time.perf_counter() - started))
            started = time.perf_counter()
            _, stats = generate_text(ids[0].tolist(), params, backend=backend, cancel=threading.Event())
            ours.append(stats.new_tokens / (time.perf_counter() - started))
    backend.unload()
    r, o = statistics.median(raw), statistics.median(ours)
    return {
        "raw_generate_tokens_per_s": r,
        "textgen_tokens_per_s": o,
        "ratio": o / r,
        "target": ">= 0.95",
        "raw_runs": raw,
        "textgen_runs": ours,
    }
