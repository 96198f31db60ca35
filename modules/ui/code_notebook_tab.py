"""Code notebook tab: code, markdown and generate cells over a Jupyter kernel per browser session. Layout and
wiring only: the buttons' handlers are in code_notebook_handlers.py, the kernel, the .ipynb files and the model's
cells in modules/notebook/."""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gradio as gr

from modules.errors import TextgenError
from modules.notebook import document as doc
from modules.notebook import kernel
from modules.notebook.render import outputs_html
from modules.ui.admin import admin_only
from modules.ui.chat_tab import update_interval
from modules.ui.code_notebook_handlers import (
    end_session,
    interrupt,
    kernel_status,
    names,
    open_saved,
    propose,
    refuse_while_busy,
    restart,
    run_cells,
    save,
)
from modules.ui.parameters_tab import ParamsUI

log = logging.getLogger(__name__)
# Code cells run with the server's rights: with --gradio-auth only --gradio-admin users may run them.
RUN_CODE = "run code (it runs with the server's rights)"
# The cells are redrawn when ``version`` changes; every redraw takes a new number, so two changes never cancel out.
# Handlers change the notebook in place (the session keeps the same object): a cell that is still running when
# the notebook is replaced (New, Open, Upload) writes into the old one and never brings it back.
_VERSIONS = itertools.count(1)
LABELS = {"code": "Code", "markdown": "Markdown", "generate": "Generate (the model writes the next cell)", "raw": "Raw"}
CSS = """
.nb-cell { border-left: 3px solid var(--border-color-primary); }
.nb-kind-generate { border-left-color: var(--color-accent); }
.nb-outputs pre { margin: 0.2em 0; padding: 0.3em 0.5em; white-space: pre-wrap; font-size: 0.85em; }
.nb-stderr { background: #fff4e5; } .nb-error { background: #fde8e8; color: #8a1c1c; }
.nb-image { max-width: 100%; } .nb-note, .nb-out-prompt { font-size: 0.8em; opacity: 0.75; }
.nb-html table { border-collapse: collapse; font-size: 0.85em; }
.nb-html th, .nb-html td { border: 1px solid var(--border-color-primary) !important; padding: 2px 6px !important; }
"""
# Shift+Enter in a cell runs it (as in Jupyter): a capture listener sees the key before the code editor does.
SHIFT_ENTER_JS = """
if (!window.__textgenNotebookKeys) {
  window.__textgenNotebookKeys = true;
  document.addEventListener('keydown', (event) => {
    if (event.key !== 'Enter' || !event.shiftKey) return;
    const cell = event.target.closest && event.target.closest('.nb-cell');
    if (!cell) return;
    event.preventDefault();
    event.stopPropagation();
    setTimeout(() => cell.querySelector('.nb-run')?.click(), 50);
  }, true);
}
"""


@dataclass
class CodeNotebookUI:
    """The tab's fixed components (the cells are drawn by a render function)."""

    state: Any
    version: Any
    status: Any
    message: Any
    timeout: Any
    name: Any
    saved: Any
    file: Any  # the last download, also offered as a link
    params: ParamsUI | None = None  # the Parameters tab (built after this one), set by wire()


