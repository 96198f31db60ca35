"""Model tab: the models in models/ (size, format), the loader and only its options, load / unload / reload,
LoRA adapters, and memory in use."""

from __future__ import annotations

import typing
from collections.abc import Callable
from typing import Any

import gradio as gr

from modules import models, shared
from modules.errors import TextgenError
from modules.lifecycle.memory import memory_text
from modules.settings import Settings
from modules.ui import download_panel, export_panel
from modules.ui.admin import admin_control, admin_only

AUTO = "auto (from the format)"


def status_text() -> str:
    """What is loaded now (or why not)."""
    if shared.loading_model:
        return f"Loading **{shared.loading_model}**... {shared.load_progress}".rstrip()
    if shared.model is not None:
        loader = shared.model_options.get("loader", shared.model.loader_name)
        loras = f", LoRAs: {', '.join(shared.loras)}" if shared.loras else ""
        text = f"Loaded **{shared.model_name}** ({loader}, context {shared.model.context_length}{loras})"
        engine = shared.model.stats().get("engine")
        if engine not in (None, "serving"):
            text += f"\n\nThe engine is **{engine}**: {shared.model.stats().get('engine_failure', '')}"
        system, source = models.default_system_message()
        if system:
            text += f"\n\nDefault system message (from {source}): *{system}*"
        return text
    if shared.load_error:
        return f"No model loaded. Last error: {shared.load_error}"
    return "No model loaded."


def model_rows() -> list[list[Any]]:
    """(name, format, size, loader) for the table."""
    return [[m.name, m.format, f"{m.size_bytes / 2**20:,.1f} MiB", m.loader] for m in models.list_models()]


def _all_options() -> list[str]:
    names: list[str] = []
    for loader in models.loader_names():
        for option in models.loader_options(loader):
            if option not in names:
                names.append(option)
    return names


def _option_component(name: str) -> Any:
    info = Settings.model_fields[name]
    kind = typing.get_args(info.annotation) or (info.annotation,)
    value = getattr(shared.settings, name)
    if typing.get_origin(info.annotation) is list:  # e.g. gpu_memory: one value per GPU
        return gr.Textbox(value=" ".join(map(str, value or [])), label=name, info=info.description,
                          elem_id=f"opt-{name}")  # fmt: skip
    literal = next((k for k in kind if typing.get_origin(k) is typing.Literal), None)
    if literal is not None:  # a fixed set of names, e.g. attn_implementation
        return gr.Dropdown(["", *typing.get_args(literal)], value=value or "", label=name, info=info.description,
                           elem_id=f"opt-{name}")  # fmt: skip
    if bool in kind:
        return gr.Checkbox(value=bool(value), label=name, info=info.description, elem_id=f"opt-{name}")
    if int in kind or float in kind:
        return gr.Number(
            value=value, label=name, info=info.description, precision=0 if int in kind else None, elem_id=f"opt-{name}"
        )
    if name.endswith("_key"):  # a secret is never put into a visitor's page: empty keeps the server's own
        placeholder = "set on the server (hidden); type here to use another" if value else ""
        return gr.Textbox(value="", type="password", placeholder=placeholder, label=name, info=info.description,
                          elem_id=f"opt-{name}")  # fmt: skip
    return gr.Textbox(
        value="" if value is None else str(value), label=name, info=info.description, elem_id=f"opt-{name}"
    )


def shown_options(choice: str, name: str | None) -> set[str]:
    """The options to show: the chosen loader's, or with "auto" the loader the selected model will use."""
    chosen = choice
    if choice == AUTO:
        try:
            chosen = models.planned_loader(name) if name else ""
        except TextgenError:
            chosen = ""
    return set(models.loader_options(chosen)) if chosen else set(_all_options())


