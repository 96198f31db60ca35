"""The loaded model writes the next code cell (Generate) or a corrected cell (Fix) from the notebook so far.

The prompt holds the cells and their outputs (each output clipped), rendered with the model's chat template;
the oldest cells are left out when they do not fit the context. The reply is opened with a Python code fence
and ends at the closing one, so that even a small model answers with code only. Generation goes through the
usual pipeline (extension hooks, stop strings, the Stop button).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

from modules.chat.prompt import fit_history, instruction_template, render_messages
from modules.errors import InvalidRequest
from modules.generation.params import GenerationParams
from modules.generation.pipeline import current_model, stream_text
from modules.loaders.base import Backend
from modules.notebook.document import Cell
from modules.notebook.render import error_text, plain_text

SYSTEM = (
    "You write Python code cells for a Jupyter notebook. Variables and imports from earlier cells still exist. "
    "Reply with the code of one cell only, in a single ```python block, without explanations."
)
OPEN_FENCE = "```python\n"
CLOSE_FENCE = "```"
OUTPUT_CHARS = 1500  # characters of one cell's output in the prompt (its start and end)
CONTINUE = "Write the next code cell: the next sensible step of this notebook."
_FENCED = re.compile(r"```[ \t]*(?:python|py)?[ \t]*\n(.*?)(?:```|\Z)", re.DOTALL)


def clip(text: str, limit: int = OUTPUT_CHARS) -> str:
    """``text`` with its middle left out when it is longer than ``limit``."""
    if len(text) <= limit:
        return text
    half = limit // 2
    return f"{text[:half]}\n... ({len(text) - 2 * half} characters left out) ...\n{text[-half:]}"


def cell_block(cell: Cell) -> str:
    """One cell as the prompt shows it."""
    if cell.kind == "code":
        count = cell.execution_count if cell.execution_count is not None else " "
        text = f"In [{count}]:\n```python\n{cell.source.rstrip()}\n```"
        shown = plain_text(cell.outputs)
        return text + (f"\nOutput:\n```\n{clip(shown)}\n```" if shown else "")
    if cell.kind == "generate":
        return f"(Request to the assistant: {cell.source.strip()})" if cell.source.strip() else ""
    return cell.source.strip()


def _messages(context: list[str], task: str) -> list[dict[str, Any]]:
    body = "\n\n".join(b for b in context if b)
    notebook = f"The notebook so far:\n\n{body}\n\n" if body else "The notebook is empty.\n\n"
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": notebook + task}]


def build_prompt(backend: Backend, cells: list[Cell], task: str, max_new_tokens: int) -> str:
    """The chat prompt for ``task`` with as many of the newest ``cells`` as fit; ends inside a code fence."""
    template = instruction_template(backend, None)

    def build(kept: list[dict[str, Any]]) -> str:
        messages = _messages([k["text"] for k in kept[:-1]], kept[-1]["text"])
        try:
            text = render_messages(backend, messages, template=template)
        except InvalidRequest:  # a template without a system role: say it in the user's turn
            merged = [{"role": "user", "content": f"{messages[0]['content']}\n\n{messages[1]['content']}"}]
            text = render_messages(backend, merged, template=template)
        return text + OPEN_FENCE

    items = [{"text": cell_block(c)} for c in cells] + [{"text": task}]
    prompt, _ = fit_history(backend, build, items, max_new_tokens)
    return prompt


def generate_task(instruction: str) -> str:
    """What the model is asked to do for a generate cell."""
    instruction = instruction.strip()
    return f"Write the next code cell. The user asks: {instruction}" if instruction else CONTINUE


def fix_task(cell: Cell) -> str:
    """What the model is asked to do for a cell that failed."""
    return (
        "This code cell failed:\n```python\n"
        f"{cell.source.rstrip()}\n```\nError:\n```\n{clip(error_text(cell.outputs), 3000)}\n```\n"
        "Write a corrected version of the whole cell."
    )


def extract_code(reply: str) -> str:
    """The code in a reply that started inside a code fence (a fenced block the model opened itself is unwrapped)."""
    text = reply.split(CLOSE_FENCE, 1)[0] if not reply.lstrip().startswith(CLOSE_FENCE) else reply
    found = _FENCED.search(text if text.strip() else reply)
    return (found.group(1) if found else text).strip("\n").rstrip()


def stream_code(prompt: str, params: GenerationParams, key: str | None = None) -> Iterator[str]:
    """The code as the model writes it (cumulative), the final text last."""
    params = params.replace(stop=[*params.stop, CLOSE_FENCE])
    for text, _stats in stream_text(prompt, params, key=key):
        yield extract_code(text)


def generate_cell(cells: list[Cell], index: int, params: GenerationParams, key: str | None = None) -> Iterator[str]:
    """Code for the generate cell at ``index``, from the cells above it; streamed (cumulative)."""
    backend = current_model()
    prompt = build_prompt(backend, cells[:index], generate_task(cells[index].source), params.max_new_tokens)
    return stream_code(prompt, params, key)


def fix_cell(cells: list[Cell], index: int, params: GenerationParams, key: str | None = None) -> Iterator[str]:
    """A corrected version of the failed code cell at ``index``; streamed (cumulative)."""
    cell = cells[index]
    if not cell.fixable:
        raise InvalidRequest("only a code cell whose last run raised an error can be fixed")
    backend = current_model()
    prompt = build_prompt(backend, cells[:index], fix_task(cell), params.max_new_tokens)
    return stream_code(prompt, params, key)
