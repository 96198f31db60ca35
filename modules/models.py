"""Models in models/: list them, detect their format and loader, load, unload and switch (unload first)."""

from __future__ import annotations

import gc
import json
import logging
import re
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from modules import loaders, models_settings, shared
from modules.errors import InvalidRequest, ModelLoadError, ModelNotFound, TextgenError
from modules.lifecycle import load_hooks
from modules.lifecycle.gguf import GGUFError, read_metadata
from modules.loaders.base import Backend, ModelMetadata
from modules.paths import UnsafePath, safe_child

log = logging.getLogger(__name__)

_SHARD = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$", re.IGNORECASE)


@dataclass
class ModelInfo:
    """A model found in the models folder."""

    name: str  # path relative to the models folder
    path: Path
    format: str  # "gguf" | "hf" | "exl2" | "exl3"
    size_bytes: int

    @property
    def loader(self) -> str:
        """The loader this format calls for."""
        return detect_loader(self)


def _folder_format(folder: Path) -> str | None:
    config = folder / "config.json"
    if not config.is_file():
        return None
    try:
        data = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return "hf"  # let the loader report the broken config
    quant = data.get("quantization_config") or {}
    method = str(quant.get("quant_method", "")).lower() if isinstance(quant, dict) else ""
    return method if method in ("exl2", "exl3") else "hf"


def _size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _gguf_entry(path: Path, root: Path) -> ModelInfo | None:
    shard = _SHARD.search(path.name)
    if shard and shard.group(1) != "00001":
        return None  # only the first shard of a split model is listed
    return ModelInfo(name=path.relative_to(root).as_posix(), path=path, format="gguf", size_bytes=_size(path))


def list_models() -> list[ModelInfo]:
    """GGUF files (top level, or one folder deep) and HF/EXL2 folders, sorted by name."""
    root = shared.models_dir()
    found: list[ModelInfo] = []
    if not root.is_dir():
        return found
    for entry in sorted(root.iterdir(), key=lambda p: p.name.lower()):
        if entry.name.startswith("."):
            continue
        if entry.is_file() and entry.suffix.lower() == ".gguf":
            info = _gguf_entry(entry, root)
            if info:
                found.append(info)
        elif entry.is_dir():
            fmt = _folder_format(entry)
            if fmt:
                found.append(ModelInfo(name=entry.name, path=entry, format=fmt, size_bytes=_size(entry)))
                continue
            for sub in sorted(entry.glob("*.gguf")):
                info = _gguf_entry(sub, root)
                if info:
                    found.append(info)
    return found


def model_names() -> list[str]:
    """Names of the models in the models folder."""
    return [m.name for m in list_models()]


def find_model(name: str) -> ModelInfo:
    """The model called ``name`` (a file or folder under the models folder)."""
    root = shared.models_dir()
    try:
        path = safe_child(root, name)
    except UnsafePath as exc:
        raise InvalidRequest(f"invalid model name: {exc}", param="model_name") from exc
    if not path.exists():
        names = ", ".join(model_names()) or "none"
        raise ModelNotFound(f"model {name!r} is not in {root} (available: {names})")
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelLoadError(f"{name}: unsupported file type {path.suffix or '(none)'}; expected a .gguf file")
        return ModelInfo(name=name, path=path, format="gguf", size_bytes=_size(path))
    fmt = _folder_format(path)
    if fmt is None:
        ggufs = sorted(path.glob("*.gguf"))
        if ggufs:
            return ModelInfo(
                name=ggufs[0].relative_to(root).as_posix(), path=ggufs[0], format="gguf", size_bytes=_size(ggufs[0])
            )
        raise ModelLoadError(f"{name}: the folder holds neither a config.json (HF model) nor a .gguf file")
    return ModelInfo(name=name, path=path, format=fmt, size_bytes=_size(path))


def detect_loader(info: ModelInfo) -> str:
    """The loader a model's format calls for."""
    return {"gguf": "llama.cpp", "exl2": "exllamav2", "exl3": "exllamav3", "hf": "transformers", "remote": "remote"}[
        info.format
    ]


