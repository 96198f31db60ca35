"""A plan for loading one model on this machine: loader, quantization, context length, GPU layers, threads and
batch, each with a one-line reason, the memory it expects, and, when it will not fit, what would.

``make_plan`` is pure (an :class:`~modules.lifecycle.analyzer.Analysis` and a
:class:`~modules.lifecycle.hardware.Hardware` in, a :class:`Plan` out), so plans for other machines can be tested.
``--auto`` applies a plan's options under the user's own settings (see :func:`apply`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from modules.lifecycle import memory
from modules.lifecycle.analyzer import Analysis
from modules.lifecycle.hardware import Hardware
from modules.lifecycle.memory import MemoryEstimate, MiB, ParamCount

log = logging.getLogger(__name__)

RAM_SHARE = 0.85  # of the available RAM a plan may use (the OS, the UI and the browser need the rest)
VRAM_SHARE = 0.90
CTX_CAP = 4096  # as the per-model defaults: the model's own context, capped
MIN_CTX = 512
GGUF_ALTERNATIVES = ("Q8_0", "Q6_K", "Q5_K_M", "Q4_K_M", "Q3_K_M", "Q2_K")


@dataclass
class Choice:
    """One setting of the plan and why."""

    setting: str
    value: Any
    reason: str


@dataclass
class Plan:
    """How to load the model here, and what that takes."""

    target: str
    loader: str | None
    fits: bool
    choices: list[Choice] = field(default_factory=list)
    memory: MemoryEstimate | None = None
    ram_budget: int = 0
    gpu_budget: int = 0
    refused: str | None = None  # why it must not be loaded as it is (remote code, no CUDA for EXL2)
    would_fit: list[str] = field(default_factory=list)  # when it does not fit: what would
    notes: list[str] = field(default_factory=list)

    def options(self) -> dict[str, Any]:
        """The plan as server settings (``loader``, ``n_ctx``, ``n_gpu_layers``, ...)."""
        values = {c.setting: c.value for c in self.choices}
        if self.loader:
            values["loader"] = self.loader
        return values

    def to_dict(self) -> dict[str, Any]:
        """What ``recommend --json`` prints."""
        return {
            "target": self.target,
            "loader": self.loader,
            "fits": self.fits,
            "refused": self.refused,
            "choices": [{"setting": c.setting, "value": c.value, "reason": c.reason} for c in self.choices],
            "options": self.options(),
            "memory": self.memory.to_dict() if self.memory else None,
            "ram_budget": self.ram_budget,
            "gpu_budget": self.gpu_budget,
            "would_fit": list(self.would_fit),
            "notes": list(self.notes),
        }

    def summary(self) -> str:
        """Readable lines: the verdict, each choice with its reason, the memory."""
        if self.refused:
            head = f"{self.target}: will not load as it is: {self.refused}"
        elif self.fits:
            head = f"{self.target}: fits, with {self.loader}"
        else:
            head = f"{self.target}: will not fit in {self.ram_budget / 2**30:.1f} GiB of RAM"
            head += f" + {self.gpu_budget / 2**30:.1f} GiB of VRAM" if self.gpu_budget else ""
        lines = [head] + [f"  {c.setting} = {c.value}: {c.reason}" for c in self.choices]
        if self.memory:
            lines.append(f"expected memory: {self.memory.text()}")
        lines += [f"would fit: {w}" for w in self.would_fit] + [f"note: {n}" for n in self.notes]
        return "\n".join(lines)


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / MiB:,.0f} MiB"


def estimate(analysis: Analysis, loader: str, options: dict[str, Any]) -> MemoryEstimate | None:
    """What loading ``analysis`` with ``loader`` and these settings takes (None when it cannot be told)."""
    shape = analysis.shape
    if shape is None or not analysis.parameters:
        return None
    n_ctx = int(options.get("n_ctx") or min(analysis.context_length or CTX_CAP, CTX_CAP))
    if loader == "llama.cpp":
        weights = analysis.weight_bytes or int(analysis.parameters * memory.GGUF_FILE_TYPE_BPW["Q4_K_M"] / 8)
        return memory.estimate_llama_cpp(
            weights,
            shape,
            n_ctx,
            int(options.get("parallel") or 1),
            int(options.get("n_batch") or 512),
            int(options.get("n_gpu_layers") or 0),
        )
    if loader == "transformers":
        per = _transformers_bytes(analysis, options)
        compute_dtype = str(options.get("compute_dtype") or "float32")
        kv_value = memory.bytes_per_weight(compute_dtype) if _quantized(options) else per
        count = ParamCount(analysis.parameters, analysis.active_parameters or analysis.parameters, 0, "")
        on_gpu = not options.get("cpu") and bool(options.get("_gpu"))
        parallel = int(options.get("parallel") or 1)
        return memory.estimate_transformers(count, shape, per, n_ctx, kv_value, on_gpu, parallel)
    return None


def _quantized(options: dict[str, Any]) -> bool:
    return bool(options.get("load_in_4bit") or options.get("load_in_8bit"))


def _transformers_bytes(analysis: Analysis, options: dict[str, Any]) -> float:
    """Bytes per parameter once loaded (4-bit: the quantized linear layers plus embeddings at the compute dtype)."""
    params = analysis.parameters or 1
    embed_share = min(1.0, ((analysis.embedding_parameters or 0) * (1 if analysis.tied_embeddings else 2)) / params)
    compute = memory.bytes_per_weight(str(options.get("compute_dtype") or "float32"))
    if options.get("load_in_4bit"):
        return (1 - embed_share) * 0.5625 + embed_share * compute
    if options.get("load_in_8bit"):
        return (1 - embed_share) * 1.0 + embed_share * compute
    dtype = str(options.get("dtype") or "auto")
    if dtype == "auto":
        dtype = analysis.dtype or "float32"
    try:
        return memory.bytes_per_weight(dtype)
    except ValueError:
        return 4.0


def make_plan(
    analysis: Analysis,
    hw: Hardware,
    allow_remote_code: bool = False,
    parallel: int | None = None,
    max_ctx: int = CTX_CAP,
) -> Plan:
    """The plan for ``analysis`` on ``hw``."""
    plan = Plan(target=analysis.target, loader=None, fits=False)
    plan.ram_budget = int(hw.ram_available * RAM_SHARE)
    gpus = [g for g in hw.gpus if g.kind in ("cuda", "rocm")]
    plan.gpu_budget = int(sum(g.free_bytes for g in gpus) * VRAM_SHARE)
    if analysis.remote_code and not allow_remote_code:
        plan.refused = (
            f"it needs code from the repo ({analysis.remote_code_reason}); textgen runs it only with "
            "--trust-remote-code, which executes that code with your rights"
        )
        plan.would_fit.append("--trust-remote-code, after reading the repo's code; or a GGUF of the model (llama.cpp)")
        return plan
    if analysis.format == "gguf":
        plan.loader = "llama.cpp"
        plan.choices.append(Choice("loader", "llama.cpp", "a GGUF file: llama.cpp runs it natively"))
        _plan_llama_cpp(plan, analysis, hw, parallel or 4, max_ctx)
    elif analysis.format == "exl2":
        if not hw.cuda:
            plan.refused = "EXL2 runs only on a CUDA GPU, and this machine has none"
            plan.would_fit.append("a GGUF of the same model (llama.cpp runs on the CPU)")
            return plan
        plan.loader = "exllamav2"
        plan.choices.append(Choice("loader", "exllamav2", "EXL2 weights need ExLlamaV2 (CUDA is here)"))
        plan.fits = (analysis.weight_bytes or 0) < plan.gpu_budget
        plan.memory = MemoryEstimate(analysis.weight_bytes or 0, 0, 0, 0, gpu=analysis.weight_bytes or 0)
    else:
        plan.loader = "transformers"
        plan.choices.append(Choice("loader", "transformers", "Hugging Face weights: the transformers backend"))
        _plan_transformers(plan, analysis, hw, parallel or 4, max_ctx)
    if analysis.remote_code:
        plan.choices.append(Choice("trust_remote_code", True, "allowed: the model ships its own Python code"))
    if hw.vllm and analysis.format != "exl2":
        plan.notes.append(vllm_note(hw, analysis.format))
    return plan


def vllm_note(hw: Hardware, fmt: str) -> str:
    """Whether vLLM (installed here) would serve several chats at once better than llama.cpp, from this machine's
    own measurement (``make bench ARGS=vllm``) when there is one."""
    weights = " (it needs the model's Hugging Face weights, not the GGUF)" if fmt == "gguf" else ""
    m = hw.vllm_measured
    if not m or not m.get("llama_cpp_tokens_per_s") or not m.get("textgen_vllm_tokens_per_s"):
        return (
            f"vLLM {hw.vllm} is installed (--loader vllm{weights}); whether it serves parallel chats faster than "
            "llama.cpp here is not measured yet: run `make bench ARGS=vllm`"
        )
    ours, llama = float(m["textgen_vllm_tokens_per_s"]), float(m["llama_cpp_tokens_per_s"])
    clients = int(m.get("clients", 8))
    cpu = (m.get("machine") or {}).get("cpu") or "this machine"
    where = f"`make bench ARGS=vllm` on the default 135M model, {cpu}, {str(m.get('time', ''))[:10]}".rstrip(", ")
    if ours > llama:
        return (
            f"vLLM {hw.vllm} is installed: for {clients} or so parallel chats it serves more here, {ours:.0f} tokens/s "
            f"through textgen against {llama:.0f} for llama.cpp ({where}): --loader vllm{weights}"
        )
    return (
        f"vLLM {hw.vllm} is installed, but llama.cpp serves {clients} parallel chats faster here ({llama:.0f} against "
        f"{ours:.0f} tokens/s, {where})"
    )


def _context(analysis: Analysis, max_ctx: int) -> tuple[int, str]:
    own = analysis.context_length
    if own and own <= max_ctx:
        return own, f"the model's own context ({own} tokens)"
    if own:
        return max_ctx, f"the model's {own} tokens capped at {max_ctx} (raise --n-ctx for longer chats)"
    return max_ctx, f"the model does not say; {max_ctx} tokens"


def _plan_llama_cpp(plan: Plan, analysis: Analysis, hw: Hardware, parallel: int, max_ctx: int) -> None:
    shape = analysis.shape
    layers = shape.layers if shape else 0
    n_ctx, ctx_reason = _context(analysis, max_ctx)
    options: dict[str, Any] = {"n_ctx": n_ctx, "parallel": parallel, "n_batch": 512}
    gpu_layers, gpu_reason = 0, "no GPU here" if not hw.gpus and not hw.mps else ""
    if (hw.cuda or hw.mps) and not hw.llama_cpp_gpu_offload:
        gpu_reason = "llama.cpp here is a CPU build (rebuild with CMAKE_ARGS=-DGGML_CUDA=on make llama-cpp)"
    elif hw.mps and hw.llama_cpp_gpu_offload:
        gpu_layers, gpu_reason = -1, "Apple GPU (Metal) shares the RAM: every layer on it"
    elif hw.cuda and hw.llama_cpp_gpu_offload:
        whole = estimate(analysis, "llama.cpp", {**options, "n_gpu_layers": -1})
        if whole and whole.gpu <= plan.gpu_budget:
            gpu_layers = -1
            gpu_reason = f"all {layers} layers fit in {_gib(plan.gpu_budget)} of free VRAM"
        elif whole and layers:
            per_layer = (whole.weights + whole.kv_cache) / (layers + 1)
            gpu_layers = max(0, int((plan.gpu_budget - whole.compute) / per_layer))
            gpu_reason = f"{gpu_layers} of {layers} layers fit in {_gib(plan.gpu_budget)} of VRAM; the rest on the CPU"
    options["n_gpu_layers"] = gpu_layers
    expected = estimate(analysis, "llama.cpp", options)
    while expected and expected.ram > plan.ram_budget and options["n_ctx"] > MIN_CTX:
        options["n_ctx"] //= 2
        ctx_reason = f"lowered to {options['n_ctx']} tokens so the KV cache fits in RAM"
        expected = estimate(analysis, "llama.cpp", options)
    if expected and expected.ram > plan.ram_budget and options["parallel"] > 1:
        options["parallel"] = 1
        expected = estimate(analysis, "llama.cpp", options)
    threads = max(1, min(hw.physical_cores, hw.usable_cores))
    plan.choices += [
        Choice("n_ctx", options["n_ctx"], ctx_reason),
        Choice(
            "parallel", options["parallel"], f"{options['parallel']} chats can generate at once, each with its context"
        ),
        Choice("n_gpu_layers", gpu_layers, gpu_reason or "CPU only"),
        Choice("threads", threads, f"{threads} physical cores (llama.cpp gains nothing from hyper-threads)"),
        Choice("n_batch", 512, "llama.cpp's prompt batch: fast prompt reading, a small activation buffer"),
    ]
    if analysis.quantization:
        plan.choices.append(Choice("quantization", analysis.quantization, "as in the file (requantize to change it)"))
    plan.memory = expected
    plan.fits = expected is not None and expected.ram <= plan.ram_budget and expected.gpu <= max(plan.gpu_budget, 0)
    if expected is None:
        plan.fits = (analysis.weight_bytes or 0) < plan.ram_budget
    if not plan.fits:
        _alternatives(plan, analysis, current=analysis.quantization)


def _plan_transformers(plan: Plan, analysis: Analysis, hw: Hardware, parallel: int, max_ctx: int) -> None:
    n_ctx, ctx_reason = _context(analysis, max_ctx)
    gpu = hw.cuda
    candidates: list[tuple[dict[str, Any], str]] = []
    if analysis.quantization:
        candidates.append(({}, f"already quantized ({analysis.quantization}): loaded as it is"))
    elif gpu:
        best = max((g for g in hw.gpus), key=lambda g: g.free_bytes)
        half = "bfloat16" if best.compute_capability and float(best.compute_capability) >= 8.0 else "float16"
        candidates += [
            ({"dtype": half}, f"{half} on {best.name}: full quality"),
            ({"load_in_8bit": True}, "8-bit (bitsandbytes): half of 16-bit, close in quality"),
            ({"load_in_4bit": True, "quant_type": "nf4", "compute_dtype": half}, "4-bit NF4 (bitsandbytes)"),
        ]
    else:
        small = (analysis.parameters or 0) < 3e9
        if small:
            candidates.append(({"dtype": "float32", "cpu": True}, "float32: the fastest on a CPU, and it fits"))
        candidates.append(({"dtype": "bfloat16", "cpu": True}, "bfloat16: half the memory of float32"))
        if hw.bitsandbytes:
            candidates.append(({"load_in_4bit": True, "quant_type": "nf4", "compute_dtype": "float32", "cpu": True},
                               "4-bit NF4 (bitsandbytes on the CPU): a quarter of bfloat16, slower"))  # fmt: skip
    budget = plan.gpu_budget if gpu else plan.ram_budget
    chosen: tuple[dict[str, Any], str] | None = None
    expected = None
    # each of the parallel sequences may fill its context: the best dtype for all of them, else for one
    for values, reason in candidates:  # the best quality first; for each, every chat's context, else one
        for slots in dict.fromkeys((parallel, 1)):
            expected = estimate(analysis, "transformers", {"n_ctx": n_ctx, "parallel": slots, **values, "_gpu": gpu})
            if expected is None or (expected.gpu if gpu else expected.ram) <= budget:
                chosen = (values, reason)
                break
        if chosen is not None:
            break
    plan.fits = chosen is not None
    values, reason = chosen or candidates[-1]
    if not plan.fits:
        slots = 1
        expected = estimate(analysis, "transformers", {"n_ctx": n_ctx, "parallel": slots, **values, "_gpu": gpu})
    for key, value in values.items():
        plan.choices.append(Choice(key, value, reason if key in ("dtype", "load_in_4bit", "load_in_8bit") else
                                   {"cpu": "no CUDA GPU: the CPU", "quant_type": "NF4: the better 4-bit type",
                                    "compute_dtype": "the dtype the 4-bit layers compute in"}.get(key, reason)))  # fmt: skip
    plan.choices.append(Choice("n_ctx", n_ctx, ctx_reason))
    plan.choices.append(
        Choice(
            "parallel",
            slots,
            (f"{slots} chats can generate at once, each with its context" if slots > 1 else "1 chat at a time")
            if slots == parallel or not plan.fits
            else f"1 chat at a time: {parallel} full contexts do not fit beside the weights",
        )
    )
    plan.memory = expected
    if not plan.fits:
        _alternatives(plan, analysis, current=None)


def _alternatives(plan: Plan, analysis: Analysis, current: str | None) -> None:
    """What would fit: a smaller GGUF quantization, a shorter context (llama.cpp's estimate for each)."""
    shape = analysis.shape
    if shape is None or not analysis.parameters:
        plan.would_fit.append("a smaller model (its size cannot be told from these files)")
        return
    budget = plan.ram_budget + plan.gpu_budget
    current_bpw = memory.GGUF_FILE_TYPE_BPW.get(current or "", 99.0)
    for quant in GGUF_ALTERNATIVES:
        bpw = memory.GGUF_FILE_TYPE_BPW[quant]
        if bpw >= current_bpw:
            continue
        weights = int(analysis.parameters * bpw / 8)
        for n_ctx in (4096, 2048, 1024):
            need = memory.estimate_llama_cpp(weights, shape, n_ctx, 1, 512).total
            if need <= budget:
                plan.would_fit.append(
                    f"a {quant} GGUF (about {_gib(weights)}) with a {n_ctx}-token context: {_gib(need)}"
                )
                return
    plan.would_fit.append(
        f"nothing on this machine: even a Q2_K GGUF needs about {_gib(analysis.parameters * 3.35 / 8)}; "
        "use a smaller model, or a machine with more memory"
    )


def apply(plan: Plan, resolved: Any) -> list[str]:
    """Put the plan's options into resolved per-model settings where the user set nothing (``--auto``).

    Values from models_settings.yaml, a model's textgen.yaml, flags or the load request stay; only defaults and
    metadata-derived values are replaced. Returns the settings it changed.
    """
    from modules.settings import Settings

    changed = []
    if plan.loader and not resolved.loader:
        resolved.loader = plan.loader
        resolved.sources["loader"] = "auto plan"
        changed.append("loader")
    for key, value in plan.options().items():
        if key == "loader" or key not in Settings.model_fields:
            continue
        if resolved.sources.get(key, "metadata") != "metadata":
            continue
        resolved.options[key] = value
        resolved.sources[key] = "auto plan"
        changed.append(key)
    if not plan.fits and not plan.refused:
        log.warning("--auto: %s may not fit (%s)", plan.target, "; ".join(plan.would_fit) or "no smaller option")
    return changed