def build() -> tuple[Callable[[], list[Any]], list[Any]]:
    """Create the tab and its events; returns the page-load event (function, outputs) for ui/app.py to wire."""
    table = gr.Dataframe(
        model_rows(), headers=["model", "format", "size", "loader"], interactive=False, elem_id="models-table"
    )
    with gr.Row():
        dropdown = gr.Dropdown(
            models.model_names(), value=shared.model_name, label="Model", elem_id="model-dropdown", scale=4
        )
        loader = gr.Dropdown(
            [AUTO, *models.loader_names()], value=AUTO, label="Loader", elem_id="loader-dropdown", scale=2
        )
        refresh_btn = gr.Button("Refresh", scale=1, size="sm")
    option_names = _all_options()
    with gr.Accordion("Loader options (0 or empty: automatic)", open=True):
        with gr.Row(equal_height=False):
            components = []
            for name in option_names:
                with gr.Column(min_width=180):
                    components.append(_option_component(name))
    with gr.Row():
        load_btn = admin_control(gr.Button("Load", variant="primary", elem_id="model-load"))
        reload_btn = admin_control(gr.Button("Reload", elem_id="model-reload"))
        unload_btn = admin_control(gr.Button("Unload", elem_id="model-unload"))
    status = gr.Markdown(status_text, elem_id="model-status")
    with gr.Accordion("LoRA adapters", open=False):
        loras = gr.CheckboxGroup(models.list_loras(), label="Adapters in loras/", elem_id="lora-list")
        apply_loras = admin_control(gr.Button("Apply LoRAs", elem_id="lora-apply"))
    memory = gr.Markdown(memory_text, elem_id="memory")
    export_panel.build()
    download_panel.build(dropdown)  # the plan for this machine, estimate vs measured memory, Hub download

    def visible_options(choice: str, name: str | None) -> list[Any]:
        shown = shown_options(choice, name)
        return [gr.update(visible=n in shown) for n in option_names]

    def on_page_load() -> list[Any]:
        """The loaded (or loading) model selected, and only its loader's options shown."""
        name = shared.model_name or shared.loading_model
        choices = models.model_names()
        return [gr.update(choices=choices, value=name if name in choices else None), *visible_options(AUTO, name)]

    def overrides(values: tuple[Any, ...]) -> dict[str, Any]:
        result = {}
        for name, value in zip(option_names, values, strict=True):
            automatic = Settings.model_fields[name].default is None
            if typing.get_origin(Settings.model_fields[name].annotation) is list:
                value = str(value or "").replace(",", " ").split()
            if value in ("", None, []) or (automatic and value == 0):
                continue
            result[name] = value
        return result

    def load(name: str | None, choice: str, *values: Any) -> tuple[str, str]:
        if not name:
            gr.Warning("Pick a model first.")
            return status_text(), memory_text()
        chosen = {} if choice == AUTO else {"loader": choice}
        try:
            models.load_model(name, {**chosen, **overrides(values)})
        except TextgenError as exc:
            gr.Warning(str(exc))
        return status_text(), memory_text()

    def reload(choice: str, *values: Any) -> tuple[str, str]:
        if not shared.model_name:
            gr.Warning("No model is loaded.")
            return status_text(), memory_text()
        return load(shared.model_name, choice, *values)

    def unload() -> tuple[str, str]:
        models.unload_model()
        return status_text(), memory_text()

    def apply(names: list[str]) -> tuple[str, str]:
        try:
            models.apply_loras(names or [])
        except TextgenError as exc:
            gr.Warning(str(exc))
        return status_text(), memory_text()

    def refresh() -> tuple[Any, Any, Any]:
        return (
            gr.update(choices=models.model_names(), value=shared.model_name),
            model_rows(),
            gr.update(choices=models.list_loras()),
        )

    loader.change(visible_options, [loader, dropdown], components, queue=False)
    dropdown.change(visible_options, [loader, dropdown], components, queue=False)
    load_btn.click(admin_only("load models")(load), [dropdown, loader, *components], [status, memory],
                   concurrency_limit=1, api_name="model_load")  # fmt: skip
    reload_btn.click(admin_only("reload the model")(reload), [loader, *components], [status, memory],
                     concurrency_limit=1, api_name="model_reload")  # fmt: skip
    unload_btn.click(admin_only("unload the model")(unload), None, [status, memory], concurrency_limit=1,
                     api_name="model_unload")  # fmt: skip
    apply_loras.click(admin_only("apply LoRAs")(apply), loras, [status, memory], concurrency_limit=1,
                      api_name="lora_apply")  # fmt: skip
    refresh_btn.click(refresh, None, [dropdown, table, loras], queue=False)
    timer = gr.Timer(3.0)
    timer.tick(lambda: (status_text(), memory_text()), None, [status, memory], queue=False, show_progress="hidden")
    return on_page_load, [dropdown, *components]