def build(demo: gr.Blocks) -> CodeNotebookUI:
    """Create the tab: toolbar, file controls, and the cells (redrawn when cells are added, moved or opened)."""
    state = gr.State(doc.new_notebook())
    version = gr.Number(0, visible=False)
    gr.Markdown(
        "Code cells run in a Python kernel of your own (variables and imports stay between cells); Shift+Enter "
        "runs a cell. A *generate* cell asks the loaded model for the next code cell, which runs only when you run "
        "it. The kernel runs code with the server's rights: there is no sandbox."
    )
    status = gr.Markdown(elem_id="nb-status")
    gr.HTML("", js_on_load=SHIFT_ENTER_JS, elem_id="nb-keys")
    with gr.Row():
        interrupt_btn = _small("Interrupt", "nb-interrupt", variant="stop")
        restart_btn = _small("Restart kernel", "nb-restart")
        new_btn = _small("New notebook", "nb-new")
        upload = gr.UploadButton("Upload .ipynb", file_types=[".ipynb"], size="sm", scale=0, min_width=110,
                                 elem_id="nb-upload")  # fmt: skip
    with gr.Row(equal_height=True):
        timeout = gr.Number(kernel.KernelLimits.from_settings().timeout, label="Cell time limit (s)", minimum=0,
                            precision=0, elem_id="nb-timeout", min_width=140, scale=0, interactive=True)  # fmt: skip
        name = gr.Textbox(label="Name", placeholder="my-analysis", elem_id="nb-name", scale=2, interactive=True)
        saved = gr.Dropdown([], label="Open a saved notebook", elem_id="nb-saved", scale=2)
    message = gr.Markdown(elem_id="nb-message")
    file = gr.File(label="Download", visible=False, interactive=False, elem_id="nb-file", height=60)
    ui = CodeNotebookUI(state, version, status, message, timeout, name, saved, file)

    @gr.render(inputs=[state], triggers=[version.change, demo.load])
    def cells(nb: doc.Notebook) -> None:
        if ui.params is None:
            raise RuntimeError("code_notebook_tab.wire() was not called")
        _draw(ui, ui.params, nb)

    def on_new(request: gr.Request) -> tuple[Any, ...]:
        if busy := refuse_while_busy(request):
            return gr.skip(), gr.skip(), gr.skip(), busy
        return doc.new_notebook(), next(_VERSIONS), "", "New notebook."

    new_btn.click(on_new, None, [state, version, name, message], queue=False)
    interrupt_btn.click(interrupt, None, status, queue=False)
    restart_btn.click(admin_only(RUN_CODE)(restart), None, status, concurrency_limit=None)

    def on_open(chosen: str | None, request: gr.Request) -> tuple[Any, ...]:
        if busy := refuse_while_busy(request):
            return gr.skip(), gr.skip(), gr.skip(), busy
        nb, text = open_saved(chosen, request)
        if isinstance(nb, doc.Notebook):
            return nb, next(_VERSIONS), nb.name, text
        return gr.skip(), gr.skip(), gr.skip(), text

    saved.input(on_open, saved, [state, version, name, message], queue=False)

    def on_upload(file: str | None, request: gr.Request) -> tuple[Any, ...]:
        if busy := refuse_while_busy(request):
            return gr.skip(), gr.skip(), gr.skip(), busy
        try:
            nb = doc.upload(Path(file)) if file else None
        except (TextgenError, OSError) as exc:
            return gr.skip(), gr.skip(), gr.skip(), f"Not opened: {exc}"
        if nb is None:
            return gr.skip(), gr.skip(), gr.skip(), "No file."
        return nb, next(_VERSIONS), nb.name, f"Opened the upload ({len(nb.cells)} cells); Save keeps it here."

    upload.upload(on_upload, upload, [state, version, name, message], queue=False)

    def on_load(request: gr.Request) -> tuple[str, Any]:
        return kernel_status(request), gr.update(choices=names(request))

    demo.load(on_load, None, [status, saved])
    demo.unload(end_session)
    warning = kernel.exposure_warning()
    if warning:
        log.warning("%s", warning)
    return ui


def wire(ui: CodeNotebookUI, params: ParamsUI) -> None:
    """Give the cells the Parameters tab (Generate and Fix sample with its values)."""
    ui.params = params


def _label(cell: doc.Cell) -> str:
    if cell.kind == "code":
        return f"In [{cell.execution_count if cell.execution_count is not None else ' '}]"
    return LABELS.get(cell.kind, cell.kind)


