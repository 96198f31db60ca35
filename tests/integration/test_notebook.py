"""The Code notebook: a real ipykernel per session, .ipynb files, the flag, and the real default model writing cells.

Kernel starts cost about a second each, so the kernel tests share one module-scoped kernel; the test that restarts
it comes last.
"""

from __future__ import annotations

import base64
import json
import os
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import nbformat
import pytest

from modules import models, shared
from modules.errors import InvalidRequest
from modules.generation.params import GenerationParams
from modules.notebook import assist, kernel
from modules.notebook import document as doc
from modules.notebook.kernel import GRACE, CodeExecutionDisabled, KernelLimits, KernelSession
from modules.notebook.render import outputs_html
from modules.ui import code_notebook_handlers as handlers
from tests.conftest import DEFAULT_MODEL

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def code_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """The server runs with --enable-code-execution (for this test only)."""
    monkeypatch.setattr(shared, "settings", shared.settings.model_copy(update={"enable_code_execution": True}))


@pytest.fixture(scope="module")
def session(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KernelSession]:
    """One kernel for the kernel tests (started by the first of them)."""
    kernel_session = KernelSession(tmp_path_factory.mktemp("kernel-cwd"), KernelLimits(timeout=30))
    yield kernel_session
    kernel_session.shutdown()


@pytest.fixture
def registry() -> Iterator[kernel.KernelRegistry]:
    """The server's registry, emptied (and its kernels stopped) after the test."""
    yield kernel.registry
    kernel.registry.shutdown_all()


def request(session_hash: str, username: str | None = None) -> Any:
    """What the UI handlers read from gr.Request."""
    return SimpleNamespace(session_hash=session_hash, username=username)


def text_of(run: kernel.Execution, name: str = "stdout") -> str:
    return "".join(o["text"] for o in run.outputs if o["output_type"] == "stream" and o["name"] == name)


def alive(pid: int | None) -> bool:
    if pid is None:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is gone for our purposes
    status = Path(f"/proc/{pid}/status")
    return not (status.exists() and "State:\tZ" in status.read_text())


def wait_until_idle(session: KernelSession, seconds: float = 5) -> None:
    deadline = time.monotonic() + seconds
    while session.busy and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not session.busy, "the kernel is still running a cell"


# --- the kernel ---


def test_a_variable_set_in_one_cell_is_seen_by_the_next(session: KernelSession, code_on: None) -> None:
    first = session.execute("x = 41\nimport math")
    assert first.status == "ok" and first.outputs == []
    second = session.execute("print(x + 1, math.floor(2.5))\nx * 2")
    assert second.status == "ok"
    assert text_of(second) == "42 2\n"
    result = [o for o in second.outputs if o["output_type"] == "execute_result"]
    assert result and result[0]["data"]["text/plain"] == "82"
    assert second.execution_count == first.execution_count + 1  # type: ignore[operator]


