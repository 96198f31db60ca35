"""The llama.cpp engine: slots and batching, queue, prompt cache, the sampler chain, grammar, LoRA, embeddings."""

from __future__ import annotations

import json
import math
import shutil
import threading
import time
from pathlib import Path

import jsonschema
import numpy as np
import pytest

from modules import models, shared
from modules.chat.prompt import render_messages
from modules.errors import ContextOverflow, InvalidRequest, ModelLoadError, QueueFull
from modules.generation.params import GenerationParams
from modules.generation.pipeline import generate_text, prepare
from modules.loaders.base import Backend
from tests.conftest import DEFAULT_MODEL, hf_default_model

PROMPTS = ["What is the capital of France?", "Name three colours.", "Write a haiku about rain.", "What is 2 + 2?"]


def load(**overrides: object) -> Backend:
    return models.load_model(DEFAULT_MODEL, dict(overrides))


def chat_ids(backend: Backend, text: str) -> list[int]:
    return prepare(
        render_messages(backend, [{"role": "user", "content": text}]), GenerationParams(), backend
    ).prompt_ids


def token_ids(
    backend: Backend, ids: list[int], params: GenerationParams, cancel: threading.Event | None = None
) -> list[int]:
    return [e.token_id for e in backend.generate(ids, params, cancel or threading.Event()) if e.token_id >= 0]


