"""Model discovery, format detection, GGUF checks and per-model settings precedence (no model is loaded)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from modules import models, models_settings
from modules.errors import InvalidRequest, ModelLoadError, ModelNotFound
from modules.lifecycle.gguf import GGUFError, read_metadata
from modules.settings import load_settings
from tests.conftest import DEFAULT_MODEL, default_model_path


def make_hf(folder: Path, quant: dict | None = None) -> Path:
    folder.mkdir(parents=True)
    config = {"architectures": ["LlamaForCausalLM"], "max_position_embeddings": 2048}
    if quant:
        config["quantization_config"] = quant
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_lists_gguf_files_and_model_folders(hub: object, models_dir: Path) -> None:
    (models_dir / DEFAULT_MODEL).symlink_to(default_model_path())
    make_hf(models_dir / "tiny-hf")
    make_hf(models_dir / "tiny-exl2", {"quant_method": "exl2", "bits": 4})
    (models_dir / "nested").mkdir()
    (models_dir / "nested" / "a-00001-of-00002.gguf").write_bytes(b"GGUF")
    (models_dir / "nested" / "a-00002-of-00002.gguf").write_bytes(b"GGUF")
    (models_dir / ".hidden.gguf").write_bytes(b"GGUF")
    (models_dir / "notes.txt").write_text("not a model")
    found = {m.name: m for m in models.list_models()}
    assert set(found) == {DEFAULT_MODEL, "tiny-hf", "tiny-exl2", "nested/a-00001-of-00002.gguf"}
    assert found[DEFAULT_MODEL].loader == "llama.cpp" and found[DEFAULT_MODEL].size_bytes > 90_000_000
    assert found["tiny-hf"].loader == "transformers"
    assert found["tiny-exl2"].loader == "exllamav2"


def test_find_model_errors_are_clear(hub: object, models_dir: Path) -> None:
    (models_dir / "weights.bin").write_bytes(b"x")
    (models_dir / "empty").mkdir()
    with pytest.raises(ModelNotFound, match="not in"):
        models.find_model("missing.gguf")
    with pytest.raises(InvalidRequest):
        models.find_model("../secrets")
    with pytest.raises(ModelLoadError, match="unsupported file type"):
        models.find_model("weights.bin")
    with pytest.raises(ModelLoadError, match="neither"):
        models.find_model("empty")


def test_gguf_reader_reads_the_default_model() -> None:
    meta = read_metadata(default_model_path())
    assert meta.architecture == "llama" and meta.context_length == 8192
    assert meta.bos_token == "<|im_start|>" and meta.eos_token == "<|im_end|>"
    assert meta.extra["tensors"] == 272


def test_gguf_reader_refuses_corrupt_files(tmp_path: Path) -> None:
    good = default_model_path().read_bytes()
    cases = {
        "random.gguf": b"\x00\x01not a model at all" * 10,
        "truncated.gguf": good[: len(good) // 2],
        "header-only.gguf": good[:4096],
        "garbled.gguf": good[:8] + b"\xff" * 4096,
        "tiny.gguf": b"GGUF",
    }
    for name, data in cases.items():
        path = tmp_path / name
        path.write_bytes(data)
        with pytest.raises(GGUFError):
            read_metadata(path)


def test_per_model_settings_precedence(hub: object, models_dir: Path, user_data: Path) -> None:
    from modules import shared

    model = models_dir / "smol" / DEFAULT_MODEL
    model.parent.mkdir()
    model.symlink_to(default_model_path())
    meta = read_metadata(model)
    name = "smol/" + DEFAULT_MODEL

    resolved = models_settings.resolve(name, model, meta)
    assert resolved.options["n_ctx"] == 4096 and resolved.sources["n_ctx"] == "metadata"  # min(8192, cap)

    (user_data / "models_settings.yaml").write_text(
        "'.*smollm2.*':\n  n_ctx: 2048\n  threads: 1\n  instruction_template: Alpaca\n'^other': {n_ctx: 99}\n"
    )
    resolved = models_settings.resolve(name, model, meta)
    assert resolved.options["n_ctx"] == 2048 and resolved.options["threads"] == 1
    assert resolved.extra == {"instruction_template": "Alpaca"}

    (model.parent / "textgen.yaml").write_text("n_ctx: 1024\nloader: llama.cpp\n")
    resolved = models_settings.resolve(name, model, meta)
    assert resolved.options["n_ctx"] == 1024 and resolved.loader == "llama.cpp"
    assert resolved.options["threads"] == 1

    loaded = load_settings(
        ["--user-data-dir", str(user_data), "--model-dir", str(models_dir), "--n-ctx", "512"], env={}
    )
    shared.init(loaded)
    resolved = models_settings.resolve(name, model, meta)
    assert resolved.options["n_ctx"] == 512 and resolved.sources["n_ctx"] == "flag"
    assert resolved.options["threads"] == 1  # not given on the command line: the model's setting stays

    assert models_settings.resolve(name, model, meta, {"n_ctx": 256}).options["n_ctx"] == 256


def test_bad_per_model_settings_are_clear_errors(hub: object, models_dir: Path, user_data: Path) -> None:
    meta = read_metadata(default_model_path())
    (user_data / "models_settings.yaml").write_text("'[unclosed': {n_ctx: 5}\n")
    with pytest.raises(ModelLoadError, match="regex"):
        models_settings.resolve("x", models_dir / "x.gguf", meta)
    (user_data / "models_settings.yaml").write_text("'x': {n_ctx: -5}\n")
    with pytest.raises(ModelLoadError, match="n_ctx"):
        models_settings.resolve("x", models_dir / "x.gguf", meta)
