"""The memory estimate of the default model against what loading it takes, measured in a fresh process."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.conftest import DEFAULT_MODEL, ROOT, default_model_path

MEASURE = """
import json, sys, threading
from modules import models, shared
from modules.generation.params import GenerationParams
from modules.lifecycle import analyzer, memory, smart_config
from modules.loaders import llama_cpp
from modules.settings import load_settings

shared.init(load_settings(["--model-dir", sys.argv[1], "--user-data-dir", sys.argv[2]], env={}))
llama_cpp._init_backend(False)  # the engine's one-time start-up is not the model's memory
before = memory.process_rss()
backend = models.load_model(sys.argv[3])
for _ in backend.generate(backend.encode("The capital of France is"), GenerationParams(max_new_tokens=8),
                          threading.Event()):
    pass  # a reply touches every weight page
after = memory.process_rss()
analysis = analyzer.analyze_gguf(backend.path)
estimate = smart_config.estimate(analysis, "llama.cpp", shared.model_options)
print(json.dumps({"measured": after - before, "estimate": estimate.ram, "shown": memory.last_load.rss_increase,
                  "n_ctx": shared.model_options["n_ctx"], "parallel": shared.model_options["parallel"]}))
"""


def test_default_model_estimate_is_within_15_percent_of_its_rss_increase(tmp_path: Path) -> None:
    models = tmp_path / "models"
    models.mkdir()
    (models / DEFAULT_MODEL).symlink_to(default_model_path())
    done = subprocess.run(
        [sys.executable, "-c", MEASURE, str(models), str(tmp_path / "ud"), DEFAULT_MODEL],
        cwd=ROOT, capture_output=True, text=True, timeout=180, env={"PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    print(result)
    assert (result["n_ctx"], result["parallel"]) == (4096, 4)  # the defaults: a 360 MiB KV cache, most of it
    assert abs(result["estimate"] - result["measured"]) <= 0.15 * result["measured"]
    assert abs(result["shown"] - result["measured"]) <= 0.15 * result["measured"]  # what the Model tab shows