def _hf_metadata(folder: Path) -> ModelMetadata:
    meta = ModelMetadata(name=folder.name)
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{folder.name}/config.json cannot be read: {exc}") from exc
    text_config = config.get("text_config") or config
    meta.architecture = (config.get("architectures") or [""])[0]
    ctx = text_config.get("max_position_embeddings") or config.get("max_position_embeddings")
    meta.context_length = int(ctx) if ctx else None
    tok_config = folder / "tokenizer_config.json"
    if tok_config.is_file():
        try:
            data: dict[str, Any] = json.loads(tok_config.read_text(encoding="utf-8"))
        except ValueError:
            data = {}
        template = data.get("chat_template")
        meta.chat_template = template if isinstance(template, str) else None
    jinja = folder / "chat_template.jinja"
    if meta.chat_template is None and jinja.is_file():
        meta.chat_template = jinja.read_text(encoding="utf-8")
    meta.sampling = _generation_config_sampling(folder / "generation_config.json")
    return meta


HF_SAMPLING = ("temperature", "top_p", "top_k", "min_p", "typical_p", "repetition_penalty")


def _generation_config_sampling(path: Path) -> dict[str, Any]:
    """The sampling an HF model's generation_config.json recommends (``do_sample: false`` means greedy)."""
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    if not isinstance(config, dict):
        return {}
    if config.get("do_sample") is False:
        return {"temperature": 0.0}
    return {k: config[k] for k in HF_SAMPLING if isinstance(config.get(k), int | float)}


def inspect_model(info: ModelInfo) -> ModelMetadata:
    """Read a model's metadata without loading it; a corrupt file raises ModelLoadError."""
    if info.format == "gguf":
        try:
            return read_metadata(info.path)
        except GGUFError as exc:
            raise ModelLoadError(str(exc)) from exc
    return _hf_metadata(info.path)


def recommended_sampling() -> tuple[dict[str, Any], str]:
    """The loaded model's recommended sampling (GenerationParams values) and where it came from; empty if none.

    Layers, each over the one before: the model's metadata (GGUF ``general.sampling.*``, HF
    ``generation_config.json``) < ``sampling:`` in user_data/models_settings.yaml < the model's textgen.yaml.
    """
    backend = shared.model
    if backend is None or not backend.metadata.sampling:
        return {}, ""
    return dict(backend.metadata.sampling), str(backend.metadata.extra.get("sampling_source", ""))


def default_system_message() -> tuple[str, str]:
    """The loaded model's default system message (``system_message:`` in models_settings.yaml or its textgen.yaml)
    and where it came from; empty if none. Instruct-mode chats that send no system message get it (the API and
    the UI alike); a request's own system message wins."""
    backend = shared.model
    if backend is None or not backend.metadata.extra.get("system_message"):
        return "", ""
    return str(backend.metadata.extra["system_message"]), str(backend.metadata.extra.get("system_message_source", ""))


def unload_model() -> bool:
    """Unload the current model (if any) and free its memory; False when none was loaded."""
    with shared.model_lock:
        backend = shared.model
        if backend is None:
            return False
        name = shared.model_name
        shared.model, shared.model_name, shared.model_options, shared.loras = None, None, {}, []
        try:
            backend.unload()
        finally:
            del backend
            load_hooks.settle()
        log.info("Unloaded %s", name)
        return True


def loader_names() -> list[str]:
    """Every loader that can be chosen (built-in and registered by extensions)."""
    return loaders.names()


def loader_options(loader: str) -> tuple[str, ...]:
    """The settings ``loader`` reads (the Model tab shows only these)."""
    return loaders.option_names(loader)


def _plan(
    name: str, overrides: dict[str, Any] | None = None
) -> tuple[ModelInfo, ModelMetadata, models_settings.ModelSettings, str]:
    """What loading ``name`` means: its file, metadata, resolved settings and loader; nothing is loaded."""
    asked = (overrides or {}).get("loader") or shared.settings.loader
    if asked and loaders.normalize(str(asked)) in loaders.NO_FILE:
        info = ModelInfo(name=name, path=Path(name), format="remote", size_bytes=0)
        meta = ModelMetadata(name=name)
    else:
        info = find_model(name)
        meta = inspect_model(info)
    resolved = models_settings.resolve(info.name, info.path, meta, overrides)
    load_hooks.auto_plan(info.path, resolved)  # --auto: the smart plan fills what the user left at its default
    return info, meta, resolved, loaders.normalize(resolved.loader or detect_loader(info))