def test_simultaneous_greedy_requests_match_each_alone(with_default_model: Path) -> None:
    backend = load(parallel=4)
    params = GenerationParams(temperature=0, max_new_tokens=24, ban_eos=True)
    prompts = [chat_ids(backend, p) for p in PROMPTS]
    alone = [token_ids(backend, ids, params) for ids in prompts]
    together: dict[int, list[int]] = {}
    threads = [
        threading.Thread(target=lambda i=i: together.__setitem__(i, token_ids(backend, prompts[i], params)))
        for i in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i in range(4):  # the build leaves out llamafile's tinyBLAS: a step's batch shape changes no logit
        assert together[i] == alone[i], PROMPTS[i]
    assert backend.stats()["busy_slots"] == 0


def test_batching_runs_streams_at_the_same_time(with_default_model: Path) -> None:
    backend = load(parallel=4, speculative=False)  # a token a step for each stream: steps count the batching
    params = GenerationParams(temperature=0, max_new_tokens=40, ban_eos=True)
    prompts = [chat_ids(backend, PROMPTS[i]) for i in range(4)]
    go = threading.Barrier(4)
    tokens: dict[int, int] = {}

    def run(i: int) -> None:
        go.wait(30)
        tokens[i] = sum(e.token_id >= 0 for e in backend.generate(prompts[i], params, threading.Event()))

    before = backend.stats()["steps"]
    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert tokens == {i: 40 for i in range(4)}
    # decoded together: one after another would take 160 steps or more, together about 40; counted in the engine's
    # steps, not in when the threads saw their tokens (a thread held up on a loaded machine says nothing of it)
    assert backend.stats()["steps"] - before <= 120


def test_cancel_frees_the_slot_and_a_full_queue_refuses(with_default_model: Path) -> None:
    backend = load(parallel=1, max_queue=1)
    ids = chat_ids(backend, "Tell me a story.")
    params = GenerationParams(max_new_tokens=500, ban_eos=True)
    first_cancel = threading.Event()
    first = backend.generate(ids, params, first_cancel)
    next(first)
    waiting_cancel = threading.Event()
    waiting = backend.generate(ids, params, waiting_cancel)  # waits in the queue
    with pytest.raises(QueueFull):
        backend.generate(ids, params, threading.Event())
    assert backend.stats()["queue_depth"] == 1
    first_cancel.set()
    assert [e.finish_reason for e in first if e.finish_reason] == ["cancelled"]
    assert next(waiting).token_id >= 0  # the freed slot went to the waiting request
    waiting_cancel.set()
    list(waiting)
    deadline = time.monotonic() + 5
    while backend.stats()["busy_slots"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert backend.stats()["busy_slots"] == 0 and backend.stats()["queue_depth"] == 0


def test_prompt_cache_reuses_the_common_prefix(with_default_model: Path) -> None:
    backend = load(parallel=2)
    history = [
        {"role": "system", "content": "You are a helpful AI assistant. " * 30},
        {"role": "user", "content": "Hi!"},
    ]
    first = render_messages(backend, history)
    generate_text(first, GenerationParams(temperature=0, max_new_tokens=8))
    before = backend.stats()
    longer = render_messages(
        backend, [*history, {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "How are you?"}]
    )
    _, _stats = generate_text(longer, GenerationParams(temperature=0, max_new_tokens=8))
    after = backend.stats()
    assert after["cache_hits"] == before["cache_hits"] + 1
    reused = after["cache_hit_tokens"] - before["cache_hit_tokens"]
    assert reused >= len(backend.encode(first)) - 2
    off = load(parallel=2, prompt_cache=False)
    generate_text(first, GenerationParams(temperature=0, max_new_tokens=8))
    generate_text(longer, GenerationParams(temperature=0, max_new_tokens=8))
    assert off.stats()["cache_hits"] == 0


def test_an_unrelated_prompt_does_not_evict_a_cached_conversation(with_default_model: Path) -> None:
    backend = load(parallel=2)
    params = GenerationParams(temperature=0, max_new_tokens=4)
    long_chat = chat_ids(backend, "Here is my essay, please remember it. " * 40)
    token_ids(backend, long_chat, params)
    token_ids(backend, chat_ids(backend, "Hi!"), params)  # shares only the template's first tokens
    before = backend.stats()["cache_hit_tokens"]
    token_ids(backend, long_chat, params)
    assert backend.stats()["cache_hit_tokens"] - before == len(long_chat) - 1


def test_long_prompt_does_not_freeze_other_streams(with_default_model: Path) -> None:
    backend = load(parallel=2)
    short = chat_ids(backend, "Count from one to one hundred.")
    long_ids = backend.encode("The quick brown fox jumps over the lazy dog. " * 120)  # about 1200 tokens
    gaps: list[float] = []
    started = threading.Event()

    def stream() -> None:
        last = None
        for _event in backend.generate(
            short, GenerationParams(temperature=0, max_new_tokens=60, ban_eos=True), threading.Event()
        ):
            now = time.perf_counter()
            if last is not None:
                gaps.append(now - last)
            last = now
            if len(gaps) == 3:
                started.set()

    thread = threading.Thread(target=stream)
    thread.start()
    started.wait(30)
    t0 = time.perf_counter()
    generate_text(long_ids, GenerationParams(temperature=0, max_new_tokens=1))
    prefill = time.perf_counter() - t0
    thread.join()
    # frozen, the stream would wait the whole read; in chunks it waits ~a tenth of it a step (a half: room for a step
    # slowed by the other test process of make test)
    assert max(gaps) < prefill / 2, f"the stream stalled {max(gaps):.2f} s while a {prefill:.2f} s prompt was read"


SAMPLER_SETTINGS = [
    {"top_k": 40, "top_p": 0.9},
    {"min_p": 0.1, "temperature_last": True},
    {"typical_p": 0.8},
    {"dynatemp_range": 0.5, "dynatemp_exponent": 1.5},
    {"xtc_probability": 0.5, "xtc_threshold": 0.1},
    {"repetition_penalty": 1.3, "presence_penalty": 0.5, "frequency_penalty": 0.5, "repetition_penalty_range": 64},
    {"mirostat_mode": 1, "mirostat_tau": 5.0, "mirostat_eta": 0.1},
    {"mirostat_mode": 2, "mirostat_tau": 3.0, "mirostat_eta": 0.1},
]


@pytest.mark.parametrize("settings", SAMPLER_SETTINGS, ids=lambda s: "+".join(s))
def test_every_sampler_runs_and_reproduces_with_a_seed(with_default_model: Path, settings: dict) -> None:
    backend = load()
    ids = chat_ids(backend, "Write a short poem about the sea.")
    params = GenerationParams(temperature=1.0, max_new_tokens=20, seed=11, **settings)
    first = token_ids(backend, ids, params)
    assert len(first) > 0
    assert token_ids(backend, ids, params) == first
    baseline = token_ids(backend, ids, GenerationParams(temperature=1.0, max_new_tokens=20, seed=11))
    if "temperature_last" not in settings:
        assert first != baseline, f"{settings} did not change the output"


def test_the_numpy_sampler_gives_the_chains_greedy_tokens(with_default_model: Path, monkeypatch) -> None:
    from modules.loaders.llama_cpp_sampling import PlainSampler

    backend = load()
    prompts = [chat_ids(backend, text) for text in ("Write a short poem about the sea.", "List three colours.")]
    params = GenerationParams(temperature=0, max_new_tokens=64, ban_eos=True, logit_bias={"28": -100})
    ours = [token_ids(backend, ids, params) for ids in prompts]
    monkeypatch.setattr(PlainSampler, "fits", staticmethod(lambda *_: False))  # llama.cpp's chain for each token
    assert [token_ids(backend, ids, params) for ids in prompts] == ours


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_request_that_bans_every_token_fails_alone(with_default_model: Path, temperature: float) -> None:
    from modules.loaders.llama_cpp_sampling import NothingToSample

    backend = load(parallel=2)
    ids = chat_ids(backend, "Write a short poem about the sea.")
    params = GenerationParams(temperature=0, max_new_tokens=48, ban_eos=True)
    alone = token_ids(backend, ids, params)
    banned = GenerationParams(
        temperature=temperature,
        seed=1,
        max_new_tokens=8,
        logit_bias={t: -100 for t in range(backend.metadata.extra["n_vocab"])},
    )
    other: list[int] = []
    started = threading.Event()

    def stream() -> None:
        for event in backend.generate(ids, params, threading.Event()):
            started.set()
            if event.token_id >= 0:
                other.append(event.token_id)

    thread = threading.Thread(target=stream)
    thread.start()
    assert started.wait(30)
    with pytest.raises(NothingToSample, match="bans every token"):
        token_ids(backend, ids, banned)
    thread.join(60)
    assert other == alone  # the stream beside it went on, as alone
    assert token_ids(backend, ids, params) == alone and backend.stats()["busy_slots"] == 0


def test_dry_breaks_a_greedy_loop(with_default_model: Path) -> None:
    backend = load()
    ids = prepare(
        render_messages(backend, [{"role": "user", "content": "What is the capital of France?"}]),
        GenerationParams(),
        backend,
    ).prompt_ids

    def repeated_trigrams(tokens: list[int]) -> int:
        grams = [tuple(tokens[i : i + 3]) for i in range(len(tokens) - 2)]
        return len(grams) - len(set(grams))

    looping = token_ids(backend, ids, GenerationParams(temperature=0, max_new_tokens=60, ban_eos=True))
    dry = token_ids(backend, ids, GenerationParams(temperature=0, max_new_tokens=60, ban_eos=True, dry_multiplier=0.8))
    assert repeated_trigrams(looping) > 10, "the greedy reply to this prompt loops"
    assert repeated_trigrams(dry) < repeated_trigrams(looping) / 2


def test_top_k_one_is_greedy_and_logit_bias_forces_a_token(with_default_model: Path) -> None:
    backend = load()
    ids = chat_ids(backend, "Say something.")
    greedy = token_ids(backend, ids, GenerationParams(temperature=0, max_new_tokens=10))
    assert token_ids(backend, ids, GenerationParams(temperature=1.5, top_k=1, max_new_tokens=10, seed=5)) == greedy
    forced = backend.encode(" banana", add_special=False)[0]
    out = token_ids(backend, ids, GenerationParams(temperature=0, max_new_tokens=3, logit_bias={forced: 100}))
    assert out == [forced] * 3
    banned = token_ids(backend, ids, GenerationParams(temperature=0, max_new_tokens=10, logit_bias={greedy[0]: -100}))
    assert banned[0] != greedy[0]


def test_logprobs_come_from_the_sampled_distribution(with_default_model: Path) -> None:
    backend = load()
    ids = chat_ids(backend, "What is the capital of France?")
    events = [
        e
        for e in backend.generate(
            ids,
            GenerationParams(temperature=0.7, top_k=5, max_new_tokens=8, seed=1, logprobs=True, top_logprobs=5),
            threading.Event(),
        )
        if e.token_id >= 0
    ]
    for event in events:
        tops = event.top_logprobs or []
        assert 1 <= len(tops) <= 5  # top_k=5 leaves at most five candidates
        assert [t.logprob for t in tops] == sorted((t.logprob for t in tops), reverse=True)
        assert abs(sum(np.exp(t.logprob) for t in tops) - 1) < 1e-3
        assert event.token_id in {t.token_id for t in tops}
        chosen = next(t for t in tops if t.token_id == event.token_id)
        assert chosen.logprob == pytest.approx(event.logprob)


def test_gbnf_grammar_and_json_schema(with_default_model: Path) -> None:
    backend = load()
    ids = chat_ids(backend, "Is the sky blue? Answer yes or no.")
    text, _ = generate_text(
        ids, GenerationParams(temperature=1.0, seed=4, grammar='root ::= "yes" | "no"', max_new_tokens=5)
    )
    assert text in ("yes", "no")
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string"}, "population": {"type": "integer"}},
        "required": ["city", "population"],
    }
    ids = chat_ids(backend, "Give the biggest city of France and its population as JSON.")
    text, stats = generate_text(ids, GenerationParams(temperature=0.8, seed=2, json_schema=schema, max_new_tokens=120))
    assert stats.finish_reason == "stop"
    jsonschema.validate(json.loads(text), schema)
    with pytest.raises(InvalidRequest):
        generate_text(ids, GenerationParams(grammar="root ::= (", max_new_tokens=5))


def test_context_full_ends_the_reply(with_default_model: Path) -> None:
    backend = load(n_ctx=128)
    ids = backend.encode("one two three four five six seven eight nine ten " * 20)[:100]
    assert len(ids) == 100
    # the pipeline caps max_new_tokens to the room left: prompt + reply fill the context exactly
    _text, stats = generate_text(ids, GenerationParams(max_new_tokens=500, ban_eos=True, seed=1))
    assert stats.finish_reason == "length" and stats.new_tokens == 128 - 100
    # asked of the backend directly, more than fits: it stops at the same place and says why
    events = list(backend.generate(ids, GenerationParams(max_new_tokens=500, ban_eos=True, seed=1), threading.Event()))
    assert len([e for e in events if e.token_id >= 0]) == 128 - 100
    assert events[-1].finish_reason == "context"
    with pytest.raises(ContextOverflow):
        backend.generate(ids + ids[:28], GenerationParams(), threading.Event())  # no room for a reply


def test_embeddings_mode(with_default_model: Path) -> None:
    backend = load()
    vectors = backend.embed(["The cat sat on the mat.", "A cat was sitting on a rug.", "Quarterly revenue grew by 4%."])
    norms = [float(np.linalg.norm(v)) for v in vectors]
    assert all(abs(n - 1) < 1e-5 for n in norms) and len(vectors[0]) == 576
    sims = np.array(vectors) @ np.array(vectors).T
    assert sims[0, 1] > sims[0, 2]
    with pytest.raises(InvalidRequest, match=r"input\[1\] has \d+ tokens") as refused:
        backend.embed(["short", "word " * (backend.context_length + 10)])  # never cut silently
    assert refused.value.param == "input"


def test_a_long_embedding_is_the_mean_over_its_tokens_and_lets_a_stream_go_on(with_default_model: Path) -> None:
    """A causal model's long input is embedded in chunks (as a prompt is read), each a scheduler task of its own:
    the same vector as llama.cpp's own mean pooling over the whole input in one batch, and a stream beside it
    keeps getting tokens."""
    import llama_cpp
    from llama_cpp._internals import LlamaBatch, LlamaContext

    backend = load(parallel=2)
    text = "The keeper climbed the stairs and lit the lamp before the storm came in. " * 80
    tokens = backend.encode(text)
    assert 800 < len(tokens) < backend.context_length
    params = llama_cpp.llama_context_default_params()
    params.n_ctx = params.n_batch = params.n_ubatch = len(tokens)
    params.embeddings, params.pooling_type = True, llama_cpp.LLAMA_POOLING_TYPE_MEAN
    params.n_threads = params.n_threads_batch = 2
    params.flash_attn_type = 0  # as the backend's contexts on a CPU
    reference_ctx = LlamaContext(model=backend._model, params=params, verbose=False)  # type: ignore[attr-defined]
    holder = LlamaBatch(n_tokens=len(tokens), embd=0, n_seq_max=1, verbose=False)
    try:
        holder.add_sequence(tokens, 0, logits_all=True)
        assert llama_cpp.llama_decode(reference_ctx.ctx, holder.batch) == 0
        pooled = np.ctypeslib.as_array(llama_cpp.llama_get_embeddings_seq(reference_ctx.ctx, 0), shape=(576,))
        reference = pooled.astype(np.float64) / np.linalg.norm(pooled)
    finally:
        holder.close()
        reference_ctx.close()

    # the backend's vector is read while a stream decodes beside it: its chunks are tasks between the stream's
    # steps (read alone first, it cost this test another ~1200-token read and proved nothing more)
    ids = chat_ids(backend, "Write a short story about a lighthouse keeper.")
    gaps: list[float] = []
    started, done = threading.Event(), threading.Event()

    def stream() -> None:
        last = None
        for _event in backend.generate(ids, GenerationParams(temperature=0, max_new_tokens=400, ban_eos=True),
                                      done):  # fmt: skip
            now = time.perf_counter()
            if last is not None:
                gaps.append(now - last)
            last = now
            started.set()

    thread = threading.Thread(target=stream)
    thread.start()
    assert started.wait(30)
    t0 = time.perf_counter()
    during = backend.embed([text])[0]
    took = time.perf_counter() - t0
    done.set()  # the rest of the stream proves nothing more
    thread.join(120)
    assert np.abs(np.array(during) - reference).max() < 1e-4
    assert max(gaps) < took / 2, f"the stream stalled {max(gaps):.2f} s while a {took:.2f} s embedding ran"


def test_side_contexts_decode_on_the_scheduler_thread(
    with_default_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Embeddings and scoring called from other threads, during a generation, decode on the scheduler's thread
    (a second thread with an OpenMP team slows every later step ~3x) and give what they give alone."""
    import llama_cpp

    backend = load(n_batch=32)
    ids = chat_ids(backend, "Write a short story about a lighthouse keeper.")
    long_prompt = chat_ids(backend, "Tell me about the history of lighthouses, their keepers and their lamps. " * 4)
    assert len(long_prompt) > 2 * 32  # scored in several chunks
    params = GenerationParams(temperature=0, max_new_tokens=48, ban_eos=True)
    alone_reply = token_ids(backend, ids, params)
    alone_scores = backend.score(long_prompt, top=3)
    alone_vectors = backend.embed(["The cat sat on the mat.", "Quarterly revenue grew."])
    callers: set[int] = set()
    original = llama_cpp.llama_decode

    def recording(ctx: object, batch: object) -> int:
        callers.add(threading.get_ident())
        return int(original(ctx, batch))

    monkeypatch.setattr(llama_cpp, "llama_decode", recording)
    results: dict[str, object] = {}
    workers = [
        threading.Thread(target=lambda: results.__setitem__("reply", token_ids(backend, ids, params))),
        threading.Thread(target=lambda: results.__setitem__("scores", backend.score(long_prompt, top=3))),
        threading.Thread(target=lambda: results.__setitem__("scores2", backend.score(long_prompt, top=3))),
        threading.Thread(target=lambda: results.__setitem__("vectors", backend.embed(["The cat sat on the mat.",
                                                                                      "Quarterly revenue grew."]))),
    ]  # fmt: skip
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    scheduler = backend._thread  # type: ignore[attr-defined]
    assert scheduler is not None and callers == {scheduler.ident}
    assert results["reply"] == alone_reply
    assert results["scores"] == alone_scores and results["scores2"] == alone_scores  # chunks of one call together
    assert np.allclose(results["vectors"], alone_vectors, atol=1e-6)  # type: ignore[arg-type]


def make_lora(path: Path, scale: float = 4.0) -> Path:
    """A random rank-4 PEFT LoRA on q, v and up of SmolLM2-135M, as a GGUF by llama.cpp's own converter."""
    from safetensors.numpy import save_file

    from modules.lifecycle.convert import LoraConvertArgs, convert_lora_to_gguf

    base = hf_default_model()
    config = json.loads((base / "config.json").read_text())
    hidden = config["hidden_size"]
    kv = hidden // config["num_attention_heads"] * config["num_key_value_heads"]
    outs = {"self_attn.q_proj": hidden, "self_attn.v_proj": kv, "mlp.up_proj": config["intermediate_size"]}
    rng = np.random.default_rng(0)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for module, out_features in outs.items():
            key = f"base_model.model.model.layers.{layer}.{module}"
            tensors[f"{key}.lora_A.weight"] = (rng.normal(0, scale, (4, hidden)) / np.sqrt(hidden)).astype(np.float32)
            tensors[f"{key}.lora_B.weight"] = (rng.normal(0, 1, (out_features, 4)) / 4).astype(np.float32)
    folder = path.with_name(f".{path.stem}-peft")  # only the GGUF stays
    folder.mkdir()
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    adapter = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": 4, "lora_alpha": 4.0, "bias": "none",
               "target_modules": ["q_proj", "v_proj", "up_proj"], "base_model_name_or_path": str(base)}  # fmt: skip
    (folder / "adapter_config.json").write_text(json.dumps(adapter))
    try:
        return convert_lora_to_gguf(LoraConvertArgs(folder, base, path), lambda *a, **k: None, threading.Event())
    finally:
        shutil.rmtree(folder)


def test_lora_gguf_changes_the_output_and_unloads(with_default_model: Path, tmp_path: Path) -> None:
    backend = load()
    ids = chat_ids(backend, "What is the capital of France?")
    params = GenerationParams(temperature=0, max_new_tokens=12)
    base = token_ids(backend, ids, params)
    adapter = make_lora(tmp_path / "random-lora.gguf")
    backend.load_lora(adapter, 1.0)
    changed = token_ids(backend, ids, params)
    assert changed != base
    backend.unload_lora(None)
    assert token_ids(backend, ids, params) == base
    bogus = tmp_path / "bogus.gguf"
    bogus.write_bytes(b"GGUF" + b"\x00" * 100)
    with pytest.raises(ModelLoadError):
        backend.load_lora(bogus)
    assert token_ids(backend, ids, params) == base


def test_xtc_with_logprobs_returns_the_token_xtc_left(with_default_model: Path) -> None:
    backend = load()
    ids = chat_ids(backend, "What is the capital of France?")
    raw = backend.next_token_logprobs(ids, 10)  # the model's own next-token distribution
    probs = [math.exp(lp) for _, lp in raw]
    threshold = (probs[1] + probs[2]) / 2  # exactly the two most likely tokens reach it
    params = GenerationParams(
        temperature=1.0,
        xtc_probability=1.0,
        xtc_threshold=threshold,
        max_new_tokens=1,
        seed=3,
        logprobs=True,
        top_logprobs=5,
    )
    event = next(e for e in backend.generate(ids, params, threading.Event()) if e.token_id >= 0)
    tops = event.top_logprobs or []
    # XTC removed the most likely token and kept the second (the least likely above the threshold)
    assert raw[0][0] not in {t.token_id for t in tops} and event.token_id != raw[0][0]
    assert tops[0].token_id == raw[1][0]
    assert tops[0].logprob == pytest.approx(math.log(probs[1] / (1 - probs[0])), abs=1e-3)
    chosen = next(t for t in tops if t.token_id == event.token_id)
    assert chosen.logprob == pytest.approx(event.logprob)


def test_cancelled_waiters_give_their_places_back(with_default_model: Path) -> None:
    backend = load(parallel=1, max_queue=3)
    ids = chat_ids(backend, "Tell me a story.")
    params = GenerationParams(max_new_tokens=500, ban_eos=True)
    cancels = [threading.Event() for _ in range(6)]
    running = backend.generate(ids, params, cancels[0])
    next(running)  # holds the only slot
    waiting = backend.generate(ids, params, cancels[1])  # first in the queue, still wanted
    gone = [backend.generate(ids, params, cancels[i]) for i in (2, 3)]
    cancels[2].set()
    cancels[3].set()  # these two clients left while queued behind a live request
    more = [backend.generate(ids, params, cancels[i]) for i in (4, 5)]  # would be 503s if the cancelled held places
    with pytest.raises(QueueFull):
        backend.generate(ids, params, threading.Event())  # the queue is full of live requests now
    assert [[e.finish_reason for e in stream] for stream in gone] == [["cancelled"], ["cancelled"]]
    assert backend.stats()["queue_depth"] == 3
    for cancel in cancels:
        cancel.set()
    for stream in [running, waiting, *more]:
        assert [e.finish_reason for e in stream if e.finish_reason] == ["cancelled"]
    deadline = time.monotonic() + 5
    while backend.stats()["busy_slots"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert backend.stats()["busy_slots"] == 0 and backend.stats()["queue_depth"] == 0


def test_lora_changes_are_refused_while_generating_and_change_nothing(with_default_model: Path, tmp_path: Path) -> None:
    backend = load(parallel=2, prompt_cache=False)
    shared.settings.lora_dir = tmp_path / "loras"
    shared.loras_dir().mkdir()
    make_lora(shared.loras_dir() / "random-lora.gguf")
    ids = chat_ids(backend, "What is the capital of France?")
    params = GenerationParams(temperature=0, max_new_tokens=12)
    base = token_ids(backend, ids, params)
    models.apply_loras(["random-lora.gguf"])
    with_lora = token_ids(backend, ids, params)
    assert with_lora != base
    long = GenerationParams(temperature=0, max_new_tokens=40, ban_eos=True)
    alone = token_ids(backend, ids, long)
    # the running stream could go on far past 40 tokens, so it is still running however long the refusals take;
    # its first 40 tokens are compared, then it is cancelled
    cancel = threading.Event()
    running = backend.generate(ids, long.replace(max_new_tokens=4000), cancel)
    try:
        got = [next(running).token_id for _ in range(3)]
        with pytest.raises(InvalidRequest, match="while 1 generation is running"):
            models.apply_loras([])  # would have taken the adapter away under the running stream
        with pytest.raises(InvalidRequest):
            backend.load_lora(shared.loras_dir() / "random-lora.gguf", 0.5)
        with pytest.raises(InvalidRequest):
            backend.unload_lora(None)
        while len(got) < len(alone):
            got.append(next(running).token_id)
    finally:
        cancel.set()
    assert [e.finish_reason for e in running][-1] == "cancelled"
    assert got == alone  # it never saw a change
    assert shared.loras == ["random-lora.gguf"]
    assert token_ids(backend, ids, params) == with_lora  # the adapter is still applied, all of it
    models.apply_loras([])
    assert token_ids(backend, ids, params) == base and shared.loras == []
