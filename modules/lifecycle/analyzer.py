"""What a model is, read from its files without loading a weight: architecture, parameters (total and active),
context length, bytes of its weights as they are, KV-cache bytes per token, chat template, whether it needs remote
code, and the quantization already applied.

Works on a GGUF file, a model folder (even one holding only ``config.json``: planning before a download), and a
Hub repo (``ORG/NAME[:BRANCH]``: its small files and the headers of its weights are fetched, not the weights).
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from modules import shared
from modules.errors import InvalidRequest, ModelLoadError, ModelNotFound
from modules.lifecycle import memory
from modules.lifecycle.memory import ModelShape, ParamCount

_SMALL_FILES = (
    "config.json", "tokenizer_config.json", "chat_template.jinja", "chat_template.json", "generation_config.json",
    "model.safetensors.index.json", "adapter_config.json",
)  # fmt: skip
_GGUF_HEAD = 8 << 20  # first bytes of a remote GGUF fetched for its header (doubled until it fits, up to 128 MiB)


@dataclass
class Analysis:
    """The analysis of one model, as ``inspect --json`` prints it."""

    target: str
    format: str  # "gguf" | "safetensors" | "pytorch" | "config" (config.json only) | "exl2"
    architecture: str  # config.json's architectures[0], or the GGUF's general.architecture
    family: str  # model_type (llama, qwen2, mixtral, ...)
    parameters: int | None
    active_parameters: int | None
    context_length: int | None
    weight_bytes: int | None
    kv_bytes_per_token: int | None
    path: str | None = None
    repo: str | None = None
    parameters_source: str = ""
    parameters_exact: bool = True
    embedding_parameters: int | None = None
    weight_bytes_source: str = ""
    bytes_by_type: dict[str, int] = field(default_factory=dict)
    dtype: str | None = None  # the weights' dtype (config.json) or the GGUF file type
    quantization: str | None = None  # already applied: "Q4_1", "gptq 4-bit", "bitsandbytes 4-bit", "exl2 4.0 bpw"
    chat_template: bool = False
    remote_code: bool = False
    remote_code_reason: str | None = None
    tied_embeddings: bool | None = None
    layers: int | None = None
    hidden_size: int | None = None
    heads: int | None = None
    kv_heads: int | None = None
    head_dim: int | None = None
    vocab_size: int | None = None
    experts: int = 0
    experts_used: int = 0
    notes: list[str] = field(default_factory=list)
    shape: ModelShape | None = field(default=None, repr=False)

    def to_dict(self) -> dict[str, Any]:
        """One JSON object (the shape is spread into its own fields)."""
        data = asdict(self)
        data.pop("shape", None)
        return data

    def summary(self) -> str:
        """A few readable lines."""

        def billions(n: int | None) -> str:
            return "?" if n is None else f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"

        moe = f" ({billions(self.active_parameters)} active, {self.experts_used} of {self.experts} experts)"
        lines = [
            f"{self.target}: {self.architecture or '?'} ({self.family or '?'}), {self.format}",
            f"parameters: {billions(self.parameters)}{moe if self.experts else ''}"
            + ("" if self.parameters_exact else " (approximate: unknown family)"),
            f"weights: {_size(self.weight_bytes or 0)} ({self.quantization or self.dtype or '?'})",
            f"context: {self.context_length or '?'} tokens; KV cache: {(self.kv_bytes_per_token or 0) / 1024:,.1f} "
            "KiB per token (f16)",
            f"chat template: {'yes' if self.chat_template else 'no'}; remote code: "
            + (f"yes ({self.remote_code_reason})" if self.remote_code else "no"),
        ]
        return "\n".join(lines + [f"note: {n}" for n in self.notes])


def _size(n: int) -> str:
    return f"{n / 2**30:,.2f} GiB" if n >= 2**30 else f"{n / 2**20:,.1f} MiB"


def _with_shape(result: Analysis, shape: ModelShape) -> Analysis:
    result.shape = shape
    result.family = result.family or shape.model_type
    result.context_length = result.context_length or shape.context_length
    result.kv_bytes_per_token = memory.kv_bytes_per_token(shape)
    result.tied_embeddings = shape.tied_embeddings
    result.layers, result.hidden_size, result.heads = shape.layers, shape.hidden_size, shape.heads
    result.kv_heads, result.head_dim, result.vocab_size = shape.kv_heads, shape.head_dim, shape.vocab_size
    result.experts, result.experts_used = shape.experts, shape.experts_used
    return result


def _with_count(result: Analysis, count: ParamCount) -> Analysis:
    result.parameters, result.active_parameters = count.total, count.active
    result.embedding_parameters, result.parameters_source = count.embedding, count.source
    result.parameters_exact = count.exact
    return result


# ---------------------------------------------------------------- GGUF
def _file_type_name(value: Any) -> str | None:
    from gguf.constants import LlamaFileType

    try:
        return LlamaFileType(int(value)).name.removeprefix("MOSTLY_").removeprefix("ALL_")
    except (TypeError, ValueError):
        return None


def analyze_gguf(path: Path, target: str | None = None) -> Analysis:
    """Analyse a GGUF file (every shard of a split one) from its header and tensor table."""
    from modules.formats.gguf import GGUFError, read_header

    try:
        meta, tensors, _ = read_header(path)
        shards = _shards(path, meta)
        for shard in shards[1:]:
            tensors = tensors + read_header(shard)[1]
    except GGUFError as exc:
        raise ModelLoadError(str(exc)) from exc
    shape = memory.shape_from_gguf(meta, tensors)
    count, weight_bytes, by_type = memory.count_from_gguf(meta, tensors)
    file_type = _file_type_name(meta.get("general.file_type"))
    result = Analysis(
        target=target or str(path),
        path=str(path),
        format="gguf",
        architecture=str(meta.get("general.architecture", "")),
        family=str(meta.get("general.architecture", "")),
        parameters=None,
        active_parameters=None,
        context_length=shape.context_length,
        weight_bytes=weight_bytes,
        kv_bytes_per_token=None,
        weight_bytes_source="GGUF tensor table",
        bytes_by_type=by_type,
        dtype=file_type,
        quantization=file_type if file_type not in (None, "F32", "F16", "BF16") else None,
        chat_template=bool(meta.get("tokenizer.chat_template")),
    )
    if len(shards) > 1:
        result.notes.append(f"split into {len(shards)} files")
    return _with_count(_with_shape(result, shape), count)


def _shards(path: Path, meta: dict[str, Any]) -> list[Path]:
    count = int(meta.get("split.count", 1) or 1)
    if count <= 1:
        return [path]
    stem = path.name.rsplit("-00001-of-", 1)[0]
    return [path.with_name(f"{stem}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]


# ---------------------------------------------------------------- Hugging Face folders
def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{path.name} cannot be read: {exc}") from exc
    return data if isinstance(data, dict) else {}


def _quantization(config: dict[str, Any]) -> str | None:
    quant = config.get("quantization_config")
    if not isinstance(quant, dict):
        return None
    method = str(quant.get("quant_method", "")).lower() or "quantized"
    if method == "bitsandbytes":
        return "bitsandbytes 4-bit" if quant.get("load_in_4bit") else "bitsandbytes 8-bit"
    if method == "exl2" and quant.get("bits"):
        return f"exl2 {quant['bits']} bpw"
    bits = quant.get("bits") or quant.get("weight_bits")
    return f"{method} {bits}-bit" if bits else method


def _remote_code(config: dict[str, Any]) -> tuple[bool, str | None]:
    auto_map = config.get("auto_map") or {}
    if isinstance(auto_map, dict) and any("CausalLM" in k or k == "AutoModel" for k in auto_map):
        return True, f"config.json maps the model class to code in the repo ({next(iter(auto_map.values()))})"
    model_type = config.get("model_type")
    try:
        from transformers import CONFIG_MAPPING

        known = model_type in CONFIG_MAPPING
    except ImportError:
        known = True
    if model_type and not known:
        return True, f"transformers does not know model_type {model_type!r}"
    return False, None


def _has_chat_template(folder: Path) -> bool:
    if (folder / "chat_template.jinja").is_file() or (folder / "chat_template.json").is_file():
        return True
    tok = folder / "tokenizer_config.json"
    return tok.is_file() and bool(_read_json(tok).get("chat_template"))


def analyze_folder(folder: Path, target: str | None = None) -> Analysis:
    """Analyse a Hugging Face model folder from config.json and, when present, its safetensors headers."""
    config_path = folder / "config.json"
    if not config_path.is_file():
        ggufs = sorted(p for p in folder.glob("*.gguf") if "mmproj" not in p.name.lower())
        if ggufs:
            return analyze_gguf(ggufs[0], target)
        raise ModelLoadError(f"{folder.name}: neither a config.json (Hugging Face model) nor a .gguf file")
    config = _read_json(config_path)
    try:
        shape = memory.shape_from_config(config)
    except ValueError as exc:
        raise ModelLoadError(f"{folder.name}: {exc}") from exc
    count = memory.count_parameters(config)  # the meta-device model where transformers has it, else arithmetic
    dtype = str(memory.text_config(config).get("torch_dtype") or config.get("torch_dtype") or config.get("dtype") or "")
    quant = _quantization(config)
    safetensors = sorted(folder.glob("*.safetensors"))
    pickles = sorted(folder.glob("pytorch_model*.bin"))
    result = Analysis(
        target=target or str(folder),
        path=str(folder),
        format="exl2"
        if quant and quant.startswith("exl2")
        else "safetensors"
        if safetensors
        else "pytorch"
        if pickles
        else "config",
        architecture=str((config.get("architectures") or [""])[0]),
        family=shape.model_type,
        parameters=None,
        active_parameters=None,
        context_length=shape.context_length,
        weight_bytes=None,
        kv_bytes_per_token=None,
        dtype=dtype or None,
        quantization=quant,
        chat_template=_has_chat_template(folder),
    )
    result.remote_code, result.remote_code_reason = _remote_code(config)
    if safetensors and not quant:
        header_count, weight_bytes, by_dtype = memory.count_from_safetensors(safetensors, shape)
        result.weight_bytes, result.bytes_by_type = weight_bytes, by_dtype
        result.weight_bytes_source = "safetensors headers"
        if header_count.total != count.total:
            result.notes.append(f"{count.source} gives {count.total} parameters; the files hold {header_count.total}")
            count = header_count
    elif safetensors or pickles:
        result.weight_bytes = sum(p.stat().st_size for p in safetensors or pickles)
        result.weight_bytes_source = "file sizes"
    else:
        index = folder / "model.safetensors.index.json"
        total_size = (_read_json(index).get("metadata") or {}).get("total_size") if index.is_file() else None
        if total_size:
            result.weight_bytes, result.weight_bytes_source = int(total_size), "model.safetensors.index.json"
        else:
            per = memory.bytes_per_weight(dtype) if dtype in memory.TORCH_DTYPE_BYTES else 4.0
            result.weight_bytes = int(count.total * per)
            result.weight_bytes_source = f"parameters x {per:g} bytes ({dtype or 'float32: no dtype in config.json'})"
    if not count.exact:
        result.notes.append(f"model_type {shape.model_type!r} is counted as a Llama-like decoder (approximate)")
    return _with_count(_with_shape(result, shape), count)


# ---------------------------------------------------------------- Hub repos
def analyze_repo(spec: str, quant: str | None = None) -> Analysis:
    """Analyse a Hub repo from its small files and weight headers (nothing large is downloaded)."""
    from huggingface_hub import HfApi, hf_hub_download

    from modules.lifecycle import hub, hub_files

    args = hub.DownloadArgs(repo=spec, quant=quant)
    plan = hub.prepare(args)
    files = {f.path: f for f in plan.selection.files}
    with tempfile.TemporaryDirectory(prefix="textgen-inspect-") as tmp:
        folder = Path(tmp)
        if plan.selection.kind == "gguf":
            first = next(f for f in plan.selection.files if f.path.lower().endswith(".gguf"))
            path = folder / first.path.rsplit("/", 1)[-1]
            _fetch_head(plan, first.path, path)
            result = analyze_gguf(path, spec)
            result.weight_bytes_source += " (header fetched from the Hub)"
            if len([f for f in files if f.lower().endswith(".gguf")]) > 1:
                result.weight_bytes = plan.selection.total_bytes  # every shard
            result.notes.append(f"quantizations in the repo: {', '.join(plan.selection.quants)}")
        else:
            listed = {f.path for f in hub.list_files(plan.repo_id, plan.commit, plan.endpoint, plan.token)[1]}
            for name in _SMALL_FILES:
                if name in listed:
                    hf_hub_download(plan.repo_id, name, revision=plan.commit, local_dir=folder, endpoint=plan.endpoint,
                                    token=plan.token)  # fmt: skip
            if not (folder / "config.json").is_file():
                raise InvalidRequest(f"{spec} has no config.json (is it an adapter or a dataset?)", param="target")
            result = analyze_folder(folder, spec)
            weights = [f for f in plan.selection.files if hub_files._SAFETENSORS.search(f.path)]
            if weights and not result.quantization:
                meta = HfApi(endpoint=plan.endpoint, token=plan.token).get_safetensors_metadata(
                    plan.repo_id, revision=plan.commit
                )
                total = sum(meta.parameter_count.values())
                if total:
                    count = ParamCount(total, total, result.embedding_parameters or 0, "safetensors headers (Hub)")
                    if result.shape and result.shape.experts and result.active_parameters and result.parameters:
                        count.active = total - (result.parameters - result.active_parameters)
                    _with_count(result, count)
            sizes = [f.size for f in plan.selection.files if f.path.endswith((".safetensors", ".bin"))]
            if sizes:
                result.weight_bytes, result.weight_bytes_source = sum(sizes), "file sizes on the Hub"
            result.format = "safetensors" if weights else result.format
        result.path, result.repo = None, plan.repo_id
    return result


def _fetch_head(plan: Any, filename: str, dest: Path) -> None:
    """The first bytes of a remote file, enough for a GGUF header (a ranged GET through huggingface_hub)."""
    from huggingface_hub import hf_hub_url
    from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status

    from modules.formats.gguf import GGUFError, read_header

    url = hf_hub_url(plan.repo_id, filename, revision=plan.commit, endpoint=plan.endpoint)
    size = _GGUF_HEAD
    while True:
        headers = {**build_hf_headers(token=plan.token, library_name="textgen"), "Range": f"bytes=0-{size - 1}"}
        response = get_session().get(url, headers=headers, follow_redirects=True)
        hf_raise_for_status(response)
        dest.write_bytes(response.content[:size])
        try:
            read_header(dest)
            return
        except GGUFError:
            if size >= 128 << 20 or len(response.content) < size:
                raise
            size *= 2


def resolve_target(target: str) -> Path | None:
    """A local path for ``target``: as given, or inside the models folder; None when it is not on disk."""
    candidate = Path(target).expanduser()
    if candidate.exists():
        return candidate
    from modules.paths import UnsafePath, safe_child

    try:
        inside = safe_child(shared.models_dir(), target)
    except UnsafePath:
        return None
    return inside if inside.exists() else None


def analyze(target: str, quant: str | None = None) -> Analysis:
    """Analyse a GGUF file, a model folder, a name in the models folder, or a Hub repo."""
    from modules.lifecycle import hub

    path = resolve_target(target)
    if path is not None:
        return analyze_gguf(path, target) if path.is_file() else analyze_folder(path, target)
    if hub.looks_like_repo(target):
        return analyze_repo(target, quant)
    raise ModelNotFound(f"{target!r} is neither a file or folder here, a model in {shared.models_dir()}, nor ORG/NAME")
