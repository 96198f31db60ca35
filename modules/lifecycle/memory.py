"""Memory: what a model holds (parameters, bytes per weight, KV cache per token), what a load will take, and what
this process uses now.

Counts come from ``config.json``, safetensors headers or a GGUF's tensor table; no weight is read. From a
``config.json`` alone transformers builds the model on the meta device and its parameters are counted
(:func:`count_from_meta`); for a ``model_type`` transformers does not have, the count is arithmetic over the
architecture (embeddings once when they are tied, K/V projections sized by the KV heads, every expert of an MoE
counted in the total and ``experts_used`` of them in the active count); from files it is the sum of the tensors'
shapes.
"""

from __future__ import annotations

import os
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil

from modules.formats import safetensors

MiB = 2**20

SAFETENSORS_DTYPE_BYTES: dict[str, float] = {
    "F64": 8, "I64": 8, "U64": 8, "C64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2, "U16": 2,
    "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "I8": 1, "U8": 1, "BOOL": 1, "F6_E2M3": 0.75, "F6_E3M2": 0.75, "F4": 0.5,
}  # fmt: skip
"""Bytes per value of every safetensors dtype."""

TORCH_DTYPE_BYTES: dict[str, float] = {
    "float64": 8, "float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2, "int8": 1, "uint8": 1,
    "float8_e4m3fn": 1, "float8_e5m2": 1,
}  # fmt: skip
"""Bytes per value of a ``config.json`` ``torch_dtype``/``dtype``."""

GGUF_FILE_TYPE_BPW: dict[str, float] = {
    "F32": 32.0, "F16": 16.0, "BF16": 16.0, "Q8_0": 8.5, "Q6_K": 6.56, "Q5_K_M": 5.69, "Q5_K_S": 5.54, "Q5_1": 6.0,
    "Q5_0": 5.5, "Q4_K_M": 4.89, "Q4_K_S": 4.58, "Q4_1": 5.0, "Q4_0": 4.55, "IQ4_NL": 4.5, "IQ4_XS": 4.25,
    "Q3_K_L": 4.27, "Q3_K_M": 3.91, "Q3_K_S": 3.5, "IQ3_M": 3.66, "IQ3_XS": 3.3, "Q2_K": 3.35, "IQ2_M": 2.7,
}  # fmt: skip
"""Typical bits per weight of a whole llama.cpp file of each type (tensors mix types; the table is for planning
what a quantization would take; a real file's bytes come from its tensor table)."""


def gguf_type_bytes(ggml_type: int | str) -> float:
    """Bytes per weight of one GGML tensor type (``Q4_K`` -> 0.5625), by number or name."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    kind = GGMLQuantizationType[ggml_type.upper()] if isinstance(ggml_type, str) else GGMLQuantizationType(ggml_type)
    block, type_size = GGML_QUANT_SIZES[kind]
    return type_size / block


def bytes_per_weight(name: str) -> float:
    """Bytes per weight for a dtype (safetensors or torch name), a GGML tensor type or a llama.cpp file type."""
    key = name.strip()
    if key.upper() in SAFETENSORS_DTYPE_BYTES:
        return SAFETENSORS_DTYPE_BYTES[key.upper()]
    if key.lower().removeprefix("torch.") in TORCH_DTYPE_BYTES:
        return TORCH_DTYPE_BYTES[key.lower().removeprefix("torch.")]
    if key.upper() in GGUF_FILE_TYPE_BPW:
        return GGUF_FILE_TYPE_BPW[key.upper()] / 8
    try:
        return gguf_type_bytes(key)
    except (KeyError, ValueError) as exc:
        raise ValueError(f"unknown dtype or quantization type {name!r}") from exc


# ---------------------------------------------------------------- the shape of a model
@dataclass
class ModelShape:
    """The numbers that decide a decoder's parameters and its KV cache."""

    model_type: str
    hidden_size: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab_size: int
    intermediate_size: int
    tied_embeddings: bool = False
    experts: int = 0
    experts_used: int = 0
    context_length: int | None = None
    kv_heads_per_layer: list[int] = field(default_factory=list)  # when layers differ (GGUF arrays)


