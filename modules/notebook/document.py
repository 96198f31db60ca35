"""Code notebooks as .ipynb (nbformat 4.5, validated) under user_data/notebooks/USER/, written atomically.

A notebook holds code, markdown and 'generate' cells. A generate cell (the instruction the model writes the next
code cell from) is saved as a markdown cell marked ``metadata.textgen.kind = "generate"``, so that Jupyter opens
the file too.
"""

from __future__ import annotations

import copy
import hashlib
import re
import secrets
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import nbformat

from modules import shared
from modules.chat.history import DEFAULT_USER
from modules.chat.history import _folder_name as folder_name
from modules.errors import InvalidRequest
from modules.fileio import atomic_write_text
from modules.paths import UnsafePath, safe_child

KINDS = ("code", "markdown", "generate", "raw")
SUFFIX = ".ipynb"
MAX_FILE_BYTES = 50 * 1024 * 1024  # larger uploads are refused
_NAME = re.compile(r"[\w][\w .()-]{0,99}", re.UNICODE)
_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")
METADATA = {
    "kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"},
    "language_info": {"name": "python"},
}


def new_id() -> str:
    """A cell id (nbformat 4.5: letters, digits, - and _)."""
    return secrets.token_hex(6)


@dataclass
class Cell:
    """One cell; ``outputs`` are nbformat v4 output dicts (code cells only)."""

    kind: str = "code"
    source: str = ""
    outputs: list[dict[str, Any]] = field(default_factory=list)
    execution_count: int | None = None
    id: str = field(default_factory=new_id)
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def failed(self) -> bool:
        """True when the cell's last run raised."""
        return any(o.get("output_type") == "error" for o in self.outputs)

    @property
    def fixable(self) -> bool:
        """A code cell whose last run raised something other than an interrupt: the model may propose a fix."""
        errors = [o for o in self.outputs if o.get("output_type") == "error"]
        return self.kind == "code" and any(o.get("ename") != "KeyboardInterrupt" for o in errors)


@dataclass
class Notebook:
    """The cells and, once saved or opened, the file name (without .ipynb)."""

    cells: list[Cell] = field(default_factory=list)
    name: str = ""
    metadata: dict[str, Any] = field(default_factory=lambda: copy.deepcopy(METADATA))


def new_notebook() -> Notebook:
    """A notebook with one empty code cell."""
    return Notebook(cells=[Cell()])


def _cell_node(cell: Cell) -> Any:
    metadata = copy.deepcopy(cell.metadata)
    if cell.kind == "code":
        node = nbformat.v4.new_code_cell(cell.source, id=cell.id, metadata=metadata)
        node.outputs = [nbformat.from_dict(o) for o in cell.outputs]
        node.execution_count = cell.execution_count
        return node
    if cell.kind == "raw":
        return nbformat.v4.new_raw_cell(cell.source, id=cell.id, metadata=metadata)
    if cell.kind == "generate":
        metadata.setdefault("textgen", {})["kind"] = "generate"
    return nbformat.v4.new_markdown_cell(cell.source, id=cell.id, metadata=metadata)


def to_node(notebook: Notebook) -> Any:
    """The notebook as an nbformat v4.5 node."""
    node = nbformat.v4.new_notebook(metadata=copy.deepcopy(notebook.metadata) or copy.deepcopy(METADATA))
    node.nbformat_minor = 5
    node.cells = [_cell_node(c) for c in notebook.cells]
    return node


def validate(node: Any) -> None:
    """Raise InvalidRequest saying what is wrong unless ``node`` is a valid notebook."""
    try:
        nbformat.validate(node)
    except nbformat.ValidationError as exc:
        raise InvalidRequest(f"not a valid notebook: {exc.message}") from exc


def dumps(notebook: Notebook) -> str:
    """The .ipynb text (validated before it is returned)."""
    node = to_node(notebook)
    validate(node)
    return str(nbformat.writes(node, version=4))


def _kind(node: Any) -> str:
    if node.cell_type == "markdown" and (node.get("metadata", {}).get("textgen") or {}).get("kind") == "generate":
        return "generate"
    return str(node.cell_type)


