"""The llama.cpp engine on this CPU: the settings an AMX machine gets still answer; setup's smoke test passes."""

from __future__ import annotations

import platform
import subprocess
import sys
from pathlib import Path

import pytest

from modules import models
from modules.chat.prompt import render_messages
from modules.generation.params import GenerationParams
from modules.generation.pipeline import generate_text
from modules.loaders import llama_cpp_check
from tests.conftest import DEFAULT_MODEL, ROOT, default_model_path

QUESTION = [
    {"role": "system", "content": "You are a helpful AI assistant."},
    {"role": "user", "content": "What is the capital of France?"},
]


def test_default_model_answers_with_the_settings_an_amx_machine_gets(
    with_default_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A build with the AMX path loads without extra buffer types (no AMX buffer) and answers correctly."""
    features = {**llama_cpp_check.build_features(), "AMX_INT8": "1"}
    monkeypatch.setattr(llama_cpp_check, "build_features", lambda: features)
    backend = models.load_model(DEFAULT_MODEL)
    assert backend.extra_buffers is False  # type: ignore[attr-defined]
    text, stats = generate_text(render_messages(backend, QUESTION), GenerationParams(temperature=0, max_new_tokens=24))
    assert "Paris" in text and stats.new_tokens > 1
    backend = models.load_model(DEFAULT_MODEL, {"amx": True})  # --amx: the user says AMX works on this machine
    assert backend.extra_buffers is True  # type: ignore[attr-defined]


def test_a_build_without_amx_keeps_the_extra_buffers(with_default_model: Path) -> None:
    backend = models.load_model(DEFAULT_MODEL)
    assert backend.extra_buffers is (not llama_cpp_check.build_has_amx())  # type: ignore[attr-defined]


@pytest.mark.skipif(platform.machine() != "x86_64", reason="the AMX path exists on x86-64 only")
def test_the_engine_make_built_has_no_amx_path() -> None:
    """The Makefile compiles llama.cpp with -mno-amx-*: the library must not report AMX."""
    assert not llama_cpp_check.build_has_amx(), llama_cpp_check.build_features()


def test_setup_smoke_test_answers_in_a_child_process() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "modules.loaders.llama_cpp_check", str(default_model_path())],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.startswith("llama.cpp engine OK:") and "Paris" in done.stdout
