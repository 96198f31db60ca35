"""Extensions: pluggy hookspecs with text-generation-webui's names, and the loader for extension folders.

An extension is a folder ``extensions/NAME/`` or ``user_data/extensions/NAME/`` (the latter wins) with a
``script.py``. Its module-level functions named like a hook below are its hook implementations; no decorator
is needed. Modifier hooks chain: each extension receives the previous one's output, in the order the
extensions were enabled. An extension that fails to import or raises in a hook is logged with its name and
switched off; the server keeps serving.
"""

from __future__ import annotations

import importlib.util
import inspect
import logging
import sys
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import pluggy

from modules import shared
from modules.errors import ExtensionFailed
from modules.paths import ROOT, UnsafePath, safe_child

log = logging.getLogger(__name__)

PROJECT = "textgen"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


class HookSpecs:
    """Every hook an extension may implement. Arguments may be omitted from an implementation."""

    @hookspec
    def setup(self) -> None:
        """Called once at startup, after the extension's ``params`` are merged with settings.yaml."""

    @hookspec
    def ui(self) -> None:
        """Build Gradio components; runs inside the extension's own block (or tab when ``params['is_tab']``)."""

    @hookspec
    def custom_css(self) -> str:  # type: ignore[empty-body]
        """Return CSS added to the web UI."""

    @hookspec
    def custom_js(self) -> str:  # type: ignore[empty-body]
        """Return JavaScript added to the web UI."""

    @hookspec
    def state_modifier(self, state: dict[str, Any]) -> dict[str, Any]:  # type: ignore[empty-body]
        """Modify the generation state (parameters, mode, names) before a generation; return it."""

    @hookspec
    def chat_input_modifier(self, text: str, visible_text: str, state: dict[str, Any]) -> tuple[str, str]:  # type: ignore[empty-body]
        """Modify the user's chat message: (text the model sees, text the history shows)."""

    @hookspec
    def input_modifier(self, string: str, state: dict[str, Any], is_chat: bool) -> str:  # type: ignore[empty-body]
        """Modify the user input in the prompt: the newest chat message, or a raw (notebook, completion) prompt."""

    @hookspec
    def bot_prefix_modifier(self, string: str, state: dict[str, Any]) -> str:  # type: ignore[empty-body]
        """Modify the reply's prefix (``Name:`` in chat modes, empty in instruct); added text steers the reply."""

    @hookspec
    def output_modifier(self, string: str, state: dict[str, Any], is_chat: bool) -> str:  # type: ignore[empty-body]
        """Modify the reply the UI shows; the model's own text stays in the history (called once, at the end)."""

    @hookspec
    def history_modifier(self, history: dict[str, Any]) -> dict[str, Any]:  # type: ignore[empty-body]
        """Modify the history before the prompt is built: ``history['messages']`` or the ``internal`` pairs."""

    @hookspec(firstresult=True)
    def custom_generate_chat_prompt(self, user_input: str, state: dict[str, Any], **kwargs: Any) -> str:  # type: ignore[empty-body]
        """Return a whole chat prompt to use instead of the template's (first result wins)."""

    @hookspec(firstresult=True)
    def custom_generate_reply(  # type: ignore[empty-body]
        self, question: str, original_question: str, state: dict[str, Any], stopping_strings: list[str], is_chat: bool
    ) -> Iterator[str]:
        """Return an iterator of the cumulative reply to use instead of the model's (first result wins)."""

    @hookspec
    def tokenizer_modifier(self, state: dict[str, Any], prompt: str, input_ids: list[int]) -> tuple[str, list[int]]:  # type: ignore[empty-body]
        """Modify the prompt and its token ids just before generation."""

    @hookspec(firstresult=True)
    def custom_tokenized_length(self, prompt: str) -> int:  # type: ignore[empty-body]
        """Return the token count of ``prompt`` for truncation (first result wins)."""

    @hookspec
    def logits_processor_modifier(self, processor_list: list[Any], input_ids: Any) -> None:
        """Append logits processors (callables ``(input_ids, scores) -> scores``) for torch backends."""

    @hookspec
    def api_routes(self, app: Any) -> None:
        """Add HTTP routes to the FastAPI app (before the web UI is mounted)."""

    @hookspec
    def register_backends(self, register: Callable[[str, Any], None]) -> None:
        """Register extra loaders: ``register(name, BackendClass)``."""


HOOK_NAMES = [name for name, _ in inspect.getmembers(HookSpecs, inspect.isfunction)]


class _Manager(pluggy.PluginManager):
    """Accept any module-level function named like a hook, so text-generation-webui scripts work as they are."""

    def parse_hookimpl_opts(self, plugin: object, name: str) -> pluggy.HookimplOpts | None:
        opts = super().parse_hookimpl_opts(plugin, name)
        if opts is None and name in HOOK_NAMES and inspect.isfunction(getattr(plugin, name, None)):
            return {
                "wrapper": False,
                "hookwrapper": False,
                "optionalhook": False,
                "tryfirst": False,
                "trylast": False,
                "specname": None,
            }
        return opts