def planned_loader(name: str) -> str:
    """The loader ``load_model(name)`` would use: a forced --loader, the per-model settings, or the format."""
    return _plan(name)[3]


def check_load(info: ModelInfo, loader: str, options: dict[str, Any]) -> type[Backend]:
    """The backend class for ``loader`` once its ``check`` passed: a load that cannot succeed here (package or CUDA
    missing, file missing, truncated or corrupt) raises BackendUnavailable or ModelLoadError; nothing is unloaded."""
    backend_cls = loaders.get(loader)
    try:
        backend_cls.check(info.path, options)
    except TextgenError as exc:
        if shared.model is None:  # /health and the Model tab say why there is no model
            shared.load_error = f"{info.name}: {exc}" if info.name not in str(exc) else str(exc)
        log.warning("Not loading %s with %s: %s", info.name, loader, exc)
        raise
    except Exception as exc:  # a broken check (an extension's backend) refuses the load instead of crashing it
        log.error("The %s loader's check of %s failed", loader, info.name, exc_info=exc)
        raise ModelLoadError(f"the {loader} loader could not check {info.name}: {type(exc).__name__}: {exc}") from exc
    return backend_cls


def is_out_of_memory(exc: BaseException) -> bool:
    """True for an allocation failure: MemoryError, torch's OutOfMemoryError, CUDA's "out of memory" text."""
    if isinstance(exc, MemoryError):
        return True
    torch = sys.modules.get("torch")  # only if something imported it: never import torch to look at an error
    oom = getattr(torch, "OutOfMemoryError", None) if torch is not None else None
    if isinstance(oom, type) and isinstance(exc, oom):
        return True
    text = str(exc).lower()
    return "out of memory" in text or "failed to allocate" in text or "cudamalloc failed" in text


def _load_failure(name: str, loader: str, exc: Exception, previous: str | None) -> TextgenError:
    """The error a failed load reports: ``exc`` itself, or a ModelLoadError saying what ran out and what is gone."""
    cause = exc.__cause__ if isinstance(exc, TextgenError) and exc.__cause__ is not None else exc
    if is_out_of_memory(cause):  # the library's own error, not a backend's guess in its message
        detail = str(exc) or type(cause).__name__
        message = (
            f"not enough memory to load {name} with {loader} ({detail}); try a smaller model or quantization, "
            "a shorter context (--n-ctx, --max-seq-len) or fewer layers on the GPU"
        )
    elif isinstance(exc, TextgenError):
        message = str(exc)
    else:
        message = f"loading {name} with {loader} failed: {type(exc).__name__}: {exc}"
    if previous is not None:
        message += (
            f". {previous} was unloaded to make room for it, so no model is loaded now: load {previous} again "
            "(Model tab or /v1/internal/model/load)"
        )
    if isinstance(exc, TextgenError) and message == str(exc):
        return exc
    return ModelLoadError(message)


def _drop_frames(exc: BaseException | None) -> None:
    """Forget the tracebacks of ``exc`` and its causes (they are logged), so that their frames can be freed."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        exc.__traceback__ = None
        exc = exc.__cause__ or exc.__context__


def _load_progress(text: str) -> None:
    """A backend's word on its load (shown in the Model tab beside "Loading")."""
    shared.load_progress = text


