"""What the Code tab's buttons do: run cells in the session's kernel, let the model write a cell, save and open
files. Plain functions over the notebook, the request and plain values, so that tests call them as the page does;
the layout and the wiring are in code_notebook_tab.py."""

from __future__ import annotations

import contextlib
import threading
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import gradio as gr

from modules import shared
from modules.errors import TextgenError
from modules.generation.params import GenerationParams
from modules.notebook import assist, kernel
from modules.notebook import document as doc
from modules.notebook.render import code_html, outputs_html
from modules.ui.chat_tab import update_interval, user_of

KEY_SUFFIX = "-code-notebook"  # the session's generations, for the Stop (Interrupt) button


def _owner(request: Any) -> tuple[str, str]:
    user, _ = user_of(request)
    return user, getattr(request, "session_hash", None) or "no-session"


def _kernel(request: Any) -> kernel.KernelSession:
    user, session = _owner(request)
    return kernel.registry.get(user, session, doc.user_dir(user))


def kernel_status(request: Any) -> str:
    """The line above the cells: whether code can run, and the kernel's state."""
    if not kernel.enabled():
        return f"**{kernel.ENABLE_HINT}**"
    found = kernel.registry.find(*_owner(request))
    state = found.status() if found else "not started"
    text = f"Kernel: {state}" + (" (it starts with the first cell you run)." if state == "not started" else ".")
    warning = kernel.exposure_warning()
    return f"{text} **Warning:** {warning}" if warning else text


def _note_html(cell: doc.Cell, text: str) -> str:
    return outputs_html(cell.outputs, note=text)


_working: Counter[str] = Counter()  # browser sessions with a cell running or the model writing one
_working_lock = threading.Lock()


@contextlib.contextmanager
def _working_on(request: Any) -> Iterator[None]:
    key = getattr(request, "session_hash", None) or "no-session"
    with _working_lock:
        _working[key] += 1
    try:
        yield
    finally:
        with _working_lock:
            _working[key] -= 1
            if _working[key] <= 0:
                del _working[key]


def refuse_while_busy(request: Any) -> str:
    """Why adding, moving or replacing cells must wait (a cell of this session runs or is being written), or ''."""
    with _working_lock:
        busy = _working.get(getattr(request, "session_hash", None) or "no-session", 0) > 0
    return (
        "A cell is running or being written: wait for it (or press Interrupt), then change the cells." if busy else ""
    )


def run_cells(
    nb: doc.Notebook, sources: list[str], indexes: list[int], timeout: float | None, request: Any
) -> Iterator[tuple[doc.Notebook, dict[int, str], str]]:
    """Run code cells in order (stops at the first that fails); yields the notebook, changed outputs, status."""
    with _working_on(request):
        yield from _run_cells(nb, sources, indexes, timeout, request)


def _run_cells(
    nb: doc.Notebook, sources: list[str], indexes: list[int], timeout: float | None, request: Any
) -> Iterator[tuple[doc.Notebook, dict[int, str], str]]:
    doc.sync_sources(nb, sources)
    if not indexes:
        yield nb, {}, "No code cells to run."
        return
    try:
        session = _kernel(request)
        session.ensure_started()
    except TextgenError as exc:
        yield nb, {indexes[0]: _note_html(nb.cells[indexes[0]], str(exc))}, f"**{exc}**"
        return
    for index in indexes:
        cell = nb.cells[index]
        shown_at, outcome = 0.0, "ok"
        try:
            for run in session.execute_iter(cell.source, timeout or None):
                cell.outputs, cell.execution_count, outcome = run.outputs, run.execution_count, run.status
                if not run.done and time.monotonic() - shown_at >= update_interval():
                    shown_at = time.monotonic()
                    yield nb, {index: _note_html(cell, f"Running... {run.elapsed:.0f} s")}, "Running..."
        except TextgenError as exc:
            yield nb, {index: _note_html(cell, str(exc))}, f"**{exc}**"
            return
        yield nb, {index: _note_html(cell, "")}, kernel_status(request)
        if outcome != "ok":
            break