def _draw(ui: CodeNotebookUI, params: ParamsUI, nb: doc.Notebook) -> None:
    """The cells and their buttons; every handler reads every editor, so that no edit is lost on a redraw."""
    with gr.Row():
        run_all = _small("Run all", "nb-run-all", variant="primary")
        clear = _small("Clear outputs", "nb-clear")
        save_btn = _small("Save", "nb-save")
        download = _small("Download .ipynb", "nb-download")
    sources, outs, labels, fixes, rows = [], [], [], [], []
    for i, cell in enumerate(nb.cells):
        with gr.Group(elem_classes=["nb-cell", f"nb-kind-{cell.kind}"], elem_id=f"nb-cell-{i}"):
            with gr.Row(equal_height=True, elem_classes=["nb-cell-bar"]):
                label = gr.Markdown(_label(cell), elem_id=f"nb-label-{i}", min_width=80, scale=1)
                kind = gr.Dropdown(list(doc.KINDS[:3]), value=cell.kind if cell.kind in doc.KINDS[:3] else None,
                                   show_label=False, container=False, elem_id=f"nb-kind-{i}", min_width=120, scale=0,
                                   interactive=True)  # fmt: skip
                run = _small("Run", f"nb-run-{i}", variant="primary", elem_classes=["nb-run"])
                fix = _small("Fix", f"nb-fix-{i}", visible=cell.fixable)
                up, down = _small("Up", f"nb-up-{i}"), _small("Down", f"nb-down-{i}")
                below = _small("+ Below", f"nb-add-{i}")
                remove = _small("Delete", f"nb-delete-{i}", variant="stop")
            language = "python" if cell.kind == "code" else "markdown" if cell.kind == "markdown" else None
            source = gr.Code(cell.source, language=language, show_label=False, lines=2, elem_id=f"nb-src-{i}",
                             interactive=True)  # fmt: skip
            if cell.kind == "markdown" and cell.source.strip():
                gr.Markdown(cell.source, elem_classes=["nb-markdown"])
            out = gr.HTML(outputs_html(cell.outputs), elem_id=f"nb-out-{i}")
        # every edit reaches the notebook at once, so that a redraw (a cell added while another runs) loses none
        source.input(
            _source_setter(cell), source, None, queue=False, show_progress="hidden", trigger_mode="always_last"
        )
        sources.append(source)
        outs.append(out)
        labels.append(label)
        fixes.append(fix)
        rows.append((i, cell, kind, run, fix, up, down, below, remove))
    with gr.Row():
        add_code = _small("+ Code", "nb-add-code")
        add_md = _small("+ Markdown", "nb-add-markdown")
        add_gen = _small("+ Generate", "nb-add-generate")
    ins = [ui.state, *sources]

    def structural(change: Any) -> Any:
        def handler(request: gr.Request, nb: doc.Notebook, *texts: str) -> tuple[Any, ...]:
            if busy := refuse_while_busy(request):
                return gr.skip(), gr.skip(), busy
            doc.sync_sources(nb, list(texts))
            change(nb)
            return nb, next(_VERSIONS), gr.skip()

        return handler

    def wire_structure(button: Any, change: Any) -> None:
        button.click(structural(change), ins, [ui.state, ui.version, ui.message], queue=False)

    for kind_name, button in (("code", add_code), ("markdown", add_md), ("generate", add_gen)):
        wire_structure(button, lambda n, k=kind_name: doc.insert(n, len(n.cells), k))
    wire_structure(clear, doc.clear_outputs)

    def code_runner(indexes: list[int] | None) -> Any:
        def handler(request: gr.Request, nb: doc.Notebook, limit: float | None, *texts: str) -> Iterator[Any]:
            chosen = indexes if indexes is not None else [i for i, c in enumerate(nb.cells) if c.kind == "code"]
            for current, changed, text in run_cells(nb, list(texts), chosen, limit, request):
                cells = list(enumerate(current.cells))
                yield (
                    text, *[changed.get(i, gr.skip()) for i in range(len(outs))],
                    *[_label(c) if i in changed else gr.skip() for i, c in cells],
                    *[gr.update(visible=c.fixable) if i in changed else gr.skip() for i, c in cells],
                )  # fmt: skip

        return handler

    run_outputs = [ui.status, *outs, *labels, *fixes]
    run_all.click(
        admin_only(RUN_CODE)(code_runner(None)), [ui.state, ui.timeout, *sources], run_outputs, concurrency_limit=None
    )
    propose_inputs = [ui.state, *sources, *params.components]

    for i, cell, kind, run, fix, up, down, below, remove in rows:
        kind.input(_kind_setter(i), [ui.state, kind, *sources], [ui.state, ui.version, kind, ui.message], queue=False)
        wire_structure(up, lambda n, i=i: doc.move(n, i, -1))
        wire_structure(down, lambda n, i=i: doc.move(n, i, 1))
        wire_structure(below, lambda n, i=i: doc.insert(n, i + 1, "code"))
        wire_structure(remove, lambda n, i=i: doc.remove(n, i))
        proposal = [outs[i], ui.status, ui.version]
        if cell.kind == "code":
            run.click(
                admin_only(RUN_CODE)(code_runner([i])),
                [ui.state, ui.timeout, *sources],
                run_outputs,
                concurrency_limit=None,
            )
            fix.click(_proposer(i, params), propose_inputs, proposal, concurrency_limit=None)
        elif cell.kind == "generate":
            run.click(_proposer(i, params), propose_inputs, proposal, concurrency_limit=None)
        else:  # markdown: show it rendered
            wire_structure(run, lambda n: None)

    def on_save(request: gr.Request, nb: doc.Notebook, name: str, *texts: str) -> tuple[Any, ...]:
        return save(nb, list(texts), name, request)[1:]

    save_btn.click(on_save, [ui.state, ui.name, *sources], [ui.message, ui.saved], queue=False)

    def on_download(nb: doc.Notebook, name: str, *texts: str) -> Any:
        doc.sync_sources(nb, list(texts))
        try:
            nb.name = doc.check_name(name) if name.strip() else nb.name
            return gr.update(value=str(doc.export(nb)), visible=True)
        except TextgenError as exc:
            return gr.update(value=None, visible=False, label=f"Not downloaded: {exc}")

    download.click(on_download, [ui.state, ui.name, *sources], ui.file, queue=False).then(
        None, js="() => { setTimeout(() => document.querySelector('#nb-file a')?.click(), 100); }"
    )