def from_node(node: Any, name: str = "") -> Notebook:
    """A notebook from a validated nbformat v4 node; missing or repeated cell ids get new ones."""
    cells, seen = [], set()
    for item in node.cells:
        cell_id = str(item.get("id") or "")
        if not _ID.fullmatch(cell_id) or cell_id in seen:
            cell_id = new_id()
        seen.add(cell_id)
        metadata = copy.deepcopy(dict(item.get("metadata", {})))
        if isinstance(metadata.get("textgen"), dict):
            metadata["textgen"].pop("kind", None)
            if not metadata["textgen"]:
                metadata.pop("textgen")
        cell = Cell(kind=_kind(item), source=str(item.source), id=cell_id, metadata=metadata)
        if item.cell_type == "code":
            cell.outputs = [_plain(o) for o in item.get("outputs", [])]
            cell.execution_count = item.get("execution_count")
        cells.append(cell)
    metadata = copy.deepcopy(dict(node.get("metadata", {}))) or copy.deepcopy(METADATA)
    return Notebook(cells=cells or [Cell()], name=name, metadata=_plain(metadata))


def _plain(value: Any) -> Any:
    """NotebookNodes (dict subclasses) as plain dicts and lists."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def loads(text: str | bytes, name: str = "") -> Notebook:
    """Parse and validate .ipynb text (older nbformat 4 minors and v3 are converted)."""
    if len(text) > MAX_FILE_BYTES:
        raise InvalidRequest(f"the notebook is larger than {MAX_FILE_BYTES // (1024 * 1024)} MB")
    try:
        node = nbformat.reads(text.decode("utf-8") if isinstance(text, bytes) else text, as_version=4)
    except nbformat.reader.NotJSONError as exc:
        raise InvalidRequest("not a notebook: the file is not JSON") from exc
    except UnicodeDecodeError as exc:
        raise InvalidRequest("not a notebook: the file is not UTF-8 text") from exc
    except Exception as exc:  # nbformat's reader errors: a missing key, an unknown version
        raise InvalidRequest(f"not a valid notebook: {exc}") from exc
    validate(node)
    return from_node(node, name)


# --- files under user_data/notebooks/USER/ ---


def notebooks_root() -> Path:
    """user_data/notebooks."""
    return shared.user_data_dir() / "notebooks"


def user_dir(user: str = DEFAULT_USER) -> Path:
    """The folder of one user's notebooks (and their kernel's working folder)."""
    try:
        return safe_child(notebooks_root(), folder_name(user))
    except UnsafePath as exc:
        raise InvalidRequest(f"invalid user name: {exc}") from exc


def check_name(name: str) -> str:
    """A notebook name without .ipynb; refuses names that are not plain file names."""
    name = name.strip()
    if name.lower().endswith(SUFFIX):
        name = name[: -len(SUFFIX)].strip()
    if not _NAME.fullmatch(name) or name.endswith("."):
        raise InvalidRequest(
            f"invalid notebook name {name!r}: use up to 100 letters, digits, spaces, '.', '-', '_' or "
            "parentheses, starting with a letter or digit"
        )
    return name


def path_of(user: str, name: str) -> Path:
    """The file of a notebook."""
    try:
        return safe_child(user_dir(user), check_name(name) + SUFFIX)
    except UnsafePath as exc:
        raise InvalidRequest(f"invalid notebook name: {exc}") from exc


def save(user: str, name: str, notebook: Notebook) -> Path:
    """Write the notebook as ``name``.ipynb in the user's folder (atomically); sets its name."""
    path = path_of(user, name)
    atomic_write_text(path, dumps(notebook))
    notebook.name = path.stem
    return path


def load(user: str, name: str) -> Notebook:
    """Open a saved notebook."""
    path = path_of(user, name)
    if not path.is_file():
        raise InvalidRequest(f"no notebook named {check_name(name)!r}")
    return loads(path.read_bytes(), path.stem)