@dataclass
class Extension:
    """One extension: its module, params, and whether it is active."""

    name: str
    path: Path
    module: ModuleType | None = None
    params: dict[str, Any] = field(default_factory=dict)
    error: str | None = None  # why it was switched off

    @property
    def active(self) -> bool:
        """True while the extension loaded and has not failed."""
        return self.module is not None and self.error is None

    @property
    def display_name(self) -> str:
        """The name shown in the UI."""
        return str(self.params.get("display_name", self.name))


manager = _Manager(PROJECT)
manager.add_hookspecs(HookSpecs)
_loaded: dict[str, Extension] = {}  # in enable order


def search_dirs() -> list[Path]:
    """Where extension folders are looked up; earlier folders win."""
    return [shared.user_data_dir() / "extensions", ROOT / "extensions"]


def available() -> list[str]:
    """Every extension folder name with a script.py, from all search folders."""
    names: set[str] = set()
    for folder in search_dirs():
        if folder.is_dir():
            names.update(p.parent.name for p in folder.glob("*/script.py") if not p.parent.name.startswith("_"))
    return sorted(names)


def find(name: str) -> Path | None:
    """The script.py for ``name`` (user_data/extensions wins over the bundled one)."""
    for folder in search_dirs():
        try:
            script = safe_child(folder, name) / "script.py"
        except UnsafePath:
            return None
        if script.is_file():
            return script
    return None


def loaded() -> list[Extension]:
    """Every extension asked for, loaded or failed, in enable order."""
    return list(_loaded.values())


def active() -> list[Extension]:
    """The extensions that are running."""
    return [e for e in _loaded.values() if e.active]


def _disable(ext: Extension, error: str) -> None:
    ext.error = error
    if ext.module is not None and manager.is_registered(ext.module):
        manager.unregister(ext.module)
    log.error("Extension %s switched off: %s", ext.name, error.strip().splitlines()[-1] if error.strip() else error)


def load_extension(name: str) -> Extension:
    """Import ``name``'s script.py, merge its params with settings.yaml, register its hooks, run setup()."""
    if name in _loaded and _loaded[name].active:
        return _loaded[name]
    script = find(name)
    ext = Extension(name=name, path=script.parent if script else Path(name))
    _loaded[name] = ext
    if script is None:
        _disable(ext, f"no extension named {name!r} (looked in {', '.join(map(str, search_dirs()))})")
        return ext
    module_name = f"textgen_ext_{name}"
    spec = importlib.util.spec_from_file_location(module_name, script)
    if spec is None or spec.loader is None:
        _disable(ext, f"cannot import {script}")
        return ext
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except Exception:
        sys.modules.pop(module_name, None)
        _disable(ext, f"import failed:\n{traceback.format_exc()}")
        return ext
    params = getattr(module, "params", None)
    if not isinstance(params, dict):
        params = {}
        module.params = params  # type: ignore[attr-defined]
    params.update(shared.extension_params.get(name, {}))
    ext.module, ext.params = module, params
    try:
        manager.register(module, name=name)
    except pluggy.PluginValidationError as exc:
        ext.module = None
        _disable(ext, f"hook signature does not match its hookspec: {exc}")
        return ext
    setup = getattr(module, "setup", None)
    if callable(setup):
        try:
            setup()
        except Exception:
            _disable(ext, f"setup() failed:\n{traceback.format_exc()}")
            return ext
    if callable(getattr(module, "register_backends", None)):
        from modules import loaders

        call(ext, "register_backends", register=loaders.register)
    log.info("Loaded extension %s", name)
    return ext


def load_extensions(names: list[str]) -> list[Extension]:
    """Load several extensions in order; failures are logged and skipped."""
    return [load_extension(name) for name in dict.fromkeys(names)]


def unload_extension(name: str) -> None:
    """Unregister an extension's hooks (its UI stays until the page is rebuilt)."""
    ext = _loaded.pop(name, None)
    if ext and ext.module is not None and manager.is_registered(ext.module):
        manager.unregister(ext.module)


def reset() -> None:
    """Unregister every extension (tests)."""
    for name in list(_loaded):
        unload_extension(name)


def _kwargs(func: Callable[..., Any], available_args: dict[str, Any]) -> dict[str, Any]:
    sig = inspect.signature(func)
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in sig.parameters.values()):
        return dict(available_args)
    return {k: v for k, v in available_args.items() if k in sig.parameters}


def call(ext: Extension, hook: str, **kwargs: Any) -> Any:
    """Call one extension's hook; on an exception, switch the extension off and return None."""
    func = getattr(ext.module, hook, None)
    if not ext.active or not callable(func):
        return None
    try:
        return func(**_kwargs(func, kwargs))
    except Exception:
        _disable(ext, f"{hook}() raised:\n{traceback.format_exc()}")
        return None


def implementers(hook: str) -> list[Extension]:
    """Active extensions implementing ``hook``, in enable order."""
    return [e for e in active() if callable(getattr(e.module, hook, None))]


