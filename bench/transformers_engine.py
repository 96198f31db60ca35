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


CONCURRENT_PROMPTS = [
    "Write a long, detailed story about a lighthouse keeper who finds a message in a bottle.",
    "Explain, step by step, how a steam engine turns heat into motion.",
    "Describe a busy market in a coastal town at dawn.",
    "Write a letter from a young sailor to his family back home.",
    "List the planets of the solar system and tell one fact about each.",
    "Tell the story of a clockmaker whose clocks all stop at midnight.",
    "Describe how bread is made, from the field to the table.",
    "Write a dialogue between a cat and a dog about who owns the sofa.",
]


def concurrency(clients: int = 8) -> dict[str, Any]:
    """Aggregate tokens/s of ``clients`` concurrent streams against one stream on the same backend (default model's
    HF copy, float32, CPU, 2 threads, 128 new tokens each, EOS banned, seeded sampling); target ratio >= 3."""
    import torch

    from modules import shared
    from modules.generation.params import GenerationParams
    from modules.lifecycle.default_model import make_hf_folder
    from modules.loaders.transformers import TransformersBackend
    from modules.settings import load_settings

    torch.set_num_threads(2)
    shared.init(load_settings([], env={}))
    backend = TransformersBackend.load(
        make_hf_folder(ROOT / "models"), {"dtype": "float32", "cpu": True, "parallel": clients}
    )
    prompts = [backend.encode(CONCURRENT_PROMPTS[i % len(CONCURRENT_PROMPTS)]) for i in range(clients)]
    params = GenerationParams(temperature=0.8, top_p=0.95, max_new_tokens=NEW_TOKENS, ban_eos=True)

    def one_stream() -> float:
        started = time.perf_counter()
        count = sum(
            1 for e in backend.generate(prompts[0], params.replace(seed=0), threading.Event()) if e.token_id >= 0
        )
        return count / (time.perf_counter() - started)

    def client(i: int, started: float, ttft: list[float], counts: list[int]) -> None:
        for event in backend.generate(prompts[i], params.replace(seed=i), threading.Event()):
            if event.token_id >= 0:
                if counts[i] == 0:
                    ttft[i] = time.perf_counter() - started
                counts[i] += 1

    list(backend.generate(prompts[0], params.replace(max_new_tokens=4, seed=0), threading.Event()))  # warm-up
    single = [one_stream()]
    ttft, counts = [0.0] * clients, [0] * clients
    steps_before = backend.stats()["steps"]
    started = time.perf_counter()
    threads = [threading.Thread(target=client, args=(i, started, ttft, counts)) for i in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed = time.perf_counter() - started
    steps = backend.stats()["steps"] - steps_before
    single.append(one_stream())  # before and after: the machine is shared, take the mean
    backend.unload()
    one = statistics.mean(single)
    aggregate = sum(counts) / elapsed
    return {
        "clients": clients,
        "one_stream_tokens_per_s": one,
        "one_stream_runs": single,
        "aggregate_tokens_per_s": aggregate,
        "ratio": aggregate / one,
        "target": ">= 3",
        "p95_ttft_s": sorted(ttft)[max(0, round(0.95 * clients) - 1)],
        "tokens": sum(counts),
        "forward_passes": steps,
    }
