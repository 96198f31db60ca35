"""The loader registry: loader name -> backend class, imported lazily on first use."""

from __future__ import annotations

import importlib
from collections.abc import Callable

from modules.errors import BackendUnavailable
from modules.loaders.base import Backend, package_installed

# name -> (module path, class name, python package it needs)
_BUILTIN: dict[str, tuple[str, str, str]] = {
    "llama.cpp": ("modules.loaders.llama_cpp", "LlamaCppBackend", "llama_cpp"),
    "transformers": ("modules.loaders.transformers", "TransformersBackend", "transformers"),
    "exllamav2": ("modules.loaders.exllamav2", "ExLlamaV2Backend", "exllamav2"),
    "exllamav3": ("modules.loaders.exllamav3", "ExLlamaV3Backend", "exllamav3"),
    "remote": ("modules.loaders.remote", "RemoteBackend", "httpx"),
    "vllm": ("modules.loaders.vllm", "VllmBackend", "httpx"),
}
EXLLAMA_OPTIONS = (
    "max_seq_len",
    "cache_size",
    "gpu_split",
    "cache_type",
    "cache_8bit",
    "cache_q4",
    "parallel",
    "max_queue",
)
# The settings each loader reads (the Model tab shows only these); the backend classes use the same tuples.
OPTIONS: dict[str, tuple[str, ...]] = {
    "llama.cpp": (
        "n_ctx",
        "threads",
        "threads_batch",
        "n_gpu_layers",
        "n_batch",
        "parallel",
        "max_queue",
        "prompt_cache",
        "flash_attn",
        "speculative",
        "draft_model",
        "draft_max",
        "draft_min",
        "amx",
    ),
    "transformers": (
        "n_ctx",
        "dtype",
        "load_in_8bit",
        "load_in_4bit",
        "compute_dtype",
        "quant_type",
        "use_double_quant",
        "cpu",
        "gpu_memory",
        "cpu_memory",
        "attn_implementation",
        "trust_remote_code",
        "parallel",
        "max_queue",
    ),
    "exllamav2": EXLLAMA_OPTIONS,
    "exllamav3": EXLLAMA_OPTIONS,
    "remote": ("remote_url", "remote_api_key", "n_ctx", "parallel", "max_queue"),
    "vllm": ("n_ctx", "parallel", "max_queue", "vllm_kv_cache_gb", "vllm_args", "vllm_start_timeout", "vllm_restarts"),
}
_ALIASES = {
    "llamacpp": "llama.cpp",
    "llama_cpp": "llama.cpp",
    "hf": "transformers",
    "exl2": "exllamav2",
    "exl3": "exllamav3",
}
_extra: dict[str, type[Backend] | Callable[[], type[Backend]]] = {}


NO_FILE = frozenset({"remote"})  # loaders that serve a model name, not a file in models/


def normalize(name: str) -> str:
    """Canonical loader name for a user-typed one (case and common aliases)."""
    key = name.strip().lower()
    return _ALIASES.get(key, key)


def register(name: str, backend: type[Backend] | Callable[[], type[Backend]]) -> None:
    """Add a loader (extensions call this through the ``register_backends`` hook)."""
    _extra[normalize(name)] = backend


def unregister(name: str) -> None:
    """Remove a loader added with :func:`register`."""
    _extra.pop(normalize(name), None)


def names() -> list[str]:
    """Every known loader name, built-in first."""
    return list(_BUILTIN) + [n for n in _extra if n not in _BUILTIN]


def option_names(name: str) -> tuple[str, ...]:
    """The settings a loader reads (for extension-registered loaders: their class's ``option_names``)."""
    key = normalize(name)
    if key in OPTIONS:
        return OPTIONS[key]
    try:
        return tuple(get(key).option_names)
    except BackendUnavailable:
        return ()


def available() -> dict[str, bool]:
    """Loader name -> whether its package is installed here."""
    result = {}
    for name in names():
        if name in _extra:
            result[name] = True
        else:
            result[name] = package_installed(_BUILTIN[name][2])
    return result


def get(name: str) -> type[Backend]:
    """The backend class for a loader name, importing it on first use."""
    key = normalize(name)
    if key in _extra:
        entry = _extra[key]
        if isinstance(entry, type):
            return entry
        return entry()
    if key not in _BUILTIN:
        raise BackendUnavailable(f"unknown loader {name!r}; known loaders: {', '.join(names())}")
    module_name, class_name, package = _BUILTIN[key]
    if not package_installed(package):
        raise BackendUnavailable(
            f"the {key} loader needs the Python package '{package}', which is not installed: pip install {package}"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise BackendUnavailable(f"the {key} loader could not be imported: {exc}") from exc
    backend: type[Backend] = getattr(module, class_name)
    return backend
