"""A cell's iopub messages (as jupyter_client delivers them) become the outputs the page shows and the .ipynb keeps."""

from __future__ import annotations

from typing import Any

from jupyter_client.session import Session

from modules.notebook import document as doc
from modules.notebook.outputs import OutputCollector
from modules.notebook.render import outputs_html

SESSION = Session()


def message(msg_type: str, **content: Any) -> dict[str, Any]:
    """An iopub message in the protocol's own shape (header, parent_header, content, ...)."""
    return SESSION.msg(msg_type, content)


def test_messages_become_outputs_that_show_and_save() -> None:
    collector = OutputCollector(limit=10_000)
    collector.feed(message("execute_input", code="...", execution_count=3))
    collector.feed(message("stream", name="stdout", text="a\n"))
    collector.feed(message("stream", name="stdout", text="b\n"))  # one output with both lines, as Jupyter shows it
    collector.feed(message("stream", name="stderr", text="careful\n"))
    progress = {"display_id": "bar"}
    collector.feed(message("display_data", data={"text/plain": "0%"}, metadata={}, transient=progress))
    collector.feed(message("update_display_data", data={"text/plain": "100%"}, metadata={}, transient=progress))
    table = "<table><tr><td>Lima</td></tr></table><script>alert(1)</script>"
    collector.feed(message("execute_result", data={"text/html": table, "text/plain": "t"}, metadata={},
                           execution_count=3))  # fmt: skip
    traceback = ["\x1b[31mValueError\x1b[0m: bad value"]
    collector.feed(message("error", ename="ValueError", evalue="bad value", traceback=traceback))
    collector.finish(None)
    run = collector.snapshot()

    assert run.status == "error" and run.execution_count == 3 and not run.truncated
    assert [o["output_type"] for o in run.outputs] == ["stream", "stream", "display_data", "execute_result", "error"]
    shown = outputs_html(run.outputs)
    for seen in ('<pre class="nb-stdout">a\nb\n</pre>', '<pre class="nb-stderr">careful\n</pre>', "100%",
                 "Out[3]:", "<td>Lima</td>", "ValueError: bad value"):  # fmt: skip
        assert seen in shown, seen
    assert ">0%<" not in shown and "<script" not in shown and "\x1b" not in shown

    cell = doc.Cell(source="...", outputs=run.outputs, execution_count=3)
    saved = doc.loads(doc.dumps(doc.Notebook(cells=[cell])))  # validated by nbformat, then opened again
    assert saved.cells[0].outputs == run.outputs and saved.cells[0].failed


def test_clear_output_a_malformed_message_and_the_cap() -> None:
    collector = OutputCollector(limit=20)
    collector.feed(message("stream", name="stdout", text="old\n"))
    collector.feed(message("clear_output", wait=True))  # cleared when the next output comes
    collector.feed(message("stream", name="stdout", text="0123456789" * 3))
    collector.feed(message("display_data", data={"text/plain": "x"}))  # no metadata: not a valid output
    collector.finish(None)
    run = collector.snapshot()
    assert run.status == "ok" and run.truncated
    assert run.outputs[0]["text"] == "0123456789" * 2  # "old" gone, the text cut at the limit
    stderr = "".join(o["text"] for o in run.outputs if o.get("name") == "stderr")
    assert "display_data message that is no valid output" in stderr and "truncated at 20 characters" in stderr
