"""The transformers backend serves several requests at once: one forward pass per step for every running
sequence, each with its own samplers, grammar, logprobs and cancellation, and the same tokens as alone."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import jsonschema
import pytest
from PIL import Image

from modules import models, shared
from modules.chat.prompt import render_messages
from modules.errors import QueueFull
from modules.generation.params import GenerationParams
from modules.generation.pipeline import prepare
from modules.loaders.base import TokenEvent
from tests.conftest import hf_default_model

PROMPTS = [
    "Hello, my name is",
    "The capital of France is",
    "Write a short poem about the sea, the sky and the wind that blows between them:",
    "1, 2, 3,",
]


def tokens(events: object) -> list[int]:
    return [e.token_id for e in events if e.token_id >= 0]  # type: ignore[attr-defined]


def test_four_requests_share_forward_passes_and_answer_as_alone(hub: object, models_dir: Path) -> None:
    (models_dir / "SmolLM2-135M-Instruct").symlink_to(hf_default_model())
    backend = models.load_model("SmolLM2-135M-Instruct", {"dtype": "float32", "parallel": 4})
    greedy = GenerationParams(temperature=0, max_new_tokens=32, ban_eos=True)
    sampled = GenerationParams(temperature=0.9, top_p=0.9, seed=7, max_new_tokens=32, ban_eos=True)
    jobs = [(backend.encode(p), greedy if i % 2 == 0 else sampled.replace(seed=i)) for i, p in enumerate(PROMPTS)]
    before = backend.stats()["steps"]
    alone = [tokens(backend.generate(ids, params, threading.Event())) for ids, params in jobs]
    alone_steps = backend.stats()["steps"] - before
    assert alone_steps == 4 * 32  # one prefill and 31 decode steps each
    before = backend.stats()["steps"]
    streams = [backend.generate(ids, params, threading.Event()) for ids, params in jobs]
    together = [tokens(s) for s in streams]
    together_steps = backend.stats()["steps"] - before
    # 4 prefills, then the four decode side by side: far fewer forward passes than one after another
    assert together_steps <= 4 + 32 + 4, together_steps
    assert together == alone  # greedy and seeded sampling alike: the neighbours change nothing
    assert all(len(t) == 32 for t in together)
    stats = backend.stats()
    assert stats["slots"] == 4 and stats["busy_slots"] == 0 and stats["queue_depth"] == 0


def test_cancelling_one_stream_frees_its_slot_and_leaves_the_others_running(tiny: Path) -> None:
    backend = models.load_model("tiny-llama", {"parallel": 3})
    ids = backend.encode("Once upon a time")
    # long enough that the other two are still running however long this thread is held up; they are cancelled at
    # the end, which also shows they were still running
    long = GenerationParams(temperature=0, max_new_tokens=5000, ban_eos=True)
    cancels = [threading.Event() for _ in range(3)]
    steps_before = backend.stats()["steps"]
    streams = [backend.generate(ids, long.replace(seed=i), cancels[i]) for i in range(3)]
    for stream in streams:
        assert next(stream).token_id >= 0
    cancels[1].set()
    steps_at_cancel = backend.stats()["steps"]
    events = list(streams[1])
    assert events[-1].finish_reason == "cancelled"
    # it left the batch within two steps of the cancel: a stream brings at most a token a step (its tokens: the one
    # read above and all events but the last), counted in the engine's steps, not by how soon this thread read them
    # (the engine does not wait for its reader)
    assert len(events) <= steps_at_cancel - steps_before + 2
    stats = backend.stats()
    assert stats["busy_slots"] == 2 and stats["queue_depth"] == 0  # freed at once; the other two still run
    newcomer = backend.generate(ids, GenerationParams(temperature=0, max_new_tokens=5, ban_eos=True), threading.Event())
    assert [e.finish_reason for e in newcomer][-1] == "length"
    assert backend.stats()["busy_slots"] == 2  # it took the freed slot and ended while the long two still run
    cancels[0].set()
    cancels[2].set()
    for stream in (streams[0], streams[2]):
        assert list(stream)[-1].finish_reason == "cancelled"
    assert backend.stats()["busy_slots"] == 0


def test_queue_full_beyond_slots_and_queue(tiny: Path) -> None:
    backend = models.load_model("tiny-llama", {"parallel": 2, "max_queue": 1})
    ids = backend.encode("Hello")
    long = GenerationParams(max_new_tokens=2000, ban_eos=True)
    cancel = threading.Event()
    running = [backend.generate(ids, long, cancel) for _ in range(2)]
    for stream in running:
        next(stream)
    waiting = backend.generate(ids, GenerationParams(max_new_tokens=2), threading.Event())
    assert backend.stats() | {"steps": 0, "requests": 0} == {
        "slots": 2,
        "busy_slots": 2,
        "queue_depth": 1,
        "steps": 0,
        "requests": 0,
    }
    with pytest.raises(QueueFull):
        backend.generate(ids, GenerationParams(max_new_tokens=2), threading.Event())
    cancel.set()
    for stream in running:
        assert list(stream)[-1].finish_reason == "cancelled"
    assert [e.finish_reason for e in waiting][-1] == "length"


def test_grammar_and_logprobs_requests_beside_a_plain_one(tiny: Path) -> None:
    backend = models.load_model("tiny-llama", {"parallel": 4})
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}},
        "required": ["name", "age"],
    }
    jobs = [
        ("Person:", GenerationParams(temperature=0.7, seed=1, max_new_tokens=120, json_schema=schema)),
        ("Hello", GenerationParams(temperature=0, max_new_tokens=40, ban_eos=True)),
        ("Hello", GenerationParams(temperature=0.8, seed=2, max_new_tokens=20, logprobs=True, top_logprobs=3)),
        ("Yes or no?", GenerationParams(temperature=1.0, seed=3, max_new_tokens=10, grammar='root ::= "yes" | "no"')),
    ]

    def run_all(concurrently: bool) -> list[list[TokenEvent]]:
        if not concurrently:
            return [list(backend.generate(backend.encode(p), params, threading.Event())) for p, params in jobs]
        streams = [backend.generate(backend.encode(p), params, threading.Event()) for p, params in jobs]
        return [list(s) for s in streams]

    alone, together = run_all(False), run_all(True)
    for solo, beside in zip(alone, together, strict=True):
        assert [e.token_id for e in beside] == [e.token_id for e in solo]
        assert [e.finish_reason for e in beside] == [e.finish_reason for e in solo]
    text = b"".join(e.piece for e in together[0]).decode()
    jsonschema.validate(json.loads(text), schema)
    assert b"".join(e.piece for e in together[3]).decode() in ("yes", "no")
    with_logprobs = [e for e in together[2] if e.token_id >= 0]
    assert len(with_logprobs) == 20
    for solo, beside in zip((e for e in alone[2] if e.token_id >= 0), with_logprobs, strict=True):
        assert beside.logprob == pytest.approx(solo.logprob, abs=1e-4) and beside.logprob <= 0
        assert [t.token_id for t in beside.top_logprobs or []] == [t.token_id for t in solo.top_logprobs or []]
        assert len(beside.top_logprobs or []) == 3
    assert all(e.logprob is None for e in together[1])  # only the request that asked gets logprobs


def test_a_lora_change_waits_for_running_generations(tiny: Path) -> None:
    backend = models.load_model("tiny-llama", {"parallel": 2})
    ids = backend.encode("Hello")
    params = GenerationParams(temperature=0, max_new_tokens=8, ban_eos=True)
    base = tokens(backend.generate(ids, params, threading.Event()))
    cancel = threading.Event()
    running = backend.generate(ids, GenerationParams(temperature=0, max_new_tokens=5000, ban_eos=True), cancel)
    assert next(running).token_id == base[0]
    change = threading.Thread(target=models.apply_loras, args=(["lora-a"],))
    change.start()
    deadline = time.monotonic() + 60  # the change reads the adapter first: seconds on a loaded machine
    while not backend._scheduler.paused and change.is_alive() and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(0.3)
    assert change.is_alive() and backend._scheduler.paused  # held back while a generation runs
    meanwhile = backend.generate(ids, params, threading.Event())
    time.sleep(0.2)
    assert backend.stats()["queue_depth"] == 1  # a new request waits for the change, it does not start beside it
    cancel.set()
    assert list(running)[-1].finish_reason == "cancelled"
    change.join(timeout=60)
    assert not change.is_alive() and shared.loras == ["lora-a"]
    with_lora = tokens(meanwhile)
    assert with_lora != base and with_lora == tokens(backend.generate(ids, params, threading.Event()))


def test_image_requests_beside_text_ones(tiny: Path) -> None:
    backend = models.load_model("tiny-llava", {"parallel": 4})
    prompt = render_messages(
        backend, [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]}]
    )
    images = [Image.new("RGB", (40, 40), "red"), Image.new("RGB", (40, 40), (0, 0, 255))]
    prepared = [prepare(prompt, GenerationParams(), backend, images=[image]) for image in images]
    params = GenerationParams(temperature=0, max_new_tokens=6, ban_eos=True, logprobs=True, top_logprobs=3)
    text_ids = backend.encode("Hello there")

    def start(job: object) -> object:
        if job is None:
            return backend.generate(text_ids, params, threading.Event())
        return backend.generate(job.prompt_ids, params, threading.Event(), job.extra)  # type: ignore[attr-defined]

    def first_token(events: list[TokenEvent]) -> list[tuple[int, float]]:
        return [(t.token_id, round(t.logprob, 4)) for t in events[0].top_logprobs or []]

    jobs = [None, prepared[0], None, prepared[1]]
    alone = [list(start(job)) for job in jobs]  # type: ignore[call-overload]
    streams = [start(job) for job in jobs]
    together = [list(s) for s in streams]  # type: ignore[call-overload]
    for solo, beside in zip(alone, together, strict=True):
        assert tokens(beside) == tokens(solo) and len(tokens(beside)) == 6
        assert first_token(beside) == first_token(solo)
    assert first_token(together[1]) != first_token(together[3])  # each sees its own image
