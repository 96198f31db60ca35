"""Session tab: extensions (status, on/off, params), the flags in effect, saving settings.yaml."""

from __future__ import annotations

import json
from typing import Any

import gradio as gr

from modules import extensions, session
from modules.errors import TextgenError
from modules.ui.admin import admin_control, admin_only


def build() -> None:
    """Create the Session tab's components inside the current Blocks context."""
    gr.Markdown("### Extensions")
    table = gr.Dataframe(  # callables: read again at each page load, so a failure after startup shows
        session.extension_rows, headers=["extension", "status", "name"], interactive=False, elem_id="extensions-table"
    )
    enabled = gr.CheckboxGroup(
        extensions.available(),
        value=lambda: [e.name for e in extensions.active()],
        label="Enabled",
        elem_id="extensions-enabled",
    )
    apply = admin_control(
        gr.Button("Apply (hooks at once; an extension's own UI appears after a restart)", elem_id="extensions-apply")
    )
    message = gr.Markdown(elem_id="extensions-message")
    with gr.Row():
        chosen = gr.Dropdown(
            [e.name for e in extensions.loaded()], label="Extension params", elem_id="params-extension"
        )
        save_params = admin_control(gr.Button("Set params", elem_id="params-set"))
    editor = gr.Code(language="json", label="params", elem_id="params-editor")

    def do_apply(names: list[str]) -> tuple[Any, str, Any]:
        problems = session.set_active(names)
        text = "Failed: " + "; ".join(problems) if problems else "Extensions updated."
        return session.extension_rows(), text, gr.update(choices=[e.name for e in extensions.loaded()])

    def do_set(name: str, text: str) -> str:
        try:
            session.update_params(name, text)
        except TextgenError as exc:
            return f"Error: {exc}"
        return f"params of {name} updated"

    apply.click(admin_only("enable or disable extensions")(do_apply), enabled, [table, message, chosen])
    chosen.change(session.params_json, chosen, editor)
    save_params.click(admin_only("change extension params")(do_set), [chosen, editor], message)

    gr.Markdown("### Settings")
    shown = gr.Code(json.dumps(session.flags(), indent=2), language="json", label="In effect", elem_id="flags")
    save = admin_control(
        gr.Button("Save settings to user_data/settings.yaml (keys and passwords are left out)", elem_id="save-settings")
    )
    saved = gr.Markdown(elem_id="save-settings-message")

    def do_save() -> tuple[str, str]:
        path = session.save_settings()
        return json.dumps(session.flags(), indent=2), f"Saved {path}"

    save.click(admin_only("save settings")(do_save), None, [shown, saved])
