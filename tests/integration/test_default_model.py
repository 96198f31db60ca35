"""The real default model through models.load_model and the pipeline."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from modules import models, shared
from modules.chat import engine
from modules.chat.prompt import render_messages
from modules.errors import ContextOverflow, ModelLoadError, ModelNotLoaded
from modules.generation.params import GenerationParams
from modules.generation.pipeline import generate_reply, generate_text
from tests.conftest import DEFAULT_MODEL, default_model_path

QUESTION = [
    {"role": "system", "content": "You are a helpful AI assistant."},
    {"role": "user", "content": "What is the capital of France?"},
]


def test_greedy_answer_is_paris_and_streams(with_default_model: Path) -> None:
    backend = models.load_model(DEFAULT_MODEL)
    assert shared.model is backend and backend.context_length == 4096
    prompt = render_messages(backend, QUESTION)
    deltas = list(generate_reply(prompt, GenerationParams(temperature=0, max_new_tokens=40)))
    text = "".join(d.text for d in deltas)
    stats = deltas[-1].stats
    assert "Paris" in text
    assert len(deltas) > 3, "the reply must arrive in several deltas"
    assert stats is not None and stats.finish_reason == "stop" and stats.new_tokens > 3
    assert stats.prompt_tokens == len(backend.encode(prompt)) and stats.tokens_per_second > 0
    assert stats.time_to_first_token > 0


def test_stop_string_ends_the_reply_before_it(with_default_model: Path) -> None:
    backend = models.load_model(DEFAULT_MODEL)
    prompt = render_messages(backend, QUESTION)
    full, _ = generate_text(prompt, GenerationParams(temperature=0, max_new_tokens=40))
    assert "Paris" in full
    cut, stats = generate_text(prompt, GenerationParams(temperature=0, max_new_tokens=40, stop=["Paris"]))
    assert cut == full[: full.index("Paris")]
    assert stats.finish_reason == "stop" and stats.stop_string == "Paris"


def test_max_new_tokens_and_seeds(with_default_model: Path) -> None:
    backend = models.load_model(DEFAULT_MODEL)
    prompt = render_messages(backend, [{"role": "user", "content": "Write a poem about the sea."}])
    params = GenerationParams(temperature=1.0, max_new_tokens=12, seed=1234, ban_eos=True)
    a, stats = generate_text(prompt, params)
    b, _ = generate_text(prompt, params)
    c, _ = generate_text(prompt, params.replace(seed=99))
    assert stats.new_tokens == 12 and stats.finish_reason == "length"
    assert a == b and a != c


def test_cancel_ends_generation_within_a_step(with_default_model: Path) -> None:
    backend = models.load_model(DEFAULT_MODEL)
    prompt = render_messages(backend, [{"role": "user", "content": "Tell me a long story."}])
    cancel = threading.Event()
    steps_at_cancel = -1
    stream = generate_reply(prompt, GenerationParams(max_new_tokens=400, ban_eos=True), cancel=cancel)
    for seen, delta in enumerate(stream, start=1):
        if seen == 5:
            cancel.set()
            steps_at_cancel = backend.stats()["steps"]
        if delta.stats:
            assert delta.stats.finish_reason == "cancelled"
            # counted in the engine's steps (a step may also bring draft tokens it confirmed), not in tokens the
            # reader saw: the engine does not wait for its reader
            assert backend.stats()["steps"] - steps_at_cancel <= 2
    assert backend.stats()["busy_slots"] == 0


def test_prompt_that_fills_the_context_is_refused(with_default_model: Path) -> None:
    models.load_model(DEFAULT_MODEL, {"n_ctx": 256})
    with pytest.raises(ContextOverflow):
        list(generate_reply("word " * 400, GenerationParams()))


def test_chat_engine_streams_a_growing_history(with_default_model: Path) -> None:
    models.load_model(DEFAULT_MODEL)
    updates = list(
        engine.send(
            [],
            "What is the capital of France?",
            GenerationParams(temperature=0, max_new_tokens=40),
            system=QUESTION[0]["content"],
        )
    )
    assert updates[0].history == [{"role": "user", "content": "What is the capital of France?"}]
    final = updates[-1]
    assert final.stats is not None and "Paris" in final.history[-1]["content"]
    again = list(
        engine.regenerate(
            final.history, GenerationParams(temperature=0, max_new_tokens=40), system=QUESTION[0]["content"]
        )
    )
    reply = again[-1].history[-1]
    assert reply["content"] == final.history[-1]["content"]  # greedy: the same reply again
    assert reply["versions"] == [final.history[-1]["content"]] * 2


def test_corrupt_gguf_fails_cleanly_then_a_good_model_loads(hub: object, models_dir: Path) -> None:
    data = default_model_path().read_bytes()
    (models_dir / "broken.gguf").write_bytes(data[: len(data) // 3])
    (models_dir / "junk.gguf").write_bytes(b"definitely not gguf")
    (models_dir / DEFAULT_MODEL).symlink_to(default_model_path())
    models.load_model(DEFAULT_MODEL)
    for name in ("broken.gguf", "junk.gguf"):
        with pytest.raises(ModelLoadError) as info:
            models.load_model(name)
        assert name in str(info.value)
    assert shared.model is not None and shared.model_name == DEFAULT_MODEL  # the loaded model stays
    with pytest.raises(ModelNotLoaded):
        models.unload_model()
        list(generate_reply("hi", GenerationParams()))
    assert models.load_model(DEFAULT_MODEL).context_length == 4096


def test_switch_unloads_first(with_default_model: Path, models_dir: Path) -> None:
    other = models_dir / "copy"
    other.mkdir()
    (other / DEFAULT_MODEL).symlink_to(default_model_path())
    first = models.load_model(DEFAULT_MODEL)
    second = models.load_model("copy")
    assert shared.model is second and shared.model_name == f"copy/{DEFAULT_MODEL}"
    with pytest.raises(ModelLoadError):
        first.encode("unloaded")
