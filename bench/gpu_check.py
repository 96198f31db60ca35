"""One prepared check of the GPU backends on a CUDA machine, in under 8 minutes and without a network.

It builds what it needs: a small random Llama with a byte-level BPE tokenizer trained on this repository's docs
(no weights can be downloaded there), and, when exllamav2 / exllamav3 import, EXL2 and EXL3 copies of it made
with the libraries' own converters. Then, through textgen's backends, it loads the model with transformers in
fp16, in bitsandbytes 4-bit and with ``--gpu-memory`` offload, checks how a GPTQ checkpoint is received, and
loads the EXL2 and EXL3 copies; each one generates (tokens/s), streams (first token before the last), is
cancelled mid-way (and generates again), and, with parallel slots, runs two generations at once. It prints one
table (backend, tokens/s, VRAM, pass/fail with the reason) and writes it as JSON to ``$OUT`` (or bench/results).

On a machine without CUDA it says "no CUDA" and exits 0. ``--cpu`` runs the transformers stage on the CPU, to check
the script itself.

The device machine has PyTorch, transformers, accelerate, tokenizers and nvcc but not pydantic, xgrammar,
bitsandbytes or the ExLlama libraries; bring them as wheels (``bash bench/gpu_wheels.sh transformers`` or
``exllama`` here puts one set, under the 64 MiB a run carries, in ``.whl/``), then run::

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \\
        .whl/*.whl && export PYTHONPATH=/tmp/site; PYTHONUNBUFFERED=1 python3 bench/gpu_check.py --only transformers

exllamav2 and exllamav3 ship as pure-Python wheels that compile their CUDA extension on first import (28 and 177
CUDA files); the script starts both builds at once for this GPU's architecture only, waits for them as long as
the time budget allows, and reports a build that did not finish as such. Without flash-attn >= 2.5.7 (PyPI has it
only as source) ExLlamaV2 runs unpaged, one generation at a time, and says so.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


@dataclass
class Row:
    """One line of the table."""

    backend: str
    tokens_per_s: float | None = None
    vram_mib: float | None = None
    ok: bool = False
    reason: str = ""


class Budget:
    """Seconds left of the run."""

    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()


# ---------------------------------------------------------------------------------------------- the tiny model
def build_tiny_model(folder: Path) -> Path:
    """A random 4-layer Llama (hidden 512, vocabulary 4096) with a BPE tokenizer trained on the repo's docs."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    folder.mkdir(parents=True, exist_ok=True)
    texts = [p.read_text(encoding="utf-8", errors="replace") for p in [ROOT / "README.md", *ROOT.glob("docs/*.md")]]
    bpe = Tokenizer(models.BPE(unk_token=None))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=4096, special_tokens=["<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    bpe.train_from_iterator(texts * 4, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="</s>")
    tokenizer.save_pretrained(folder)
    config = LlamaConfig(
        vocab_size=4096, hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=4, max_position_embeddings=2048, bos_token_id=0, eos_token_id=1, tie_word_embeddings=False,
        torch_dtype="float16",
    )  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.float16)
    model.save_pretrained(folder, safe_serialization=True)
    model.generation_config.save_pretrained(folder)
    return folder


# ---------------------------------------------------------------------------------------------- exercising a backend
def exercise(backend: Any, row: Row, parallel: bool) -> None:
    """Generate (tokens/s), stream, cancel, generate again, and (with slots) run two at once; fill in ``row``."""
    from modules.generation.params import GenerationParams

    prompt = backend.encode("The model loader reads the settings and")
    params = GenerationParams(temperature=0, max_new_tokens=64, ban_eos=True)
    started = time.perf_counter()
    arrivals: list[float] = []
    events = []
    for event in backend.generate(prompt, params, threading.Event()):
        arrivals.append(time.perf_counter())
        events.append(event)
    tokens = [e for e in events if e.token_id >= 0]
    if len(tokens) != 64 or events[-1].finish_reason != "length":
        raise AssertionError(f"asked for 64 tokens, got {len(tokens)} ending {events[-1].finish_reason!r}")
    if len(tokens) > 1 and arrivals[-1] > arrivals[0]:
        row.tokens_per_s = (len(tokens) - 1) / (arrivals[len(tokens) - 1] - arrivals[0])
    first = arrivals[0] - started
    if first > (arrivals[-1] - started) / 2:
        raise AssertionError(f"not streamed: the first token came after {first:.2f} s of {arrivals[-1] - started:.2f}")
    cancel = threading.Event()
    count, cancelled_at, reason = 0, 0.0, None
    for event in backend.generate(prompt, GenerationParams(temperature=0.8, max_new_tokens=1000, ban_eos=True), cancel):
        count += 1
        if count == 5:
            cancel.set()
            cancelled_at = time.perf_counter()
        reason = event.finish_reason or reason
    stop_s = time.perf_counter() - cancelled_at
    if reason != "cancelled" or count > 50 or stop_s > 2:
        raise AssertionError(f"cancel: {count} events, ended {reason!r} {stop_s:.2f} s after Stop")
    again = [e for e in backend.generate(prompt, params, threading.Event()) if e.token_id >= 0]
    if len(again) != 64:
        raise AssertionError("no generation after a cancelled one")
    notes = [f"first token {first * 1000:.0f} ms", f"Stop took {stop_s * 1000:.0f} ms"]
    if parallel and backend.max_parallel > 1:
        out: list[int] = []
        workers = [
            threading.Thread(
                target=lambda: out.append(
                    sum(e.token_id >= 0 for e in backend.generate(prompt, params, threading.Event()))
                )
            )
            for _ in range(2)
        ]
        for w in workers:
            w.start()
        for w in workers:
            w.join(60)
        if out != [64, 64]:
            raise AssertionError(f"two at once gave {out}")
        notes.append(f"{backend.max_parallel} slots, 2 at once")
    elif parallel:
        notes.append("one slot")
    row.ok, row.reason = True, "; ".join(notes)