def test_the_kernel_gets_none_of_the_server_s_secrets(
    tmp_path: Path, code_on: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("HF_TOKEN", "TEXTGEN_API_KEY", "AWS_SECRET_ACCESS_KEY", "OPENAI_API_KEY", "MY_DB_PASSWORD"):
        monkeypatch.setenv(name, "s3cr3t-value")
    monkeypatch.setenv("LC_ALL", "C.UTF-8")
    fresh = KernelSession(tmp_path, KernelLimits(timeout=30))
    try:
        run = fresh.execute("import os\nprint(sorted(k for k, v in os.environ.items() if 's3cr3t' in v))")
        assert run.status == "ok" and text_of(run) == "[]\n", run.outputs
        assert text_of(fresh.execute("print(os.environ.get('LC_ALL'), 'PATH' in os.environ)")) == "C.UTF-8 True\n"
    finally:
        fresh.shutdown()


def test_an_ended_session_stops_only_its_own_user_s_kernel(
    hub: Any, code_on: None, registry: kernel.KernelRegistry, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(shared, "settings", shared.settings.model_copy(update={"multi_user": True}))
    bob = registry.get("bob", "same-hash", Path("."))
    alice = registry.get("alice", "same-hash", Path("."))
    handlers.end_session(SimpleNamespace(session_hash="same-hash", username="alice"))  # type: ignore[arg-type]
    assert registry.find("alice", "same-hash") is None and registry.find("bob", "same-hash") is bob
    assert alice is not bob


def test_an_infinite_loop_is_interrupted_and_the_kernel_still_answers(session: KernelSession, code_on: None) -> None:
    session.execute("kept = 'still here'")
    started = time.monotonic()
    run = session.execute("while True:\n    pass", timeout=1.5)
    assert run.status == "timeout" and 1.5 <= time.monotonic() - started < 1.5 + GRACE
    assert any(o.get("ename") == "KeyboardInterrupt" for o in run.outputs)
    assert "limit" in text_of(run, "stderr")
    after = session.execute("print(kept)")
    assert after.status == "ok" and text_of(after) == "still here\n"  # the same kernel: variables kept

    # the Interrupt button: a cell with no time limit, stopped from another thread
    # the cell says when it runs (a file): an interrupt that reaches the kernel before the cell starts is lost, and
    # one more while the kernel sends its reply could lose the reply, so it is pressed once, when the cell runs
    marker = session.cwd / "interrupt-test-marker"
    marker.unlink(missing_ok=True)
    runs: list[kernel.Execution] = []
    cell = f"import pathlib, time\npathlib.Path({marker.name!r}).touch()\nwhile True: time.sleep(0.01)"
    worker = threading.Thread(target=lambda: runs.append(session.execute(cell, 0)))
    worker.start()
    deadline = time.monotonic() + 30
    while not marker.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert marker.exists(), "the cell never ran"
    assert session.interrupt()
    worker.join(20)
    assert runs and runs[0].status == "interrupted"
    assert session.execute("kept").status == "ok"


def test_snapshots_read_from_any_thread_and_a_reader_that_leaves(session: KernelSession, code_on: None) -> None:
    # Gradio asks a streaming handler for each next item from whichever worker thread is free
    pool = ThreadPoolExecutor(max_workers=3)
    stream = session.execute_iter("import time\nfor i in range(4):\n    print(i)\n    time.sleep(0.2)")
    runs = []
    while True:
        run = pool.submit(next, stream, None).result(10)
        if run is None:
            break
        runs.append(run)
    assert len(runs) > 2 and not runs[0].done and runs[-1].status == "ok"
    assert text_of(runs[-1]) == "0\n1\n2\n3\n"

    # the browser went away: the generator is closed, the cell stops, the kernel takes the next cell
    stream = session.execute_iter("import time\nwhile True: time.sleep(0.05)", 0)
    pool.submit(next, stream).result(10)
    pool.submit(stream.close).result(10)
    pool.shutdown()
    wait_until_idle(session)
    assert session.execute("print('free')").outputs[-1]["text"] == "free\n"


def test_output_is_capped(session: KernelSession, code_on: None) -> None:
    session.limits.max_output_chars = 5_000
    try:
        run = session.execute("for i in range(2000):\n    print('line', i)")
    finally:
        session.limits.max_output_chars = KernelLimits.max_output_chars
    assert run.status == "ok" and run.truncated
    assert len(text_of(run)) == 5_000
    assert "truncated at 5000 characters" in text_of(run, "stderr")


def test_a_plot_comes_back_as_an_image_and_a_table_as_html(session: KernelSession, code_on: None) -> None:
    run = session.execute("import matplotlib.pyplot as plt\nplt.plot([1, 4, 9])\nplt.title('squares')\nplt.show()")
    assert run.status == "ok"
    images = [o["data"]["image/png"] for o in run.outputs if "image/png" in o.get("data", {})]
    assert len(images) == 1 and base64.b64decode(images[0]).startswith(PNG_MAGIC)
    assert '<img class="nb-image"' in outputs_html(run.outputs)

    table = session.execute(
        "import pandas as pd\npd.DataFrame({'city': ['Oslo', 'Lima'], 'people': [700, 10000]})"
    ).outputs
    html = outputs_html(table)
    assert "<table" in html and "<td>Lima</td>" in html and "<style" not in html

    sneaky = session.execute(
        "from IPython.display import HTML\nHTML('<b>bold</b><img src=x onerror=alert(1)><script>x</script>')"
    )
    shown = outputs_html(sneaky.outputs)
    assert "<b>bold</b>" in shown and "onerror" not in shown and "<script" not in shown


def test_restart_forgets_variables(session: KernelSession, code_on: None) -> None:
    session.execute("forgotten = 1")
    old = session.pid
    session.restart()
    assert session.pid != old and not alive(old)
    run = session.execute("forgotten")
    assert run.status == "error" and run.outputs[-1]["ename"] == "NameError"


# --- sessions, the flag, the UI handlers ---


def run_code(nb: doc.Notebook, index: int, who: Any) -> doc.Notebook:
    """Run one cell through the UI handler, as the Run button does; returns the notebook it leaves."""
    steps = list(handlers.run_cells(nb, [c.source for c in nb.cells], [index], 20, who))
    return steps[-1][0]


def notebook(*sources: str) -> doc.Notebook:
    return doc.Notebook(cells=[doc.Cell(source=s) for s in sources])


def test_two_sessions_do_not_share_variables(hub: Any, code_on: None, registry: kernel.KernelRegistry) -> None:
    alice = run_code(notebook("secret = 'tea'", "print(secret)"), 0, request("tab-1"))
    alice = run_code(alice, 1, request("tab-1"))
    assert alice.cells[1].outputs[0]["text"] == "tea\n"
    bob = run_code(notebook("print(secret)"), 0, request("tab-2"))
    assert bob.cells[0].outputs[-1]["ename"] == "NameError"
    first, second = registry.find("default", "tab-1"), registry.find("default", "tab-2")
    assert first is not None and second is not None and first.pid != second.pid

    # while a cell runs, the cells cannot be added, moved or replaced (the page would lose the running output)
    running = handlers.run_cells(
        notebook("import time\ntime.sleep(30)"), ["import time\ntime.sleep(30)"], [0], 0, request("tab-2")
    )
    next(running)
    assert "wait for it" in handlers.refuse_while_busy(request("tab-2"))
    assert handlers.refuse_while_busy(request("tab-1")) == ""
    running.close()
    assert handlers.refuse_while_busy(request("tab-2")) == ""

    # the browser session ends (demo.unload): its kernel stops; an idle one is stopped by the reaper's check
    pid = first.pid
    handlers.end_session(request("tab-1"))  # type: ignore[arg-type]
    assert registry.find("default", "tab-1") is None and not alive(pid)
    wait_until_idle(second)  # the cell the closed stream left is being interrupted
    second.limits.idle_shutdown = 0
    assert registry.shutdown_idle() == 1 and not second.started


def test_with_the_flag_off_nothing_executes(hub: Any, tmp_path: Path, registry: kernel.KernelRegistry) -> None:
    assert not shared.settings.enable_code_execution
    marker = tmp_path / "ran.txt"
    nb = notebook(f"open({str(marker)!r}, 'w').write('ran')")
    steps = list(handlers.run_cells(nb, [nb.cells[0].source], [0], 10, request("tab-off")))
    assert steps and "--enable-code-execution" in steps[-1][1][0] and "--enable-code-execution" in steps[-1][2]
    assert "--enable-code-execution" in handlers.restart(request("tab-off"))  # type: ignore[arg-type]
    assert "--enable-code-execution" in handlers.kernel_status(request("tab-off"))
    time.sleep(0.5)
    assert not marker.exists()
    assert registry.sessions() == [] and nb.cells[0].outputs == []
    with pytest.raises(CodeExecutionDisabled):
        KernelSession(tmp_path).execute("1")


# --- files ---


def test_a_saved_notebook_validates_and_opens_again_with_its_outputs(
    hub: Any, code_on: None, registry: kernel.KernelRegistry
) -> None:
    who = request("tab-files")
    nb = notebook("import matplotlib.pyplot as plt\nplt.plot([3, 1, 2]); plt.show()", "print('saved output')")
    nb.cells.insert(0, doc.Cell(kind="markdown", source="# Analysis"))
    nb.cells.append(doc.Cell(kind="generate", source="plot it again in red"))
    nb = run_code(nb, 1, who)
    nb = run_code(nb, 2, who)
    _, message, _ = handlers.save(nb, [c.source for c in nb.cells], "my analysis", who)
    assert message == "Saved my analysis.ipynb."
    path = doc.notebooks_root() / "default" / "my analysis.ipynb"
    node = nbformat.read(path, as_version=4)
    nbformat.validate(node)
    assert node.nbformat == 4 and node.nbformat_minor == 5
    assert [c.cell_type for c in node.cells] == ["markdown", "code", "code", "markdown"]
    assert node.cells[3].metadata["textgen"]["kind"] == "generate"
    assert node.cells[2].outputs[0]["text"] == "saved output\n"

    opened, text = handlers.open_saved("my analysis", who)
    assert text == "Opened my analysis.ipynb." and isinstance(opened, doc.Notebook)
    assert [c.kind for c in opened.cells] == ["markdown", "code", "code", "generate"]
    assert opened.cells[1].outputs == nb.cells[1].outputs and opened.cells[1].execution_count == 1
    png = opened.cells[1].outputs[0]["data"]["image/png"]
    assert base64.b64decode(png).startswith(PNG_MAGIC)

    exported = doc.export(opened)  # download, then upload again
    assert exported.name == "my analysis.ipynb"
    assert doc.upload(exported).cells[2].outputs == nb.cells[2].outputs
    for bad in ("../escape", "/etc/passwd", "a/b", ""):
        with pytest.raises(InvalidRequest):
            doc.save("default", bad, nb)
    broken = path.with_name("broken.ipynb")
    cell = {"cell_type": "code", "id": "a1", "source": "x", "metadata": {}, "execution_count": None}
    bogus = {"nbformat": 4, "nbformat_minor": 5, "metadata": {}, "cells": [{**cell, "outputs": [{"output_type": "?"}]}]}
    broken.write_text(json.dumps(bogus))  # JSON that nbformat reads, but not a valid notebook
    with pytest.raises(InvalidRequest, match="not a valid notebook"):
        doc.upload(broken)


def test_with_multi_user_each_user_has_their_own_notebooks(hub: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shared, "settings", shared.settings.model_copy(update={"multi_user": True}))
    handlers.save(notebook("a = 1"), ["a = 1"], "alice-work", request("t1", "alice"))
    handlers.save(notebook("b = 2"), ["b = 2"], "bob-work", request("t2", "bob"))
    assert doc.list_notebooks("alice") == ["alice-work"] and doc.list_notebooks("bob") == ["bob-work"]
    _, message = handlers.open_saved("alice-work", request("t2", "bob"))
    assert "no notebook" in message
    _, refused, _ = handlers.save(notebook("c"), ["c"], "anon", request("t3"))  # no login: nothing kept
    assert "Sign in" in refused and not (doc.notebooks_root() / "anonymous").exists()


# --- the model writes cells ---


def test_a_generate_cell_produces_code_from_the_default_model(
    with_default_model: Path, code_on: None, registry: kernel.KernelRegistry
) -> None:
    models.load_model(DEFAULT_MODEL)
    nb = notebook("numbers = [3, 1, 2]")
    nb.cells[0].outputs, nb.cells[0].execution_count = [{"output_type": "stream", "name": "stdout", "text": "ok\n"}], 1
    nb.cells.append(doc.Cell(kind="generate", source="sort the numbers and print them"))
    params = GenerationParams(temperature=0, max_new_tokens=40)
    steps = list(handlers.propose(nb, [c.source for c in nb.cells], 1, params, request("tab-gen")))
    streamed = [html for _, html, text, done in steps if text == "Generating..."]
    assert len(streamed) > 2, "the code must arrive in pieces"
    nb, _, status, done = steps[-1]
    assert done and "runs when you run it" in status
    made = nb.cells[2]
    assert made.kind == "code" and made.source.strip() and "```" not in made.source
    assert made.outputs == [] and made.execution_count is None  # shown, not run
    assert made.metadata["textgen"]["generated_from"] == nb.cells[1].id
    assert registry.sessions() == []  # no kernel was started

    # generating again replaces the proposal while it is untouched; once edited (or run) it is kept
    doc.place_code(nb, 1, "print('second try')", nb.cells[1], "generated_from")
    assert len(nb.cells) == 3 and nb.cells[2].source == "print('second try')"
    nb.cells[2].source += "  # mine"
    doc.place_code(nb, 1, "print('third try')", nb.cells[1], "generated_from")
    assert len(nb.cells) == 4 and nb.cells[3].source == "print('second try')  # mine"


def test_fix_proposes_a_cell_from_the_traceback(with_default_model: Path, code_on: None) -> None:
    backend = models.load_model(DEFAULT_MODEL)
    nb = notebook("total = sum([1, 2, 3]) / 0")
    nb.cells[0].outputs = [
        {"output_type": "error", "ename": "ZeroDivisionError", "evalue": "division by zero",
         "traceback": ["\x1b[31mZeroDivisionError\x1b[39m: division by zero"]},
    ]  # fmt: skip
    prompt = assist.build_prompt(backend, [], assist.fix_task(nb.cells[0]), 60)
    assert "ZeroDivisionError: division by zero" in prompt and "\x1b" not in prompt
    steps = list(
        handlers.propose(nb, [nb.cells[0].source], 0, GenerationParams(temperature=0, max_new_tokens=40), request("t"))
    )
    fixed, _, _, done = steps[-1]
    assert done and len(fixed.cells) == 2 and fixed.cells[1].source.strip()
    assert fixed.cells[1].metadata["textgen"]["fix_of"] == nb.cells[0].id


def test_the_prompt_is_cut_to_the_context_oldest_cells_first(with_default_model: Path) -> None:
    backend = models.load_model(DEFAULT_MODEL)
    cells = []
    for i in range(120):
        cell = doc.Cell(source=f"value_{i} = {i}")
        cell.outputs = [{"output_type": "stream", "name": "stdout", "text": f"marker-{i} " + "word " * 600}]
        cells.append(cell)
    prompt = assist.build_prompt(backend, cells, assist.generate_task("go on"), 256)
    tokens = len(backend.encode(prompt))
    assert tokens <= backend.context_length - 256
    assert "value_119 = 119" in prompt and "value_0 = 0" not in prompt
    assert "characters left out" in prompt  # each output is clipped too
    assert prompt.endswith(assist.OPEN_FENCE)
