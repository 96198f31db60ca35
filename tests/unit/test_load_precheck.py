"""A load that cannot succeed is refused before the working model is unloaded; an out-of-memory load says what
happened and the server keeps going; temp files of interrupted atomic writes are swept.

Backends are registered the way extensions do it (a ``register_backends`` hook in user_data/extensions).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from modules import extensions, fileio, loaders, models, shared
from modules.errors import BackendUnavailable, ModelLoadError
from modules.generation.params import GenerationParams
from tests.conftest import DEFAULT_MODEL, ROOT

FAKES = """
import weakref

import torch
from modules.loaders.base import Backend


class _Fake(Backend):
    @classmethod
    def load(cls, path, options):
        raise NotImplementedError


class HalfLoaded:
    def __init__(self):
        self.weights = bytearray(32 * 2**20)
        self.me = self  # a cycle, as real models have: only the garbage collector frees it


class OutOfMemory(_Fake):
    loader_name = "fake-oom"
    half_loaded = None  # a weak reference to what the last load had allocated when memory ran out

    @classmethod
    def load(cls, path, options):
        model = HalfLoaded()
        cls.half_loaded = weakref.ref(model)
        raise MemoryError()


class CudaOutOfMemory(_Fake):
    loader_name = "fake-cuda-oom"

    @classmethod
    def load(cls, path, options):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")


class NeedsPackage(_Fake):
    loader_name = "fake-needs-package"
    required_packages = ("textgen_no_such_package",)


class BrokenCheck(_Fake):
    loader_name = "fake-broken-check"

    @classmethod
    def check(cls, path, options):
        raise RuntimeError("the check itself crashed")


def register_backends(register):
    for backend in (OutOfMemory, CudaOutOfMemory, NeedsPackage, BrokenCheck):
        register(backend.loader_name, backend)