def stage(name: str, rows: list[Row], budget: Budget, need: float, run: Any) -> None:
    """Run one stage with the time left; any failure becomes the row's reason."""
    import torch

    row = Row(name)
    rows.append(row)
    if budget.left() < need:
        row.reason = f"skipped: {budget.left():.0f} s left, needs about {need:.0f}"
        return
    started = time.monotonic()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    try:
        run(row)
    except Exception as exc:  # the table says what failed; the run goes on
        row.ok, row.reason = False, f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
    if torch.cuda.is_available():
        row.vram_mib = torch.cuda.max_memory_allocated() / 2**20
    print(f"  {name}: {'pass' if row.ok else 'FAIL'} in {time.monotonic() - started:.0f} s ({row.reason})", flush=True)


def transformers_stage(path: Path, options: dict[str, Any], check: Any = None) -> Any:
    def run(row: Row) -> None:
        from modules.loaders.transformers import TransformersBackend

        backend = TransformersBackend.load(path, options)
        try:
            if check is not None:
                check(backend)
            exercise(backend, row, parallel=False)
        finally:
            backend.unload()

    return run


def offloaded(backend: Any) -> None:
    placement = set(map(str, getattr(backend.model, "hf_device_map", {}).values()))
    if not ({"cpu"} & placement and placement - {"cpu", "disk"}):
        raise AssertionError(f"--gpu-memory did not split the model: {sorted(placement)}")


def gptq_stage(tmp: Path) -> Any:
    def run(row: Row) -> None:
        from transformers import AutoConfig

        from modules.errors import BackendUnavailable
        from modules.loaders import prequantized

        folder = tmp / "tiny-gptq-config"
        folder.mkdir(exist_ok=True)
        config = json.loads((tmp / "tiny-hf" / "config.json").read_text())
        config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False}
        (folder / "config.json").write_text(json.dumps(config))
        try:
            label = prequantized.check(AutoConfig.from_pretrained(str(folder)), folder.name)
        except BackendUnavailable as exc:
            row.ok, row.reason = True, f"refused clearly (no checkpoint to load): {exc}"[:200]
            return
        row.ok, row.reason = True, f"{label}: its libraries import (no GPTQ checkpoint here to load)"

    return run