def load_model(name: str, overrides: dict[str, Any] | None = None) -> Backend:
    """Load ``name`` (unloading the current model first) and make it the shared model.

    Raises ModelNotFound, ModelLoadError or BackendUnavailable with a message meant for the user. A load the
    backend's ``check`` refuses (package, CUDA, missing or truncated file) leaves the current model loaded; one that
    fails later (out of memory, a corrupt tensor) leaves no model, and its message says the old one was unloaded.
    The server keeps running either way.
    """
    name = load_hooks.first_use_download(name, overrides)  # ORG/NAME not in models/: download it (outside the lock)
    with shared.model_lock:
        info, meta, resolved, loader = _plan(name, overrides)
        backend_cls = check_load(info, loader, resolved.options)  # refused here, the current model stays loaded
        previous = shared.model_name
        if not unload_model():  # an unload settles the garbage; with no model before, what came since is settled
            load_hooks.settle(unloaded=False)
        shared.loading_model, shared.load_error = info.name, None
        started = time.perf_counter()
        log.info("Loading %s with %s", info.name, loader)
        before = load_hooks.snapshot()
        failure: TextgenError | None = None
        try:
            backend = backend_cls.load(info.path, {**resolved.options, "on_progress": _load_progress})
        except Exception as exc:  # the backend's refusal or its own failure (even MemoryError): report it, keep serving
            failure = _load_failure(info.name, loader, exc, previous)
            shared.load_error = str(failure)
            # a backend's own failure gets its traceback in the log (as text: a log record holding the traceback
            # would keep the half-loaded model alive); a TextgenError already says what is wrong
            trace = "" if isinstance(exc, TextgenError) else "\n" + "".join(traceback.format_exception(exc)).rstrip()
            log.error("Loading %s failed: %s%s", info.name, failure, trace)
            if failure is not exc:
                failure.__cause__ = exc
            _drop_frames(exc)  # the frames of the failed load hold what it allocated
        finally:
            shared.loading_model, shared.load_progress = None, ""
        if failure is not None:
            gc.collect()  # free a half-loaded model now, not at the next load
            raise failure
        if not backend.metadata.chat_template and meta.chat_template:
            backend.metadata.chat_template = meta.chat_template
        for key in ("instruction_template", "chat_template"):
            if key in resolved.extra:
                backend.metadata.extra[key] = resolved.extra[key]
        if resolved.extra.get("system_message"):
            backend.metadata.extra["system_message"] = str(resolved.extra["system_message"])
            backend.metadata.extra["system_message_source"] = resolved.sources.get("system_message", "")
        backend.metadata.sampling = dict(resolved.extra.get("sampling", {}))
        backend.metadata.extra["sampling_source"] = resolved.sources.get("sampling", "")
        shared.model, shared.model_name, shared.model_options = backend, info.name, dict(resolved.options)
        shared.model_options["loader"] = loader
        load_hooks.record_load(info.name, info.path, loader, resolved.options, before)  # estimate vs measured
        log.info(
            "Loaded %s with %s in %.2f s (context %d, %d slot%s)",
            info.name,
            loader,
            time.perf_counter() - started,
            backend.context_length,
            backend.max_parallel,
            "" if backend.max_parallel == 1 else "s",
        )
        return backend


def list_loras() -> list[str]:
    """Adapters in the LoRA folder (folders, or .gguf files for llama.cpp)."""
    folder = shared.loras_dir()
    if not folder.is_dir():
        return []
    return sorted(p.name for p in folder.iterdir() if not p.name.startswith(".") and p.name != "README.md")


def apply_loras(names: list[str], weights: list[float] | None = None) -> list[str]:
    """Replace the loaded model's adapters with ``names`` (scaled by ``weights``); returns what is applied.

    Raises ModelNotLoaded, ModelNotFound for a missing adapter, or the backend's refusal (e.g. while generations
    run); on any of them the applied adapters stay as they were.
    """
    with shared.model_lock:
        backend = shared.model
        if backend is None:
            from modules.errors import ModelNotLoaded

            raise ModelNotLoaded()
        weights = list(weights) if weights is not None else [1.0] * len(names)
        if len(weights) != len(names):
            raise InvalidRequest("give one weight per LoRA", param="lora_weights")
        paths = []
        for name in names:
            try:
                path = safe_child(shared.loras_dir(), name)
            except UnsafePath as exc:
                raise InvalidRequest(f"invalid LoRA name: {exc}", param="lora_names") from exc
            if not path.exists():
                raise ModelNotFound(f"LoRA {name!r} is not in {shared.loras_dir()}")
            paths.append(path)
        if paths or shared.loras:
            # one change: the backend refuses it whole (e.g. while generations run) or applies it whole
            backend.set_loras(list(zip(paths, weights, strict=True)))
            shared.loras = list(names)
        log.info("LoRAs applied: %s", ", ".join(shared.loras) or "none")
        return list(shared.loras)