"""
FAKE_LOADERS = ("fake-oom", "fake-cuda-oom", "fake-needs-package", "fake-broken-check")


@pytest.fixture
def fakes(hub: object, user_data: Path) -> Iterator[None]:
    """The fake backends, registered through the real extension path."""
    folder = user_data / "extensions" / "fakeloaders"
    folder.mkdir(parents=True)
    (folder / "script.py").write_text(FAKES)
    (ext,) = extensions.load_extensions(["fakeloaders"])
    assert ext.active and set(FAKE_LOADERS) <= set(loaders.names())
    yield
    for name in FAKE_LOADERS:
        loaders.unregister(name)


@pytest.fixture
def loaded(with_default_model: Path) -> Path:
    """The real default model, loaded."""
    models.load_model(DEFAULT_MODEL)
    return with_default_model


def assert_still_serving() -> None:
    """The default model is still the loaded one, and it answers."""
    assert shared.model is not None and shared.model_name == DEFAULT_MODEL and shared.loading_model is None
    ids = shared.model.encode("The capital of France is")
    events = shared.model.generate(ids, GenerationParams(temperature=0, max_new_tokens=4), threading.Event())
    assert "Paris" in b"".join(e.piece for e in events).decode("utf-8", "replace")


# ---------------------------------------------------------------- refused before the unload


def write_split_gguf_first_shard(folder: Path) -> Path:
    """The first shard of a GGUF split in two, complete in itself; the second shard is not there."""
    import gguf

    path = folder / "tiny-00001-of-00002.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_uint16("split.no", 0)
    writer.add_uint16("split.count", 2)
    writer.add_int32("split.tensors.count", 2)
    writer.add_tensor("token_embd.weight", np.zeros((8, 16), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_split_gguf_with_a_missing_shard_is_refused_and_the_model_stays(loaded: Path, models_dir: Path) -> None:
    first = write_split_gguf_first_shard(models_dir)
    models.inspect_model(models.find_model(first.name))  # the first shard alone reads as a complete file
    with pytest.raises(ModelLoadError, match=r"split in 2 files and tiny-00002-of-00002\.gguf is missing"):
        models.load_model(first.name)
    assert_still_serving()


def test_a_truncated_safetensors_folder_is_refused_and_the_model_stays(loaded: Path, models_dir: Path) -> None:
    from safetensors.numpy import save_file

    folder = models_dir / "cut-hf"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}))
    weights = folder / "model.safetensors"
    save_file({"model.embed_tokens.weight": np.zeros((256, 64), dtype=np.float32)}, str(weights))
    full = weights.stat().st_size
    os.truncate(weights, full // 2)
    with pytest.raises(ModelLoadError, match=r"model\.safetensors is truncated: its header declares"):
        models.load_model("cut-hf")
    assert_still_serving()


def test_the_wrong_loader_for_a_file_or_folder_is_refused_and_the_model_stays(loaded: Path, models_dir: Path) -> None:
    (models_dir / "hf").mkdir()
    (models_dir / "hf" / "config.json").write_text("{}")
    with pytest.raises(ModelLoadError, match=r"is a folder; this loader reads a \.gguf file"):
        models.load_model("hf", {"loader": "llama.cpp"})
    assert_still_serving()


def test_exllama_without_cuda_is_refused_and_the_model_stays(
    loaded: Path, models_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """exllamav2 installed (a strict stand-in) on a machine without CUDA."""
    import torch

    from tests.fixtures import exllama_standins as core
    from tests.fixtures import exllamav2_standin as v2

    core.install(monkeypatch, v2.v2_modules())
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    core.write_model(models_dir / "model-exl2", "exl2")
    assert loaders.available()["exllamav2"]
    with pytest.raises(BackendUnavailable, match="ExLlamaV2 needs a CUDA GPU"):
        models.load_model("model-exl2")
    with pytest.raises(BackendUnavailable, match="ExLlamaV2 needs a CUDA GPU"):  # forced onto the GGUF as well
        models.load_model(DEFAULT_MODEL, {"loader": "exllamav2"})
    assert_still_serving()


def test_a_backend_without_its_package_is_refused_and_the_model_stays(fakes: None, loaded: Path) -> None:
    with pytest.raises(BackendUnavailable, match="'textgen_no_such_package', which is not installed: pip install"):
        models.load_model(DEFAULT_MODEL, {"loader": "fake-needs-package"})
    assert_still_serving()


def test_a_check_that_crashes_refuses_the_load_and_the_model_stays(fakes: None, loaded: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"could not check .*RuntimeError: the check itself crashed"):
        models.load_model(DEFAULT_MODEL, {"loader": "fake-broken-check"})
    assert_still_serving()


# ---------------------------------------------------------------- out of memory while loading


@pytest.mark.parametrize(
    ("loader", "detail"), [("fake-oom", "MemoryError"), ("fake-cuda-oom", "CUDA out of memory. Tried to allocate")]
)
def test_out_of_memory_says_so_and_that_the_old_model_was_unloaded(
    fakes: None, loaded: Path, loader: str, detail: str
) -> None:
    with pytest.raises(ModelLoadError) as caught:
        models.load_model(DEFAULT_MODEL, {"loader": loader})
    message = str(caught.value)
    assert message.startswith(f"not enough memory to load {DEFAULT_MODEL} with {loader} ({detail}")
    assert f"{DEFAULT_MODEL} was unloaded to make room for it, so no model is loaded now" in message
    assert shared.model is None and shared.loading_model is None and shared.load_error == message
    if loader == "fake-oom":  # what the failed load allocated is freed, though the caller still holds the error
        assert loaders.get(loader).half_loaded() is None  # type: ignore[attr-defined]
    models.load_model(DEFAULT_MODEL)  # the server goes on: the old model loads again
    assert_still_serving()


def test_out_of_memory_with_no_model_before_says_only_that(fakes: None, with_default_model: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"^not enough memory to load .* layers on the GPU$"):
        models.load_model(DEFAULT_MODEL, {"loader": "fake-oom"})
    assert shared.model is None


# ---------------------------------------------------------------- stale temp files


INTERRUPTED_WRITE = """
import os, signal, sys
from pathlib import Path
from modules import fileio
os.replace = lambda *a: os.kill(os.getpid(), signal.SIGKILL)  # the power goes out between fsync and rename
fileio.atomic_write_text(Path(sys.argv[1]), "new text")
"""


def interrupted_write(path: Path) -> Path:
    """Kill a process in the middle of ``atomic_write_text(path)``; returns the temp file it left."""
    before = set(path.parent.iterdir())
    result = subprocess.run([sys.executable, "-c", INTERRUPTED_WRITE, str(path)], cwd=ROOT, timeout=120)
    assert result.returncode == -9
    (left,) = set(path.parent.iterdir()) - before
    return left


def age(path: Path, seconds: float) -> None:
    past = time.time() - seconds
    os.utime(path, (past, past), follow_symlinks=False)


def test_only_old_temp_files_of_interrupted_writes_are_removed(tmp_path: Path) -> None:
    root = tmp_path / "user_data"
    chats = root / "logs" / "chat" / "Assistant"
    chats.mkdir(parents=True)
    history = chats / "20260101-00-00-00.json"
    fileio.atomic_write_text(history, '{"old": true}')
    stale = interrupted_write(history)
    assert stale.name.startswith(f".{history.name}.") and fileio.TEMP_NAME.match(stale.name)
    assert history.read_text() == '{"old": true}'  # the interrupted write left the old file whole
    age(stale, 3600)
    fresh = interrupted_write(chats / "other.json")  # a write that may still be running: too young to remove
    kept = [
        root / "presets" / "mine.yaml",  # the user's files, old ones included
        root / ".settings.yaml.tmp",  # not named like our temp files
        root / "notes.abcdefgh.tmp",
        chats / ".hidden.json",
    ]
    for path in kept:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("mine")
        age(path, 3600)
    outside = tmp_path / "outside.txt"
    outside.write_text("not under user_data")
    link = chats / ".link.json.abcd1234.tmp"
    link.symlink_to(outside)
    age(link, 3600)
    removed = fileio.remove_stale_temp_files(root)
    assert removed == [stale] and not stale.exists()
    assert fresh.exists() and link.is_symlink() and outside.read_text() == "not under user_data"
    assert all(p.read_text() == "mine" for p in kept)
    assert history.read_text() == '{"old": true}'
    assert fileio.remove_stale_temp_files(tmp_path / "missing") == []
