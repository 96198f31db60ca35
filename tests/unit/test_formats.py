"""The file-format floor: headers read by modules.formats agree with gguf-py's GGUFReader, and the backends stand
on the floor without reaching into the lifecycle or the extensions."""

from __future__ import annotations

import ast
from pathlib import Path

import gguf
import numpy as np
import pytest

from modules.formats import gguf as gguf_format
from modules.formats import safetensors as st_format
from modules.paths import ROOT
from tests.conftest import default_model_path


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return names


@pytest.mark.parametrize(
    ("folder", "forbidden"),
    [
        ("modules/loaders", ("modules.lifecycle", "modules.extensions")),
        ("modules/formats", ("modules.lifecycle", "modules.extensions", "modules.loaders")),
    ],
)
def test_backends_and_formats_never_import_the_lifecycle_or_the_extensions(
    folder: str, forbidden: tuple[str, ...]
) -> None:
    found = [
        f"{path.relative_to(ROOT)} imports {name}"
        for path in sorted((ROOT / folder).glob("*.py"))
        for name in sorted(_imports(path))
        if any(name == bad or name.startswith(bad + ".") for bad in forbidden)
    ]
    assert found == []


def _reader_view(path: Path) -> tuple[dict[str, object], list[dict[str, object]], int]:
    reader = gguf.GGUFReader(str(path))
    meta = {
        key: field.contents()
        for key, field in reader.fields.items()
        if not key.startswith("GGUF.") and key != "tokenizer.ggml.merges"
    }
    tensors = [
        {
            "name": t.name,
            "shape": [int(d) for d in t.shape],
            "type": int(t.tensor_type),
            "offset": int(t.data_offset) - reader.data_offset,
        }
        for t in reader.tensors
    ]
    return meta, tensors, reader.data_offset


def _same(ours: dict[str, object], theirs: dict[str, object]) -> None:
    assert ours.keys() == theirs.keys()
    for key, value in theirs.items():
        if isinstance(value, float) or (isinstance(value, list) and value and isinstance(value[0], float)):
            assert np.allclose(ours[key], value), key  # type: ignore[arg-type]
        else:
            assert ours[key] == value, key


def test_the_default_models_header_reads_as_gguf_py_reads_it() -> None:
    path = default_model_path()
    meta, tensors, start = gguf_format.read_header(path)
    their_meta, their_tensors, their_start = _reader_view(path)
    _same(meta, their_meta)
    assert tensors == their_tensors and start == their_start
    assert len(meta["tokenizer.ggml.tokens"]) == 49152  # type: ignore[arg-type]
    assert gguf_format.data_end(tensors, start) == path.stat().st_size


def test_every_value_type_and_the_alignment_read_as_gguf_py_reads_them(tmp_path: Path) -> None:
    path = tmp_path / "kinds.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_uint8("t.u8", 200)
    writer.add_int8("t.i8", -100)
    writer.add_uint16("t.u16", 60000)
    writer.add_int16("t.i16", -30000)
    writer.add_uint32("t.u32", 4_000_000_000)
    writer.add_int32("t.i32", -2_000_000_000)
    writer.add_uint64("t.u64", 2**63 + 5)
    writer.add_int64("t.i64", -(2**62))
    writer.add_float32("t.f32", 0.25)
    writer.add_float64("t.f64", 1e-300)
    writer.add_bool("t.bool", True)
    writer.add_string("t.str", "Grüße ✓")
    writer.add_array("t.ints", [1, -2, 3])
    writer.add_array("t.floats", [0.5, 1.5])
    writer.add_array("t.strs", ["a", "", "ç"])
    writer.add_custom_alignment(64)
    writer.add_tensor("a", np.arange(6, dtype=np.float32).reshape(2, 3))
    writer.add_tensor("b", np.ones((5,), dtype=np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    meta, tensors, start = gguf_format.read_header(path)
    their_meta, their_tensors, their_start = _reader_view(path)
    _same(meta, their_meta)
    assert tensors == their_tensors and start == their_start and start % 64 == 0
    assert meta["t.str"] == "Grüße ✓" and meta["t.u64"] == 2**63 + 5
    assert gguf_format.data_end(tensors, start) <= path.stat().st_size


def test_a_truncated_or_foreign_file_is_a_clear_error(tmp_path: Path) -> None:
    source = default_model_path()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(source.read_bytes()[:4096])
    with pytest.raises(gguf_format.GGUFError, match="truncated or corrupt"):
        gguf_format.read_header(cut)
    text = tmp_path / "notes.gguf"
    text.write_text("these are not weights " * 4)
    with pytest.raises(gguf_format.GGUFError, match="does not start with 'GGUF'"):
        gguf_format.read_header(text)
    st = tmp_path / "w.safetensors"
    st.write_bytes((10).to_bytes(8, "little") + b"{not json}")
    with pytest.raises(st_format.SafetensorsError, match="corrupt safetensors header"):
        st_format.read_header(st)
    st.write_bytes((1 << 40).to_bytes(8, "little"))
    with pytest.raises(st_format.SafetensorsError, match="not a complete safetensors file"):
        st_format.read_header(st)