def list_notebooks(user: str) -> list[str]:
    """The names of the user's notebooks, newest first."""
    folder = user_dir(user)
    if not folder.is_dir():
        return []
    files = [p for p in folder.glob("*" + SUFFIX) if p.is_file() and not p.name.startswith(".")]
    return [p.stem for p in sorted(files, key=lambda p: p.stat().st_mtime, reverse=True)]


def export(notebook: Notebook) -> Path:
    """A temporary copy of the notebook to download, named after it."""
    name = check_name(notebook.name) if notebook.name else "notebook"
    folder = Path(tempfile.mkdtemp(prefix="textgen-notebook-"))
    path = folder / (name + SUFFIX)
    path.write_text(dumps(notebook), encoding="utf-8")
    return path


def upload(file: Path) -> Notebook:
    """A notebook from an uploaded file (not saved until the user saves it); named after the file."""
    if file.stat().st_size > MAX_FILE_BYTES:
        raise InvalidRequest(f"the notebook is larger than {MAX_FILE_BYTES // (1024 * 1024)} MB")
    stem = file.name[: -len(SUFFIX)] if file.name.lower().endswith(SUFFIX) else file.stem
    try:
        name = check_name(stem)
    except InvalidRequest:
        name = ""
    return loads(file.read_bytes(), name)


# --- editing ---


def insert(notebook: Notebook, index: int, kind: str = "code", source: str = "") -> Cell:
    """Insert a new cell at ``index`` (clamped); returns it."""
    if kind not in KINDS:
        raise InvalidRequest(f"unknown cell kind {kind!r}")
    cell = Cell(kind=kind, source=source)
    notebook.cells.insert(max(0, min(index, len(notebook.cells))), cell)
    return cell


def remove(notebook: Notebook, index: int) -> None:
    """Delete a cell (an empty notebook keeps one empty code cell)."""
    if 0 <= index < len(notebook.cells):
        del notebook.cells[index]
    if not notebook.cells:
        notebook.cells.append(Cell())


def move(notebook: Notebook, index: int, step: int) -> None:
    """Move a cell up (-1) or down (+1)."""
    target = index + step
    if 0 <= index < len(notebook.cells) and 0 <= target < len(notebook.cells):
        cells = notebook.cells
        cells[index], cells[target] = cells[target], cells[index]


def clear_outputs(notebook: Notebook) -> None:
    """Remove every cell's outputs and execution count."""
    for cell in notebook.cells:
        cell.outputs, cell.execution_count = [], None


def set_kind(cell: Cell, kind: str) -> None:
    """Change a cell's kind; only code cells keep outputs."""
    if kind not in KINDS:
        raise InvalidRequest(f"unknown cell kind {kind!r}")
    cell.kind = kind
    if kind != "code":
        cell.outputs, cell.execution_count = [], None


def sync_sources(notebook: Notebook, sources: list[str]) -> None:
    """Take the editors' texts (one per cell, in order) into the notebook."""
    for cell, source in zip(notebook.cells, sources, strict=False):
        cell.source = source if isinstance(source, str) else ""


def _fingerprint(code: str) -> str:
    return hashlib.sha256(code.encode("utf-8")).hexdigest()[:12]


def place_code(notebook: Notebook, after: int, code: str, origin: Cell, link: str) -> int:
    """Put code the model wrote in a code cell below ``after``; returns its index.

    The cell the same origin proposed last time is replaced while it is untouched (not run, not edited), so that
    asking again gives another proposal instead of a pile; otherwise a new cell is inserted. ``link`` names the
    relation in the cell's metadata (``generated_from``, ``fix_of``).
    """
    below = after + 1
    if below < len(notebook.cells):
        cell = notebook.cells[below]
        mark = cell.metadata.get("textgen") or {}
        untouched = (
            not cell.outputs and cell.execution_count is None and mark.get("proposal") == _fingerprint(cell.source)
        )
        if cell.kind == "code" and mark.get(link) == origin.id and untouched:
            cell.source = code
            mark["proposal"] = _fingerprint(code)
            return below
    cell = insert(notebook, below, "code", code)
    cell.metadata["textgen"] = {link: origin.id, "proposal": _fingerprint(code)}
    return below
