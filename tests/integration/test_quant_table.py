"""The quant table (Model tab, bench/quant_table.py) on tiny-llama: its folder is written complete or not at all,
and an existing one is replaced only when asked."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from modules import jobs
from modules.errors import InvalidRequest
from modules.lifecycle.quant_table import TableArgs, build


def noop(*args: object, **kwargs: object) -> None:
    pass


def test_the_table_measures_each_type_and_replaces_its_folder_only_when_asked(
    tiny_models: Path, tmp_path: Path
) -> None:
    source, folder = tiny_models / "tiny-llama", tmp_path / "tiny-llama-quants"
    rows = build(TableArgs(source, folder, ("F16", "Q8_0")), noop, threading.Event())
    assert [row["quant"] for row in rows] == ["F16", "Q8_0"]
    assert [Path(row["file"]) for row in rows] == [folder / "tiny-llama.F16.gguf", folder / "tiny-llama.Q8_0.gguf"]
    assert all(Path(row["file"]).is_file() and row["perplexity"] > 0 for row in rows)
    assert rows[0]["kld"] == pytest.approx(0.0, abs=1e-6) and rows[1]["size_mb"] < rows[0]["size_mb"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny-llama-quants"]  # no work folder left beside it

    kept = (folder / "tiny-llama.Q8_0.gguf").read_bytes()
    (folder / "notes.txt").write_text("mine")
    with pytest.raises(InvalidRequest, match=r"exists.*--overwrite"):
        build(TableArgs(source, folder, ("F16", "Q4_0")), noop, threading.Event())
    assert (folder / "tiny-llama.Q8_0.gguf").read_bytes() == kept and (folder / "notes.txt").is_file()

    cancel = threading.Event()
    cancel.set()  # a replace that stops before it is complete leaves the old table as it was
    with pytest.raises(jobs.Cancelled):
        build(TableArgs(source, folder, ("F16", "Q4_0"), overwrite=True), noop, cancel)
    assert (folder / "notes.txt").is_file() and sorted(p.name for p in tmp_path.iterdir()) == ["tiny-llama-quants"]

    rows = build(TableArgs(source, folder, ("F16", "Q4_0"), overwrite=True), noop, threading.Event())
    assert sorted(p.name for p in folder.iterdir()) == ["tiny-llama.F16.gguf", "tiny-llama.Q4_0.gguf"]