def _small(text: str, elem_id: str, **kwargs: Any) -> Any:
    return gr.Button(text, size="sm", scale=0, min_width=kwargs.pop("min_width", 110), elem_id=elem_id, **kwargs)


def _source_setter(cell: doc.Cell) -> Any:
    def handler(text: str) -> None:
        cell.source = text if isinstance(text, str) else ""

    return handler


def _kind_setter(index: int) -> Any:
    def handler(request: gr.Request, nb: doc.Notebook, kind: str, *texts: str) -> tuple[Any, ...]:
        if busy := refuse_while_busy(request):
            return gr.skip(), gr.skip(), nb.cells[index].kind, busy  # the menu goes back to the cell's kind
        doc.sync_sources(nb, list(texts))
        if kind in doc.KINDS and index < len(nb.cells):
            doc.set_kind(nb.cells[index], kind)
        return nb, next(_VERSIONS), gr.skip(), gr.skip()

    return handler


def _proposer(index: int, params: ParamsUI) -> Any:
    count = len(params.components)

    def handler(request: gr.Request, nb: doc.Notebook, *values: Any) -> Iterator[Any]:
        texts, settings = list(values[: len(values) - count]), values[len(values) - count :]
        try:
            gen = params.to_params(*settings)
        except TextgenError as exc:
            yield gr.skip(), f"**{exc}**", gr.skip()
            return
        shown_at = 0.0
        for _nb, html, text, done in propose(nb, texts, index, gen, request):
            if not done and text == "Generating..." and time.monotonic() - shown_at < update_interval():
                continue
            shown_at = time.monotonic()
            yield html, text, next(_VERSIONS) if done else gr.skip()

    return handler