# ---------------------------------------------------------------------------------------------- ExLlama
def start_builds(arch: str) -> dict[str, subprocess.Popen[bytes]]:
    """Compile the ExLlama extensions in the background (they build on first import)."""
    env = {**os.environ, "TORCH_CUDA_ARCH_LIST": arch, "MAX_JOBS": str(max(2, (os.cpu_count() or 4) // 2))}
    builds = {}
    for lib in ("exllamav2", "exllamav3"):
        if importlib.util.find_spec(lib) is not None:
            log = open(Path(tempfile.gettempdir()) / f"{lib}-build.log", "wb")
            builds[lib] = subprocess.Popen(
                [sys.executable, "-c", f"import {lib}.ext"], stdout=log, stderr=subprocess.STDOUT, env=env
            )
    return builds


def wait_build(lib: str, builds: dict[str, subprocess.Popen[bytes]], budget: Budget, reserve: float) -> None:
    proc = builds.get(lib)
    if proc is None:
        raise ModuleNotFoundError(f"{lib} is not installed (carry its wheel: bench/gpu_wheels.sh exllama)")
    try:
        proc.wait(timeout=max(1.0, budget.left() - reserve))
    except subprocess.TimeoutExpired:
        proc.kill()
        raise TimeoutError(f"{lib}'s CUDA extension was still compiling when the time budget ran out") from None
    if proc.returncode != 0:
        log = (Path(tempfile.gettempdir()) / f"{lib}-build.log").read_text(errors="replace").strip().splitlines()
        raise RuntimeError(f"{lib} did not build: {log[-1] if log else proc.returncode}")


def convert(command: list[str], budget: Budget, reserve: float, log: Path) -> None:
    with open(log, "wb") as out:
        done = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, timeout=max(1.0, budget.left() - reserve))
    if done.returncode != 0:
        raise RuntimeError(f"conversion failed: {log.read_text(errors='replace').strip().splitlines()[-1:]}")


def exllama_stage(lib: str, hf: Path, tmp: Path, builds: dict[str, Any], budget: Budget) -> Any:
    def run(row: Row) -> None:
        wait_build(lib, builds, budget, reserve=60)
        out, work = tmp / f"tiny-{lib}", tmp / f"work-{lib}"
        if lib == "exllamav2":
            command = ["-m", "exllamav2.conversion.convert_exl2", "-i", str(hf), "-o", str(work), "-cf", str(out)]
            command += ["-b", "4.0", "-hb", "6", "-l", "256", "-ml", "256", "-r", "8", "-mr", "4"]
        else:
            command = ["-m", "exllamav3.conversion.convert_model", "-i", str(hf), "-w", str(work), "-o", str(out)]
            command += ["-b", "4", "-cr", "8", "-cc", "256"]
        convert([sys.executable, *command], budget, 30, tmp / f"{lib}-convert.log")
        if lib == "exllamav2":
            from modules.loaders.exllamav2 import ExLlamaV2Backend as Backend
        else:
            from modules.loaders.exllamav3 import ExLlamaV3Backend as Backend  # type: ignore[assignment]
        backend = Backend.load(out, {"parallel": 2, "cache_type": "q4", "max_seq_len": 1024})
        try:
            exercise(backend, row, parallel=True)
            if lib == "exllamav2" and not backend.paged:
                row.reason += " (no flash-attn >= 2.5.7: unpaged)"
        finally:
            backend.unload()

    return run


# ---------------------------------------------------------------------------------------------- main
def table(rows: list[Row]) -> str:
    lines = [f"{'backend':<24} {'tokens/s':>9} {'VRAM MiB':>9}  result", "-" * 100]
    for r in rows:
        speed = f"{r.tokens_per_s:.1f}" if r.tokens_per_s else "-"
        vram = f"{r.vram_mib:.0f}" if r.vram_mib is not None else "-"
        lines.append(f"{r.backend:<24} {speed:>9} {vram:>9}  {'pass' if r.ok else 'FAIL'}: {r.reason}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--budget", type=float, default=470, help="seconds for the whole run (default 470)")
    parser.add_argument("--only", choices=["all", "transformers", "exllama"], default="all")
    parser.add_argument("--cpu", action="store_true", help="run the transformers stage on the CPU (checks the script)")
    args = parser.parse_args(argv)
    budget = Budget(args.budget)
    try:
        import torch
    except ImportError:
        print("no CUDA: PyTorch is not installed here; nothing to check")
        return 0
    if not torch.cuda.is_available() and not args.cpu:
        print("no CUDA: this machine has no CUDA GPU, so there is nothing to check; run this on a CUDA machine")
        return 0
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    rows: list[Row] = []
    builds: dict[str, Any] = {}
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        print(f"{torch.cuda.get_device_name()} (sm_{major}{minor}), torch {torch.__version__}", flush=True)
        if args.only in ("all", "exllama"):
            builds = start_builds(f"{major}.{minor}")
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as scratch:
        tmp = Path(scratch)
        hf = build_tiny_model(tmp / "tiny-hf")
        print(f"tiny model built in {args.budget - budget.left():.0f} s", flush=True)
        if args.only in ("all", "transformers"):
            if args.cpu:
                stage("transformers fp32 (cpu)", rows, budget, 20, transformers_stage(hf, {"cpu": True}))
            else:
                stage("transformers fp16", rows, budget, 20, transformers_stage(hf, {"dtype": "float16"}))
                four_bit = {"load_in_4bit": True, "compute_dtype": "float16", "dtype": "float16"}
                stage("transformers bnb 4-bit", rows, budget, 20, transformers_stage(hf, four_bit))
                offload = {"dtype": "float16", "gpu_memory": ["20MiB"], "cpu_memory": "8GiB"}
                stage("transformers offload", rows, budget, 30, transformers_stage(hf, offload, offloaded))
            stage("transformers GPTQ", rows, budget, 5, gptq_stage(tmp))
        if args.only in ("all", "exllama") and not args.cpu:
            stage("exllamav2 (EXL2 4.0)", rows, budget, 90, exllama_stage("exllamav2", hf, tmp, builds, budget))
            stage("exllamav3 (EXL3 4.0)", rows, budget, 90, exllama_stage("exllamav3", hf, tmp, builds, budget))
        for proc in builds.values():
            if proc.poll() is None:
                proc.kill()
    print()
    print(table(rows))
    results = Path(os.environ.get("OUT") or ROOT / "bench" / "results")
    results.mkdir(parents=True, exist_ok=True)
    (results / "gpu_check.json").write_text(json.dumps([asdict(r) for r in rows], indent=2))
    return 0 if all(r.ok for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
