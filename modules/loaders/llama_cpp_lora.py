"""GGUF LoRA adapters on the llama.cpp backend (``llama_adapter_lora_init``).

Adapters change on the scheduler thread between two steps, and only while no request generates or waits: the
slots' cached prefixes were computed with the old weights and are dropped, which would corrupt a running reply.
A change is all or nothing: every adapter is loaded before the old ones are let go.
"""

from __future__ import annotations

import ctypes
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import llama_cpp

from modules.errors import InvalidRequest, ModelLoadError, NotSupported

if TYPE_CHECKING:
    from modules.loaders.llama_cpp import LlamaCppBackend


def adapter_file(path: Path, scale: float) -> Path:
    """The GGUF file of an adapter (a file, or the first .gguf in a folder); checks the scale."""
    if path.is_dir():
        ggufs = sorted(path.glob("*.gguf"))
        if not ggufs:
            raise NotSupported(f"{path.name} holds no GGUF adapter; llama.cpp needs LoRA adapters in GGUF form")
        path = ggufs[0]
    if not math.isfinite(scale):
        raise InvalidRequest("LoRA scale must be a finite number", param="scale")
    return path


def set_adapters(backend: LlamaCppBackend, adapters: list[tuple[Path, float]]) -> None:
    """Replace every adapter of ``backend`` with ``adapters`` (path, scale); raises and changes nothing on error."""
    model = backend._require_model()
    wanted = [(adapter_file(path, scale), scale) for path, scale in adapters]

    def change() -> None:
        require_idle(backend)
        fresh: dict[str, tuple[Any, float]] = {}
        try:
            for path, scale in wanted:
                adapter = llama_cpp.llama_adapter_lora_init(model.model, str(path).encode("utf-8"))
                if not adapter:
                    raise ModelLoadError(f"{path.name} is not a LoRA adapter for this model")
                if str(path) in fresh:  # named twice: the last scale wins
                    llama_cpp.llama_adapter_lora_free(fresh[str(path)][0])
                fresh[str(path)] = (adapter, scale)
        except BaseException:
            for adapter, _ in fresh.values():
                llama_cpp.llama_adapter_lora_free(adapter)
            raise
        old = backend._loras
        use_adapters(backend, fresh)
        for adapter, _ in old.values():
            llama_cpp.llama_adapter_lora_free(adapter)

    backend._on_scheduler(change)


def require_idle(backend: LlamaCppBackend) -> None:
    """Refuse while a request generates or waits (scheduler thread: no slot can be taken meanwhile)."""
    with backend._cv:
        for slot in backend._slots:
            if slot.request is not None and slot.request.cancel.is_set():
                backend._finish(slot.request, "cancelled", slot)
        backend._drop_cancelled_waiters()
        busy = backend._live_busy() + backend._live_waiting()
    if busy:
        raise InvalidRequest(
            f"cannot change LoRA adapters while {busy} generation{'s are' if busy > 1 else ' is'} running "
            "or waiting; stop them or retry when they end",
            param="lora_names",
        )


def use_adapters(backend: LlamaCppBackend, loras: dict[str, tuple[Any, float]]) -> None:
    """Switch every context to these adapters and drop the cached prefixes (scheduler thread, all slots free)."""
    assert backend._ctx is not None
    items = list(loras.values())
    adapters = (llama_cpp.llama_adapter_lora_p_ctypes * len(items))(*[a for a, _ in items]) if items else None
    scales = (ctypes.c_float * len(items))(*[s for _, s in items]) if items else None
    with backend._cv:  # a side context created from now on starts with the new adapters
        backend._loras = loras
        sides = list(backend._sides.values())
    for side in sides:
        side.set_adapters(items)
    # on the scheduler thread: no step is decoding now
    llama_cpp.llama_set_adapters_lora(backend._ctx.ctx, adapters, len(items), scales)
    for slot in backend._slots:  # cached prefixes were computed with other weights
        backend._ctx.kv_cache_seq_rm(slot.seq_id, 0, -1)
        slot.tokens.clear()