def propose(
    nb: doc.Notebook, sources: list[str], index: int, params: GenerationParams, request: Any
) -> Iterator[tuple[doc.Notebook, str, str, bool]]:
    """Generate (a generate cell) or Fix (a failed code cell): the model's code streams into the cell's output,
    then lands in a code cell below, not run. Yields the notebook, the cell's output HTML, a status, done."""
    with _working_on(request):
        yield from _propose(nb, sources, index, params, request)


def _propose(
    nb: doc.Notebook, sources: list[str], index: int, params: GenerationParams, request: Any
) -> Iterator[tuple[doc.Notebook, str, str, bool]]:
    doc.sync_sources(nb, sources)
    cell = nb.cells[index]
    if cell.kind not in ("code", "generate"):
        yield nb, _note_html(cell, ""), "Only generate cells and failed code cells ask the model.", False
        return
    fixing = cell.kind == "code"
    title = "Proposed fix (it appears as a new cell below):" if fixing else "The model writes the next cell:"
    code = ""
    try:
        make = assist.fix_cell if fixing else assist.generate_cell
        for code in make(nb.cells, index, params, key=request.session_hash + KEY_SUFFIX):
            yield nb, code_html(code, title) + (_note_html(cell, "") if fixing else ""), "Generating...", False
    except TextgenError as exc:
        yield nb, _note_html(cell, f"Error: {exc}"), f"**{exc}**", False
        return
    if not code.strip():
        yield nb, _note_html(cell, "The model wrote no code; try again or change the request."), "", False
        return
    doc.place_code(nb, index, code, cell, "fix_of" if fixing else "generated_from")
    yield nb, _note_html(cell, ""), "The proposed code is in the cell below; it runs when you run it.", True


def interrupt(request: gr.Request) -> str:
    """Interrupt the running cell and stop a generation of this session."""
    shared.stop_generation(request.session_hash + KEY_SUFFIX)
    found = kernel.registry.find(*_owner(request)) if kernel.enabled() else None
    if found is not None and found.interrupt():
        return "Interrupted."
    return kernel_status(request)


def restart(request: gr.Request) -> str:
    """A fresh kernel: variables and imports are gone, outputs stay on the page."""
    try:
        _kernel(request).restart()
    except TextgenError as exc:
        return f"**{exc}**"
    return "Kernel restarted: variables and imports are gone. " + kernel_status(request)


def end_session(request: gr.Request) -> None:
    """The browser session ended (tab closed or reloaded): its kernel stops."""
    if request is not None and request.session_hash:
        kernel.registry.close_session(*_owner(request))


def names(request: Any) -> list[str]:
    """The saved notebooks this user may open."""
    user, forced = user_of(request)
    return [] if forced else doc.list_notebooks(user)


def save(nb: doc.Notebook, sources: list[str], name: str, request: Any) -> tuple[doc.Notebook, str, Any]:
    """Save as ``name``.ipynb in the user's folder; returns the notebook, a message and the list update."""
    user, forced = user_of(request)
    if forced:
        return nb, "Sign in to save notebooks (--multi-user without a login keeps nothing).", gr.skip()
    doc.sync_sources(nb, sources)
    try:
        path = doc.save(user, name or nb.name, nb)
    except (TextgenError, OSError) as exc:
        return nb, f"Not saved: {exc}", gr.skip()
    return nb, f"Saved {path.name}.", gr.update(choices=names(request), value=nb.name)


def open_saved(name: str | None, request: Any) -> tuple[Any, str]:
    """A saved notebook of this user, or a skip with the reason."""
    user, _ = user_of(request)
    if not name:
        return gr.skip(), ""
    try:
        return doc.load(user, name), f"Opened {name}.ipynb."
    except TextgenError as exc:
        return gr.skip(), f"Error: {exc}"