# Families whose layout the arithmetic knows: extra per-layer norms, q/k norms, bias rules, tied default.
_FAMILIES: dict[str, dict[str, Any]] = {
    "llama": {}, "mistral": {}, "mixtral": {}, "granite": {}, "olmo2": {"qk_norm_full": True, "norms": 2},
    "qwen2": {"qkv_bias": True}, "qwen2_moe": {"qkv_bias_key": "qkv_bias", "qkv_bias": True},
    "qwen3": {"qk_norm": True}, "qwen3_moe": {"qk_norm": True},
    "gemma": {"tied": True}, "gemma2": {"tied": True, "norms": 4}, "gemma3_text": {"tied": True, "norms": 4,
    "qk_norm": True}, "phi3": {}, "smollm3": {},
}  # fmt: skip


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The language model's part of a config (``text_config`` of a vision-language model, else the config)."""
    inner = config.get("text_config")
    return inner if isinstance(inner, dict) and inner.get("hidden_size") else config


def shape_from_config(config: dict[str, Any]) -> ModelShape:
    """A :class:`ModelShape` from a ``config.json`` mapping; raises ValueError when it is not a decoder config."""
    cfg = text_config(config)
    try:
        hidden, layers, heads = int(cfg["hidden_size"]), int(cfg["num_hidden_layers"]), int(cfg["num_attention_heads"])
        vocab = int(cfg["vocab_size"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"config.json lacks {exc} (not a decoder language model config?)") from exc
    model_type = str(cfg.get("model_type") or config.get("model_type") or "")
    family = _FAMILIES.get(model_type, {})
    experts = int(cfg.get("num_local_experts") or cfg.get("num_experts") or cfg.get("n_routed_experts") or 0)
    tied = cfg.get("tie_word_embeddings", config.get("tie_word_embeddings", family.get("tied", False)))
    ctx = cfg.get("max_position_embeddings") or config.get("max_position_embeddings")
    return ModelShape(
        model_type=model_type,
        hidden_size=hidden,
        layers=layers,
        heads=heads,
        kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        vocab_size=vocab,
        intermediate_size=int(cfg.get("intermediate_size") or 4 * hidden),
        tied_embeddings=bool(tied),
        experts=experts,
        experts_used=int(cfg.get("num_experts_per_tok") or 0) if experts else 0,
        context_length=int(ctx) if ctx else None,
    )


@dataclass
class ParamCount:
    """Parameters of a model: all of them, those one token uses (MoE), the embedding's, and how they were found."""

    total: int
    active: int
    embedding: int
    source: str  # META_SOURCE | "config.json" (arithmetic) | "safetensors headers" | "GGUF tensors"
    exact: bool = True  # False: a family the arithmetic does not know (counted as a Llama-like decoder)


def _moe_layer(cfg: dict[str, Any], index: int, experts: int) -> bool:
    if not experts or index in (cfg.get("mlp_only_layers") or []):
        return False
    step = int(cfg.get("decoder_sparse_step") or 1)
    first_dense = int(cfg.get("first_k_dense_replace") or 0)
    return index >= first_dense and (index + 1) % step == 0


def count_from_config(config: dict[str, Any]) -> ParamCount:
    """Parameters of a decoder from its ``config.json`` alone (planning before a download)."""
    cfg = text_config(config)
    shape = shape_from_config(config)
    family = _FAMILIES.get(shape.model_type, {})
    h, hd, nh, nkv = shape.hidden_size, shape.head_dim, shape.heads, shape.kv_heads
    attn_bias = bool(cfg.get("attention_bias", False))
    qkv_bias = bool(cfg.get(family.get("qkv_bias_key", ""), family.get("qkv_bias", False))) or attn_bias
    attention = h * nh * hd + 2 * h * nkv * hd + nh * hd * h
    attention += (nh * hd + 2 * nkv * hd if qkv_bias else 0) + (h if attn_bias else 0)
    if family.get("qk_norm"):
        attention += 2 * hd
    if family.get("qk_norm_full"):
        attention += nh * hd + nkv * hd
    norms = family.get("norms", 2) * h
    mlp_bias = bool(cfg.get("mlp_bias", False))
    dense = 3 * h * shape.intermediate_size + ((2 * shape.intermediate_size + h) if mlp_bias else 0)
    expert_size = int(cfg.get("moe_intermediate_size") or shape.intermediate_size)
    shared_size = int(cfg.get("shared_expert_intermediate_size") or 0)
    total = active = 0
    for index in range(shape.layers):
        layer = attention + norms
        if _moe_layer(cfg, index, shape.experts):
            router = h * shape.experts
            shared = (3 * h * shared_size + h) if shared_size else 0
            layer_active = layer + router + shared + shape.experts_used * 3 * h * expert_size
            layer += router + shared + shape.experts * 3 * h * expert_size
        else:
            layer += dense
            layer_active = layer
        total += layer
        active += layer_active
    embedding = shape.vocab_size * h
    head = 0 if shape.tied_embeddings else shape.vocab_size * h
    rest = embedding + head + h  # embeddings, output head, final norm
    return ParamCount(total + rest, active + rest, embedding, "config.json", exact=shape.model_type in _FAMILIES)


META_SOURCE = "transformers model on the meta device"
"""``ParamCount.source`` of a count from :func:`count_from_meta`."""

_EXPERT_SUFFIXES = (".experts.gate_up_proj", ".experts.down_proj", ".experts.up_proj", ".experts.gate_proj")


def _is_expert(name: str) -> bool:
    """A routed expert's tensor (``...mlp.experts.3.w1.weight`` or a fused ``...mlp.experts.gate_up_proj``)."""
    return ".experts." in name or name.endswith(_EXPERT_SUFFIXES)


def count_from_meta(config: dict[str, Any]) -> ParamCount | None:
    """Parameters of the model transformers builds from ``config`` on the meta device: exact for every architecture
    transformers has, with no weight allocated. ``None`` when transformers (or accelerate) is not installed, does not
    know the ``model_type`` (no remote code is ever run: ``trust_remote_code=False``), or cannot build it.

    Tied parameters are one ``Parameter`` object, counted once (``model.parameters()`` yields each object once).
    The MoE active count keeps every non-expert parameter and ``experts_used / experts`` of the routed experts'."""
    model_type = config.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        return None
    try:
        import torch
        from accelerate import init_empty_weights
        from transformers import AutoModelForCausalLM
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    except ImportError:
        return None
    if model_type not in CONFIG_MAPPING:
        return None
    clean = {k: v for k, v in config.items() if k not in ("auto_map", "quantization_config")}
    try:
        hf_config = CONFIG_MAPPING[model_type].from_dict(clean)
        with init_empty_weights(include_buffers=True):
            model = AutoModelForCausalLM.from_config(hf_config, trust_remote_code=False)
        total = expert = 0
        for name, param in model.named_parameters():  # each Parameter object once: tied count once
            if param.device != torch.device("meta"):
                return None  # something was allocated: not the planning count this is meant to be
            total += param.numel()
            if _is_expert(name):
                expert += param.numel()
        embeddings = model.get_input_embeddings()
        embedding = sum(p.numel() for p in embeddings.parameters()) if embeddings is not None else 0
    except Exception:  # any failure to build means: use the arithmetic
        return None
    active = total
    try:
        shape = shape_from_config(config)
    except ValueError:
        shape = None
    if shape and shape.experts and expert:
        active = total - expert + expert * shape.experts_used // shape.experts
    return ParamCount(total, active, embedding, META_SOURCE)


def count_parameters(config: dict[str, Any]) -> ParamCount:
    """Parameters from a ``config.json`` alone: :func:`count_from_meta` where transformers knows the architecture,
    else :func:`count_from_config`'s arithmetic, its source saying why."""
    meta = count_from_meta(config)
    if meta is not None:
        return meta
    count = count_from_config(config)
    model_type = config.get("model_type")
    count.source = f"config.json arithmetic (transformers cannot build model_type {model_type!r})"
    return count


def kv_bytes_per_token(shape: ModelShape, bytes_per_value: float = 2.0) -> int:
    """KV-cache bytes one token takes: keys and values of every layer (f16 unless told: 2 bytes a value)."""
    heads = shape.kv_heads_per_layer or [shape.kv_heads] * shape.layers
    return int(sum(2 * n * shape.head_dim * bytes_per_value for n in heads))


# ---------------------------------------------------------------- from files
def count_from_safetensors(
    files: list[Path], shape: ModelShape | None = None
) -> tuple[ParamCount, int, dict[str, int]]:
    """(parameters, weight bytes, bytes per dtype) from safetensors headers; MoE experts found by name."""
    total = expert = embedding = weight_bytes = 0
    by_dtype: dict[str, int] = {}
    for path in files:
        for name, info in safetensors.read_header(path)[0].items():
            if name == "__metadata__":
                continue
            numel = 1
            for dim in info["shape"]:
                numel *= int(dim)
            begin, end = info["data_offsets"]
            weight_bytes += int(end) - int(begin)
            by_dtype[info["dtype"]] = by_dtype.get(info["dtype"], 0) + int(end) - int(begin)
            total += numel
            if ".experts." in name or name.endswith(".experts.gate_up_proj") or name.endswith(".experts.down_proj"):
                expert += numel
            if name.endswith("embed_tokens.weight") or name.endswith("wte.weight"):
                embedding += numel
    active = total
    if shape and shape.experts and expert:
        active = total - expert + expert * shape.experts_used // shape.experts
    return ParamCount(total, active, embedding, "safetensors headers"), weight_bytes, by_dtype


def shape_from_gguf(meta: dict[str, Any], tensors: list[dict[str, Any]]) -> ModelShape:
    """A :class:`ModelShape` from a GGUF's metadata (``ARCH.block_count``, ``ARCH.attention.head_count_kv``...)."""
    arch = str(meta.get("general.architecture", ""))

    def key(name: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{name}", default)

    def first(value: Any) -> int:
        return int(max(value)) if isinstance(value, list) and value else int(value or 0)

    hidden, layers = int(key("embedding_length", 0)), int(key("block_count", 0))
    heads = first(key("attention.head_count", 0)) or 1
    kv = key("attention.head_count_kv", heads)
    vocab = key("vocab_size") or len(meta.get("tokenizer.ggml.tokens") or []) or 0
    names = {t["name"] for t in tensors}
    ctx = key("context_length")
    return ModelShape(
        model_type=arch,
        hidden_size=hidden,
        layers=layers,
        heads=heads,
        kv_heads=first(kv) or heads,
        head_dim=int(key("attention.key_length", 0) or (hidden // heads if heads else 0)),
        vocab_size=int(vocab),
        intermediate_size=first(key("feed_forward_length", 0)),
        tied_embeddings="output.weight" not in names,
        experts=int(key("expert_count", 0) or 0),
        experts_used=int(key("expert_used_count", 0) or 0),
        context_length=int(ctx) if ctx else None,
        kv_heads_per_layer=[int(n) for n in kv] if isinstance(kv, list) else [],
    )


def count_from_gguf(meta: dict[str, Any], tensors: list[dict[str, Any]]) -> tuple[ParamCount, int, dict[str, int]]:
    """(parameters, tensor bytes, bytes per GGML type) from a GGUF's tensor table."""
    from gguf.constants import GGMLQuantizationType

    from modules.formats.gguf import tensor_bytes

    shape = shape_from_gguf(meta, tensors)
    total = expert = embedding = weight_bytes = 0
    by_type: dict[str, int] = {}
    for info in tensors:
        numel = 1
        for dim in info["shape"]:
            numel *= int(dim)
        size = tensor_bytes(info)
        weight_bytes += size
        try:
            type_name = GGMLQuantizationType(info["type"]).name
        except ValueError:
            type_name = str(info["type"])
        by_type[type_name] = by_type.get(type_name, 0) + size
        total += numel
        if "_exps." in info["name"]:
            expert += numel
        if info["name"] == "token_embd.weight":
            embedding += numel
    active = total
    if shape.experts and expert:
        active = total - expert + expert * shape.experts_used // shape.experts
    return ParamCount(total, active, embedding, "GGUF tensors"), weight_bytes, by_type


# ---------------------------------------------------------------- what a load takes
@dataclass
class MemoryEstimate:
    """Bytes a load will hold, by part; ``gpu`` of them on GPUs, the rest in RAM."""

    weights: int
    kv_cache: int
    compute: int
    runtime: int
    gpu: int = 0
    notes: list[str] = field(default_factory=list)

    @property
    def total(self) -> int:
        """Every part together."""
        return self.weights + self.kv_cache + self.compute + self.runtime

    @property
    def ram(self) -> int:
        """The part in system memory."""
        return self.total - self.gpu

    def to_dict(self) -> dict[str, Any]:
        """JSON, with the total and the RAM part."""
        return {**asdict(self), "total": self.total, "ram": self.ram}

    def text(self) -> str:
        """One line for the UI and the CLI."""
        parts = f"weights {self.weights / MiB:,.0f} + KV cache {self.kv_cache / MiB:,.0f} + compute {self.compute / MiB:,.0f}"
        where = f", {self.gpu / MiB:,.0f} MiB of it on the GPU" if self.gpu else ""
        return f"{self.total / MiB:,.0f} MiB ({parts} + runtime {self.runtime / MiB:,.0f} MiB{where})"


LLAMA_CPP_RUNTIME = 12 * MiB
"""llama.cpp's own tables (vocabulary, graph, threads) beside the buffers it reports; measured on the default model."""


def estimate_llama_cpp(
    weight_bytes: int, shape: ModelShape, n_ctx: int, parallel: int, n_batch: int, gpu_layers: int = 0
) -> MemoryEstimate:
    """What ``LlamaCppBackend.load`` holds: the GGUF's tensors (mapped), an f16 KV cache of ``n_ctx`` tokens for
    each of ``parallel`` slots, the logits of each slot, one batch's activations, and the runtime."""
    kv = kv_bytes_per_token(shape) * n_ctx * parallel
    ffn = shape.intermediate_size * (max(1, shape.experts_used) if shape.experts else 1)
    activations = n_batch * (4 * shape.hidden_size + 3 * ffn) * 4
    output = shape.vocab_size * 4 * parallel
    estimate = MemoryEstimate(weight_bytes, kv, activations + output, LLAMA_CPP_RUNTIME)
    if gpu_layers:
        share = 1.0 if gpu_layers < 0 or gpu_layers > shape.layers else gpu_layers / (shape.layers + 1)
        gpu_compute = n_batch * shape.vocab_size * 4 if share >= 1.0 else activations
        estimate.gpu = int(weight_bytes * share + kv * min(1.0, share) + gpu_compute)
        estimate.compute = max(estimate.compute, gpu_compute + output)
        estimate.notes.append(f"{'all' if share >= 1 else gpu_layers} layers on the GPU")
    return estimate


def estimate_transformers(
    params: ParamCount,
    shape: ModelShape,
    bytes_per_param: float,
    n_ctx: int,
    kv_value_bytes: float,
    on_gpu: bool,
    parallel: int = 1,
) -> MemoryEstimate:
    """What the transformers backend holds: weights at ``bytes_per_param`` (4-bit: about 0.56 for the linear
    layers, embeddings at the compute dtype), the KV cache of ``parallel`` sequences (its batch pads each to the
    longest: all full is what it may reach), activations, and torch's allocator slack."""
    weights = int(params.total * bytes_per_param)
    kv = kv_bytes_per_token(shape, kv_value_bytes) * n_ctx * max(1, parallel)
    compute = int(n_ctx * shape.hidden_size * 4 * 8 + shape.vocab_size * 4 * 2)
    runtime = int(0.05 * weights) + 64 * MiB
    estimate = MemoryEstimate(weights, kv, compute, runtime)
    if on_gpu:
        estimate.gpu = estimate.total - 64 * MiB
    return estimate


# ---------------------------------------------------------------- what this process uses
def process_rss() -> int:
    """Resident bytes of this process."""
    return int(psutil.Process(os.getpid()).memory_info().rss)


def gpu_allocated() -> int:
    """Bytes torch holds on every CUDA device (0 without torch or CUDA)."""
    torch = sys.modules.get("torch")
    try:
        if torch is not None and torch.cuda.is_available():
            return int(sum(torch.cuda.memory_allocated(i) for i in range(torch.cuda.device_count())))
    except RuntimeError:
        pass
    return 0


@dataclass
class LoadMeasurement:
    """A load's estimate beside what it measurably took (the Model tab shows both)."""

    model: str
    loader: str
    estimate: MemoryEstimate | None
    rss_increase: int
    gpu_increase: int = 0

    def text(self) -> str:
        """'expected X, measured Y' in one line."""
        measured = f"measured {self.rss_increase / MiB:,.0f} MiB more RAM"
        if self.gpu_increase:
            measured += f" and {self.gpu_increase / MiB:,.0f} MiB of GPU memory"
        if self.estimate is None:
            return f"{self.model}: {measured} (no estimate for this model)"
        ratio = self.rss_increase / self.estimate.ram if self.estimate.ram else 0
        return f"{self.model}: expected {self.estimate.text()}; {measured} ({ratio:.0%} of the RAM estimate)"


last_load: LoadMeasurement | None = None  # set by the load path after each successful load


def memory_text() -> str:
    """One line: process RSS, system RAM in use, and VRAM per CUDA device (when torch is loaded with CUDA)."""
    process = psutil.Process(os.getpid()).memory_info().rss
    system = psutil.virtual_memory()
    parts = [
        f"RAM: this process {process / 2**30:.2f} GiB",
        f"system {system.used / 2**30:.1f} / {system.total / 2**30:.1f} GiB",
    ]
    torch = sys.modules.get("torch")
    if torch is not None:
        try:
            if torch.cuda.is_available():
                for i in range(torch.cuda.device_count()):
                    used = torch.cuda.memory_allocated(i)
                    total = torch.cuda.get_device_properties(i).total_memory
                    parts.append(f"GPU {i}: {used / 2**30:.2f} / {total / 2**30:.1f} GiB")
        except RuntimeError:
            pass
    return " | ".join(parts)
