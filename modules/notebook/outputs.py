"""A running cell's iopub messages as nbformat v4 outputs (``nbformat.v4.output_from_msg`` maps them): streams
merged, clear_output and display updates honoured, the total size capped. The kernel's thread feeds a collector
while the page reads snapshots of it."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import nbformat

OUTPUT_MESSAGES = ("stream", "display_data", "execute_result", "error")  # what nbformat.v4.output_from_msg maps


@dataclass
class Execution:
    """A cell's run: its outputs as nbformat v4 output dicts, while it runs and when it is done."""

    outputs: list[dict[str, Any]] = field(default_factory=list)
    execution_count: int | None = None
    status: str = "running"  # running, ok, error, interrupted, timeout, restarted
    elapsed: float = 0.0
    truncated: bool = False

    @property
    def done(self) -> bool:
        """True once the cell has finished, one way or another."""
        return self.status != "running"


def _size(output: dict[str, Any]) -> int:
    if output["output_type"] == "stream":
        return len(output["text"])
    if output["output_type"] == "error":
        return sum(len(line) for line in output["traceback"]) + len(output["evalue"])
    return sum(len(v) if isinstance(v, str) else len(str(v)) for v in output.get("data", {}).values())


class OutputCollector:
    """Turns iopub messages into nbformat outputs: merges streams, honours clear_output, caps the size."""

    def __init__(self, limit: int) -> None:
        self.result = Execution()
        self.limit = limit
        self.used = 0
        self.clear_pending = False
        self.displays: dict[str, int] = {}  # display_id -> index in outputs
        self.outcome: str | None = None  # how the run ended when textgen ended it (timeout, restarted)
        self.lock = threading.Lock()

    def snapshot(self) -> Execution:
        """A copy of the run so far (the kernel's thread keeps adding to the original)."""
        with self.lock:
            result = self.result
            outputs = [dict(o) for o in result.outputs]
            return Execution(outputs, result.execution_count, result.status, result.elapsed, result.truncated)

    def elapsed(self, seconds: float) -> None:
        """How long the cell has run."""
        self.result.elapsed = seconds

    def finish(self, outcome: str | None, final: bool = True) -> None:
        """Record how the run ended (the first outcome given wins); ``final`` marks the run done."""
        with self.lock:
            self.outcome = self.outcome or outcome
            if not final:
                return
            errors = [o for o in self.result.outputs if o["output_type"] == "error"]
            interrupted = any(o["ename"] == "KeyboardInterrupt" for o in errors)
            self.result.status = self.outcome or ("interrupted" if interrupted else "error" if errors else "ok")

    def _room(self, size: int) -> int:
        return max(0, self.limit - self.used) if size > 0 else 0

    def _truncate(self) -> None:
        if not self.result.truncated:
            self.result.truncated = True
            note = f"\n[textgen: output truncated at {self.limit} characters]\n"
            self.result.outputs.append({"output_type": "stream", "name": "stderr", "text": note})

    def _append(self, output: dict[str, Any]) -> None:
        if self.clear_pending:
            self.result.outputs.clear()
            self.displays.clear()
            self.used, self.clear_pending = 0, False
        outputs = self.result.outputs
        if output["output_type"] == "stream":
            text = output["text"]
            room = self._room(len(text))
            if room < len(text):
                output = {**output, "text": text[:room]}
            if output["text"]:
                self.used += len(output["text"])
                last = outputs[-1] if outputs else None
                if last and last["output_type"] == "stream" and last["name"] == output["name"]:
                    last["text"] += output["text"]
                else:
                    outputs.append(output)
            if room < len(text):
                self._truncate()
            return
        size = _size(output)
        if self.result.truncated or size > self._room(size):
            self._truncate()
            return
        self.used += size
        outputs.append(output)

    def feed(self, msg: dict[str, Any]) -> None:
        """Take one iopub message (as jupyter_client gives it) that belongs to the running cell."""
        with self.lock:
            self._feed(msg["header"]["msg_type"], msg)

    def _feed(self, msg_type: str, msg: dict[str, Any]) -> None:
        content = msg["content"]
        if msg_type in OUTPUT_MESSAGES:
            try:
                output = dict(nbformat.v4.output_from_msg(msg))  # nbformat's own mapping, validated
            except (KeyError, ValueError, nbformat.ValidationError) as exc:
                self._note(f"the kernel sent a {msg_type} message that is no valid output ({exc!s:.200})")
                return
            self._append(output)
            display_id = (content.get("transient") or {}).get("display_id")
            if display_id and self.result.outputs and self.result.outputs[-1] is output:
                self.displays[display_id] = len(self.result.outputs) - 1
        elif msg_type == "update_display_data":
            index = self.displays.get((content.get("transient") or {}).get("display_id", ""))
            if index is not None and index < len(self.result.outputs):
                self.result.outputs[index]["data"] = content.get("data", {})
        elif msg_type == "clear_output":
            if content.get("wait"):
                self.clear_pending = True
            else:
                self.result.outputs.clear()
                self.displays.clear()
                self.used = 0
        elif msg_type == "execute_input":
            self.result.execution_count = content.get("execution_count")

    def _note(self, text: str) -> None:
        self.result.outputs.append({"output_type": "stream", "name": "stderr", "text": f"[textgen: {text}]\n"})

    def note(self, text: str) -> None:
        """Add a line from textgen itself (not from the kernel) to the outputs."""
        with self.lock:
            self._note(text)
