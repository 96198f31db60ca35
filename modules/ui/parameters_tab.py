"""Parameters tab: every GenerationParams field, grouped, with presets load/save/delete.

The components are generated from the dataclass's fields and metadata, so a new sampler shows up here by itself.
"""

from __future__ import annotations

import contextlib
import json
import typing
from dataclasses import dataclass
from typing import Any

import gradio as gr

from modules import shared
from modules.errors import TextgenError
from modules.generation import presets
from modules.generation.params import GenerationParams

GROUPS = {
    "limits": "Length and stopping",
    "temperature": "Temperature",
    "truncation": "Truncation samplers",
    "penalties": "Repetition penalties",
    "mirostat": "Mirostat",
    "constraints": "Constraints",
    "output": "Output",
}
SLIDER_MAX = {"max_new_tokens": 4096, "min_tokens": 2048, "top_k": 200, "repetition_penalty": 2.0,
              "repetition_penalty_range": 4096, "dynatemp_range": 5.0, "dynatemp_exponent": 5.0,
              "no_repeat_ngram_size": 20, "dry_multiplier": 5.0, "dry_base": 4.0, "dry_allowed_length": 20,
              "mirostat_tau": 10.0, "mirostat_eta": 1.0, "top_a": 1.0}  # fmt: skip
HIDDEN = {"logprobs", "top_logprobs"}  # set by the API and extensions, not by hand
DEFAULT_PRESET = "Min-P"


@dataclass
class ParamsUI:
    """The parameter components, in GenerationParams order, and the preset controls."""

    names: list[str]
    components: list[Any]
    preset: Any
    ignored: Any

    def to_params(self, *values: Any) -> GenerationParams:
        """GenerationParams from the components' values (as passed to an event handler)."""
        data = dict(zip(self.names, values, strict=True))
        for name, value in list(data.items()):
            data[name] = _from_component(name, value)
        return GenerationParams.from_dict(data)


def _to_component(name: str, value: Any) -> Any:
    if name == "logit_bias":
        return json.dumps({str(k): v for k, v in value.items()})
    if name == "json_schema":
        return json.dumps(value, indent=1) if value else ""
    if name in ("stop", "dry_sequence_breakers"):
        return json.dumps(value, ensure_ascii=False)
    return value


def _from_component(name: str, value: Any) -> Any:
    if name in ("logit_bias", "json_schema", "stop", "dry_sequence_breakers"):
        text = str(value or "").strip()
        if not text:
            return {} if name == "logit_bias" else ([] if name != "json_schema" else None)
        try:
            return json.loads(text)
        except ValueError as exc:
            raise gr.Error(f"{name}: not valid JSON ({exc})") from exc
    return value


def _component(name: str, default: Any, kind: Any, doc: str, ge: float | None, le: float | None) -> Any:
    label = name
    if kind is bool:
        return gr.Checkbox(value=default, label=label, info=doc, elem_id=f"param-{name}")
    if kind in (int, float) and ge is not None and (le is not None or name in SLIDER_MAX):
        top = le if le is not None else SLIDER_MAX[name]
        step = 1 if kind is int else 0.01
        return gr.Slider(ge, top, value=default, step=step, label=label, info=doc, elem_id=f"param-{name}")
    if kind in (int, float):
        return gr.Number(
            value=default, label=label, info=doc, precision=0 if kind is int else None, elem_id=f"param-{name}"
        )
    if name in ("grammar", "json_schema"):
        return gr.Textbox(value=_to_component(name, default), label=label, info=doc, lines=3, elem_id=f"param-{name}")
    return gr.Textbox(value=_to_component(name, default), label=label, info=doc, elem_id=f"param-{name}")


def initial_values() -> dict[str, Any]:
    """Defaults overlaid with the default preset (or ``preset:`` from settings.yaml)."""
    values = GenerationParams.defaults()
    name = str(shared.ui_defaults.get("preset", DEFAULT_PRESET))
    with contextlib.suppress(TextgenError):
        values.update(presets.load_preset(name))
    return values


def ignored_text() -> str:
    """Which parameters the loaded backend ignores."""
    backend = shared.model
    if backend is None:
        return "No model loaded: every parameter is shown."
    from modules.loaders.base import PIPELINE_PARAMS

    handled = backend.supported_params | PIPELINE_PARAMS
    ignored = [n for n in GenerationParams.field_names() if n not in handled]
    if not ignored:
        return f"The {backend.loader_name} backend uses every parameter."
    return f"The {backend.loader_name} backend ignores: " + ", ".join(f"`{n}`" for n in ignored)


def build() -> ParamsUI:
    """Create the tab's components (events that need them are wired by the other tabs)."""
    hints = typing.get_type_hints(GenerationParams)
    info = GenerationParams.field_info()
    values = initial_values()
    with gr.Row():
        choices = presets.list_presets()
        default = str(shared.ui_defaults.get("preset", DEFAULT_PRESET))
        preset = gr.Dropdown(
            choices, value=default if default in choices else None, label="Preset", elem_id="preset-dropdown", scale=3
        )
        load_btn = gr.Button("Load", elem_id="preset-load", scale=1)
        delete_btn = gr.Button("Delete", elem_id="preset-delete", scale=1)
    with gr.Row():
        new_name = gr.Textbox(label="Save as preset", placeholder="name", elem_id="preset-name", scale=3)
        save_btn = gr.Button("Save", elem_id="preset-save", scale=1)
    message = gr.Markdown(elem_id="preset-message")
    ignored = gr.Markdown(ignored_text(), elem_id="params-ignored")
    names: list[str] = []
    components: list[Any] = []
    for group, title in GROUPS.items():
        members = [n for n, f in info.items() if f.metadata["group"] == group and n not in HIDDEN]
        if not members:
            continue
        with gr.Accordion(title, open=group in ("limits", "temperature", "truncation")):
            with gr.Row(equal_height=False):
                for name in members:
                    meta = info[name].metadata
                    kind = hints[name]
                    base = kind if kind in (bool, int, float) else str
                    with gr.Column(min_width=240):
                        components.append(_component(name, values[name], base, meta["doc"], meta["ge"], meta["le"]))
                    names.append(name)
    ui = ParamsUI(names=names, components=components, preset=preset, ignored=ignored)

    def load(name: str | None) -> list[Any]:
        if not name:
            raise gr.Error("Pick a preset first.")
        try:
            loaded = {**GenerationParams.defaults(), **presets.load_preset(name)}
        except TextgenError as exc:
            raise gr.Error(str(exc)) from exc
        return [_to_component(n, loaded[n]) for n in names] + [f"Loaded preset {name}."]

    def save(name: str, *current: Any) -> tuple[Any, str]:
        try:
            params = ui.to_params(*current)
            presets.save_preset(name.strip(), params)
        except TextgenError as exc:
            raise gr.Error(str(exc)) from exc
        return gr.update(choices=presets.list_presets(), value=name.strip()), f"Saved preset {name.strip()}."

    def delete(name: str | None) -> tuple[Any, str]:
        if not name:
            raise gr.Error("Pick a preset first.")
        try:
            presets.delete_preset(name)
        except TextgenError as exc:
            raise gr.Error(str(exc)) from exc
        return gr.update(choices=presets.list_presets(), value=None), f"Deleted preset {name}."

    load_btn.click(load, preset, [*components, message])
    preset.input(load, preset, [*components, message])
    save_btn.click(save, [new_name, *components], [preset, message])
    delete_btn.click(delete, preset, [preset, message])
    return ui