def apply_modifier(hook: str, value: Any, **kwargs: Any) -> Any:
    """Chain a modifier hook: each extension gets the previous one's result (first argument), in enable order."""
    first = next(p for p in inspect.signature(getattr(HookSpecs, hook)).parameters if p != "self")
    for ext in implementers(hook):
        result = call(ext, hook, **{first: value}, **kwargs)
        if result is not None and ext.active:
            value = result
    return value


def first_result(hook: str, **kwargs: Any) -> Any:
    """The first non-None result of a firstresult hook, in enable order (an iterator is guarded, see below)."""
    for ext in implementers(hook):
        result = call(ext, hook, **kwargs)
        if result is not None:
            return guarded(ext, hook, result) if isinstance(result, Iterator) else result
    return None


def guarded(ext: Extension, hook: str, items: Iterator[Any]) -> Iterator[Any]:
    """``items`` from ``ext``'s ``hook``; if it raises while iterated, the extension is switched off and the
    generation ends with ExtensionFailed (a clear message) instead of the extension's traceback."""
    try:
        yield from items
    except Exception as exc:
        _disable(ext, f"{hook}() raised while iterated:\n{traceback.format_exc()}")
        raise ExtensionFailed(
            f"The extension {ext.name} failed ({type(exc).__name__}: {exc}) and was switched off; try again."
        ) from exc


def guard_callable(ext: Extension, hook: str, func: Callable[..., Any]) -> Callable[..., Any]:
    """``func`` (e.g. a logits processor an extension added) with the same failure isolation as ``guarded``."""

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if not ext.active:
            raise ExtensionFailed(f"The extension {ext.name} was switched off; try again.")
        try:
            return func(*args, **kwargs)
        except Exception as exc:
            _disable(ext, f"{hook}: a callable it returned raised:\n{traceback.format_exc()}")
            raise ExtensionFailed(
                f"The extension {ext.name} failed ({type(exc).__name__}: {exc}) and was switched off; try again."
            ) from exc

    return wrapper


def collect(hook: str, **kwargs: Any) -> list[Any]:
    """Every extension's non-None result of ``hook``, in enable order."""
    results = []
    for ext in implementers(hook):
        result = call(ext, hook, **kwargs)
        if result is not None:
            results.append(result)
    return results


def apply_chat_input(text: str, visible_text: str, state: dict[str, Any]) -> tuple[str, str]:
    """Chain ``chat_input_modifier``: (text the model sees, text the history shows)."""
    for ext in implementers("chat_input_modifier"):
        result = call(ext, "chat_input_modifier", text=text, visible_text=visible_text, state=state)
        if isinstance(result, (tuple, list)) and len(result) == 2:
            text, visible_text = str(result[0]), str(result[1])
    return text, visible_text


def apply_tokenizer(state: dict[str, Any], prompt: str, input_ids: list[int]) -> tuple[str, list[int]]:
    """Chain ``tokenizer_modifier``: each extension gets the previous one's prompt and ids."""
    for ext in implementers("tokenizer_modifier"):
        result = call(ext, "tokenizer_modifier", state=state, prompt=prompt, input_ids=input_ids)
        if isinstance(result, (tuple, list)) and len(result) >= 2:
            prompt, input_ids = str(result[0]), [int(t) for t in result[1]]
    return prompt, input_ids


def logits_processors(prompt_ids: list[int]) -> list[Callable[..., Any]]:
    """The ``logits_processor_modifier`` processors for one request, each guarded like a hook (torch needed).

    The pipeline calls this and hands the list to a backend that ``supports_logits_processors`` in ``extra``;
    backends never call hooks themselves.
    """
    exts = implementers("logits_processor_modifier")
    if not exts:
        return []
    import torch

    processors: list[Any] = []
    for ext in exts:
        before = len(processors)
        call(ext, "logits_processor_modifier", processor_list=processors, input_ids=torch.tensor([prompt_ids]))
        # a processor that raises switches its extension off and ends this reply with a clear error
        processors[before:] = [guard_callable(ext, "logits_processor_modifier", p) for p in processors[before:]]
    return processors


def reference() -> str:
    """The hook reference of docs/extensions.md, generated from the hookspecs."""
    lines = ["| hook | arguments | called | what it does |", "|---|---|---|---|"]
    for name in HOOK_NAMES:
        func = getattr(HookSpecs, name)
        parameters = inspect.signature(func).parameters.values()
        args = ", ".join(("**" if p.kind is p.VAR_KEYWORD else "") + p.name for p in parameters if p.name != "self")
        spec = getattr(manager.hook, name).spec
        chained = name.endswith("_modifier") and name != "logits_processor_modifier"
        kind = "first result wins" if spec and spec.opts.get("firstresult") else ("chained" if chained else "each")
        doc = " ".join((func.__doc__ or "").split())
        lines.append(f"| `{name}` | `{args}` | {kind} | {doc} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(reference())
