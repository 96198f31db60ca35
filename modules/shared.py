"""The hub: settings, the single loaded model, its lock and the running generations' stop events.

Nothing happens at import; ``server.py``, a CLI, a script (or a test) calls :func:`init`, and :data:`initialized` says
whether one did (a Workbench sets the hub up only where nothing has).
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from modules.paths import resolve
from modules.settings import LoadedSettings, Settings

if TYPE_CHECKING:
    from modules.loaders.base import Backend

settings: Settings = Settings()
explicit: frozenset[str] = frozenset()  # settings given on the command line or in the environment
extension_params: dict[str, dict[str, Any]] = {}
ui_defaults: dict[str, Any] = {}  # settings.yaml keys that are not server settings (UI defaults)
initialized = False  # init() was given settings: a server, a CLI or a script set the hub up

model: Backend | None = None
model_name: str | None = None
model_options: dict[str, Any] = {}  # the options the model was loaded with
loading_model: str | None = None  # name of the model being loaded, if any
load_progress: str = ""  # what the load is doing now, where the backend says (a vLLM engine starting)
load_error: str | None = None  # why the last load failed
loras: list[str] = []

model_lock = threading.RLock()  # held while loading, unloading or switching

_stop_lock = threading.Lock()
_stop_events: dict[str, threading.Event] = {}


def init(loaded: LoadedSettings | None = None) -> None:
    """Reset the hub to ``loaded`` settings (and no model); without settings, back to how import left it (defaults,
    not :data:`initialized`). A loaded model is dropped, not unloaded: unload it first (``models.unload_model``)."""
    global settings, explicit, extension_params, ui_defaults, model, model_name, model_options
    global loading_model, load_error, loras, load_progress, initialized
    initialized = loaded is not None
    loaded = loaded or LoadedSettings(settings=Settings())
    settings = loaded.settings
    explicit = loaded.explicit
    extension_params = {k: dict(v) for k, v in loaded.extension_params.items()}
    ui_defaults = dict(loaded.extra)
    model, model_name, model_options, loading_model, load_error, loras = None, None, {}, None, None, []
    load_progress = ""
    with _stop_lock:
        _stop_events.clear()


def user_data_dir() -> Path:
    """The user_data folder (absolute)."""
    return resolve(settings.user_data_dir)


def models_dir() -> Path:
    """The models folder (absolute)."""
    return resolve(settings.model_dir)


def loras_dir() -> Path:
    """The LoRA folder (absolute)."""
    return resolve(settings.lora_dir)


def register_generation(key: str, event: threading.Event) -> None:
    """Track a running generation's cancel event so that Stop can reach it."""
    with _stop_lock:
        _stop_events[key] = event


def unregister_generation(key: str) -> None:
    """Forget a finished generation."""
    with _stop_lock:
        _stop_events.pop(key, None)


def stop_generation(key: str | None = None, *, prefix: str | None = None) -> int:
    """Cancel one generation by key, those whose key starts with ``prefix`` (one caller's: the API keys its
    generations ``OWNER/ID``), or every running one; returns how many were signalled."""
    with _stop_lock:
        if prefix is not None:
            events = [event for k, event in _stop_events.items() if k.startswith(prefix)]
        else:
            events = [_stop_events[key]] if key in _stop_events else [] if key else list(_stop_events.values())
    for event in events:
        event.set()
    return len(events)


def is_generating(key: str) -> bool:
    """True while the generation registered under ``key`` (a browser session) runs."""
    with _stop_lock:
        return key in _stop_events


def running_generations() -> int:
    """How many generations are running now."""
    with _stop_lock:
        return len(_stop_events)
