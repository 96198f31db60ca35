"""Parameters tab: every GenerationParams field, grouped, with presets load/save/delete.

The components are generated from the dataclass's fields and metadata, so a new sampler shows up here by itself.
"""

from __future__ import annotations

import contextlib
import json
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import gradio as gr

from modules import models, shared
from modules.errors import TextgenError
from modules.generation import presets
from modules.generation.params import GenerationParams
from modules.ui.admin import admin_control, admin_only

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
MODEL_PRESET = "Model's recommendation"  # the loaded model's own sampling (metadata or models_settings.yaml)


@dataclass
class ParamsUI:
    """The parameter components, in GenerationParams order, and the preset controls."""

    names: list[str]
    components: list[Any]
    preset: Any
    ignored: Any
    sampling: Any  # says what the loaded model recommends
    page_load: Callable[[], list[Any]] | None = None  # fills the components when a page opens
    page_load_outputs: list[Any] = field(default_factory=list)

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


def model_values() -> dict[str, Any] | None:
    """Defaults overlaid with the loaded model's recommended sampling, or None when it recommends none."""
    recommended, _ = models.recommended_sampling()
    return {**GenerationParams.defaults(), **recommended} if recommended else None


def sampling_text() -> str:
    """What the loaded model recommends, and whether the page uses it."""
    recommended, source = models.recommended_sampling()
    if not recommended:
        return "The loaded model recommends no sampling." if shared.model is not None else ""
    values = ", ".join(f"`{k}` {v}" for k, v in recommended.items())
    return f"**{MODEL_PRESET}** (from {source}): {values}."


def page_start() -> tuple[str | None, dict[str, Any]]:
    """The preset a new page starts from: ``preset:`` in settings.yaml if set, else the model's own sampling if it
    has some, else the default preset."""
    chosen = shared.ui_defaults.get("preset")
    recommended = model_values()
    if chosen is None and recommended is not None:
        return MODEL_PRESET, recommended
    name = str(chosen or DEFAULT_PRESET)
    return (name if name in presets.list_presets() else None), initial_values()


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
            [MODEL_PRESET, *choices],
            value=default if default in choices else None,
            label="Preset",
            elem_id="preset-dropdown",
            scale=3,
        )
        load_btn = gr.Button("Load", elem_id="preset-load", scale=1)
        delete_btn = admin_control(gr.Button("Delete", elem_id="preset-delete", scale=1))
    with gr.Row():
        new_name = gr.Textbox(label="Save as preset", placeholder="name", elem_id="preset-name", scale=3)
        save_btn = admin_control(gr.Button("Save", elem_id="preset-save", scale=1))
    message = gr.Markdown(elem_id="preset-message")
    sampling = gr.Markdown(sampling_text(), elem_id="params-sampling")
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
    ui = ParamsUI(names=names, components=components, preset=preset, ignored=ignored, sampling=sampling)

    def load(name: str | None) -> list[Any]:
        if not name:
            raise gr.Error("Pick a preset first.")
        if name == MODEL_PRESET:
            recommended = model_values()
            if recommended is None:
                raise gr.Error("The loaded model recommends no sampling (or no model is loaded).")
            return [_to_component(n, recommended[n]) for n in names] + [f"Loaded the {MODEL_PRESET.lower()}."]
        try:
            loaded = {**GenerationParams.defaults(), **presets.load_preset(name)}
        except TextgenError as exc:
            raise gr.Error(str(exc)) from exc
        return [_to_component(n, loaded[n]) for n in names] + [f"Loaded preset {name}."]

    def on_page_load() -> list[Any]:
        name, values = page_start()
        return [_to_component(n, values[n]) for n in names] + [gr.update(value=name), sampling_text()]

    ui.page_load = on_page_load  # wired by ui/app.py beside the other page-load events
    ui.page_load_outputs = [*components, preset, sampling]

    def save(name: str, *current: Any) -> tuple[Any, str]:
        if name.strip() == MODEL_PRESET:
            raise gr.Error(f"{MODEL_PRESET!r} is the loaded model's own sampling; save under another name.")
        try:
            params = ui.to_params(*current)
            presets.save_preset(name.strip(), params)
        except TextgenError as exc:
            raise gr.Error(str(exc)) from exc
        return gr.update(
            choices=[MODEL_PRESET, *presets.list_presets()], value=name.strip()
        ), f"Saved preset {name.strip()}."

    def delete(name: str | None) -> tuple[Any, str]:
        if not name or name == MODEL_PRESET:
            raise gr.Error("Pick a preset file first.")
        try:
            presets.delete_preset(name)
        except TextgenError as exc:
            raise gr.Error(str(exc)) from exc
        return gr.update(choices=[MODEL_PRESET, *presets.list_presets()], value=None), f"Deleted preset {name}."

    load_btn.click(load, preset, [*components, message])
    preset.input(load, preset, [*components, message])
    save_btn.click(admin_only("save presets")(save), [new_name, *components], [preset, message])
    delete_btn.click(admin_only("delete presets")(delete), preset, [preset, message])
    return ui
