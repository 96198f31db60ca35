"""llama.cpp engine benchmarks, each side measured in the same run on the default model.

1. single stream: one streamed request through textgen's HTTP API vs raw ``Llama.create_completion`` in this
   process (same prompt, 128 new tokens, greedy, end-of-sequence banned on both sides);
2. concurrency: 8 concurrent streaming clients (128 new tokens each) vs ``python -m llama_cpp.server`` serving the
   same file with the same threads: aggregate tokens/s and p95 time to first token;
3. prompt cache: time to first token of the third turn of a chat, with the prompt cache and without it.
"""

from __future__ import annotations

import contextlib
import statistics
import threading
import time
from typing import Any

import httpx

from bench.common import (
    MODEL,
    CpuAccount,
    StreamResult,
    llama_cpp_server,
    metrics,
    percentile,
    stream_completion,
    textgen,
)

NEW_TOKENS = 128
PROMPT = "Write a long, detailed story about a lighthouse keeper who finds a message in a bottle."
EOG_BIAS = {"0": -100, "2": -100, "4": -100}  # SmolLM2's end-of-generation tokens
EOG_BIAS_IDS = {int(k): float(v) for k, v in EOG_BIAS.items()}  # the same, for llama-cpp-python and the backend
THREADS = 2
REPEATS = 3


def single_stream(rounds: int = 7) -> dict[str, Any]:
    """Alternate raw and API runs (both warm) and compare the medians, to tame this machine's noise."""
    from llama_cpp import Llama

    llm = Llama(str(MODEL), n_ctx=4096, n_threads=THREADS, n_threads_batch=THREADS, n_batch=512, verbose=False)
    bias = EOG_BIAS_IDS
    body = {"prompt": PROMPT, "max_tokens": NEW_TOKENS, "temperature": 0, "logit_bias": EOG_BIAS,
            "stream_options": {"include_usage": True}}  # fmt: skip  # a chunk carries the tokens that came together
    raw: list[float] = []
    ours: list[float] = []
    engine: list[dict[str, Any]] = []  # the same scheduler in this process: no HTTP, no client
    streamed = 0
    with textgen("--threads", str(THREADS)) as server:
        cpu = CpuAccount(server.proc.pid)
        llm.create_completion(PROMPT, max_tokens=8, temperature=0)  # warm-up both
        stream_completion(server.url, {**body, "max_tokens": 8})
        for _ in range(rounds):
            time.sleep(0.5)
            started = time.perf_counter()
            out = llm.create_completion(PROMPT, max_tokens=NEW_TOKENS, temperature=0, logit_bias=bias)
            raw.append(out["usage"]["completion_tokens"] / (time.perf_counter() - started))
            time.sleep(0.5)
            with cpu:
                result = stream_completion(server.url, body)
            ours.append(result.tokens / (result.ended - result.started))
            streamed += result.tokens
            engine.append(engine_in_process(1, temperature=0))
        # then embeddings (MiniLM in torch) and next-token logits (a llama.cpp side context), each from a request
        # thread, as a retrieval extension or a client would; a second thread with an OpenMP team once made every
        # later step ~3x slower
        for path, extra in (
            ("/v1/embeddings", {"input": ["a lighthouse", "a bottle"]}),
            ("/v1/internal/logits", {"prompt": PROMPT}),
        ):
            httpx.post(server.url + path, json=extra, timeout=120).raise_for_status()
        time.sleep(1)
        after: list[float] = []
        for _ in range(3):
            time.sleep(0.5)
            result = stream_completion(server.url, body)
            after.append(result.tokens / (result.ended - result.started))
    llm.close()
    r, o, a = statistics.median(raw), statistics.median(ours), statistics.median(after)
    e = statistics.median(x["decode_phase_tokens_per_s"] for x in engine)
    return {
        "raw_tokens_per_s": r,
        "textgen_tokens_per_s": o,
        "ratio": o / r,
        "target": ">= 0.95",
        "raw_runs": raw,
        "textgen_runs": ours,
        "after_embeddings_and_logits_tokens_per_s": a,
        "after_embeddings_and_logits_ratio": a / r,
        "after_runs": after,
        "engine_in_process": engine,
        "engine_in_process_tokens_per_s": e,
        "engine_in_process_ratio": e / r,
        # per token (medians): the wall time each side took, and the CPU the API runs spent outside llama.cpp's
        # compute threads
        "ms_per_token": {
            "raw": 1000 / r,
            "textgen": 1000 / o,
            "engine_in_process": 1000 / e,
            "engine_in_process_decode": statistics.median(
                x["decode_ms_per_step"] / x["tokens_per_step"] for x in engine
            ),
        },
        "cpu_ms_per_token": cpu.summary(streamed),
    }


def _concurrent(
    url: str,
    clients: int,
    usage: bool = True,
    headers: dict[str, str] | None = None,
    cpu: CpuAccount | None = None,
) -> dict[str, float]:
    results: list[StreamResult] = []
    lock = threading.Lock()

    def one(i: int) -> None:
        body = {
            "prompt": f"{PROMPT} Chapter {i + 1}.",
            "max_tokens": NEW_TOKENS,
            "temperature": 0.8,
            "seed": i,
            "logit_bias": EOG_BIAS,
            **({"stream_options": {"include_usage": True}} if usage else {}),
        }
        result = stream_completion(url, body, headers=headers)
        with lock:
            results.append(result)

    stream_completion(url, {"prompt": PROMPT, "max_tokens": 4}, headers=headers)  # warm-up
    threads = [threading.Thread(target=one, args=(i,)) for i in range(clients)]
    with cpu or contextlib.nullcontext():
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    start = min(r.started for r in results)
    end = max(r.ended for r in results)
    tokens = sum(r.tokens for r in results)
    # decode phase: while every stream has had its first token and none has ended (what raw decode measures)
    low, high = max(r.first_token for r in results), min(r.ended for r in results)
    in_window = sum(r.tokens_between(low, high) for r in results)
    return {
        "tokens": tokens,
        "seconds": end - start,
        "tokens_per_s": tokens / (end - start),
        "decode_phase_tokens_per_s": in_window / (high - low) if high > low else 0.0,
        "p95_ttft_s": percentile([r.ttft for r in results], 0.95),
    }


def concurrency(clients: int = 8, rounds: int = 3) -> dict[str, Any]:
    """8 streams through the API against llama_cpp.server, and their decode phase against the raw batched loop
    (flash attention off, as textgen runs on the CPU, and on) and the same scheduler in this process without HTTP:
    rounds alternate between the four, medians compared (this machine's speed wanders by 10-20% between runs)."""
    off: list[float] = []
    on: list[float] = []
    engine: list[dict[str, Any]] = []
    runs: list[dict[str, float]] = []
    with textgen("--threads", str(THREADS), "--parallel", str(clients)) as server:
        cpu = CpuAccount(server.proc.pid)
        for _ in range(rounds):
            off.append(raw_batched_decode(clients))
            on.append(raw_batched_decode(clients, flash_attn=1))
            engine.append(engine_in_process(clients))
            runs.append(_concurrent(server.url, clients, cpu=cpu))
    median = statistics.median
    raw_by_attention = {"flash_attn_off": median(off), "flash_attn_on": median(on)}
    raw = max(raw_by_attention.values())  # the faster setting is the reference
    middle = median(x["decode_phase_tokens_per_s"] for x in runs)
    ours = min(runs, key=lambda x: abs(x["decode_phase_tokens_per_s"] - middle))  # the median run
    in_process = median(x["decode_phase_tokens_per_s"] for x in engine)
    with llama_cpp_server(
        "--n_threads",
        str(THREADS),
        "--n_threads_batch",
        str(THREADS),
        "--n_ctx",
        "4096",
        "--interrupt_requests",
        "False",
    ) as peer:
        theirs = _concurrent(peer.url, clients, usage=False)
    return {
        "clients": clients,
        "textgen": ours,
        "llama_cpp_server": theirs,
        "ratio": ours["tokens_per_s"] / theirs["tokens_per_s"],
        "raw_batched_decode_tokens_per_s": raw,
        "raw_batched_decode_by_attention": raw_by_attention,
        "ratio_vs_raw_batched": ours["decode_phase_tokens_per_s"] / raw,
        "raw_batched_runs": {"flash_attn_off": off, "flash_attn_on": on},
        "textgen_runs": runs,
        "cpu_ms_per_token": cpu.summary(sum(int(x["tokens"]) for x in runs)),
        "engine_in_process": engine,
        "engine_in_process_tokens_per_s": in_process,
        "engine_in_process_ratio_vs_raw_batched": in_process / raw,
        # per 8-token step (medians): the raw loop's with flash attention on and off, the scheduler's in this
        # process (its llama_decode and what is around it), and through HTTP (the step as the clients see it)
        "step_ms": {
            "raw_batched_flash_attn_on": 1000 * clients / raw_by_attention["flash_attn_on"],
            "raw_batched_flash_attn_off": 1000 * clients / raw_by_attention["flash_attn_off"],
            "engine_in_process": 1000 * clients / in_process,
            "engine_in_process_decode": median(x["decode_ms_per_step"] for x in engine),
            "engine_in_process_around_decode": median(x["around_decode_ms_per_step"] for x in engine),
            "through_http": 1000 * clients / ours["decode_phase_tokens_per_s"],
        },
        "target": ">= 1.5x llama_cpp.server, >= 0.95x raw batched decode, p95 TTFT < 1 s",
        "ttft_lower": ours["p95_ttft_s"] < theirs["p95_ttft_s"],
    }


LONG_SYSTEM = (
    "You are a helpful assistant for a hardware store. Here is the catalogue you know about:\n"
    + "\n".join(f"- Item {i}: a {c} {t} made of {m}, sold in packs of {i % 7 + 1}." for i, (c, t, m) in enumerate(
        [(c, t, m) for c in ("red", "blue", "green", "black") for t in ("hammer", "wrench", "drill", "saw", "clamp") for m in ("steel", "oak", "plastic", "brass", "iron")]
    ))
)  # fmt: skip


def _third_turn_ttft(url: str) -> float:
    client = httpx.Client(timeout=120)
    history: list[dict[str, str]] = [{"role": "system", "content": LONG_SYSTEM}]
    ttft = 0.0
    for turn, question in enumerate(
        ["Which hammers do you have?", "And which saws?", "Which items are made of brass?"]
    ):
        history.append({"role": "user", "content": question})
        body = {"messages": history, "max_tokens": 32, "temperature": 0, "stream": True}
        started = time.perf_counter()
        first = 0.0
        text = ""
        with client.stream("POST", url + "/v1/chat/completions", json=body) as response:
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    import json

                    delta = json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
                    if delta and not first:
                        first = time.perf_counter()
                    text += delta
        history.append({"role": "assistant", "content": text})
        if turn == 2:
            ttft = (first or time.perf_counter()) - started
    return ttft


def prompt_cache() -> dict[str, Any]:
    results = {}
    for label, flags in (("with_cache", []), ("without_cache", ["--no-prompt-cache"])):
        with textgen("--threads", str(THREADS), *flags) as server:
            results[label] = statistics.median(_third_turn_ttft(server.url) for _ in range(REPEATS))
    return {
        "third_turn_ttft_with_cache_s": results["with_cache"],
        "third_turn_ttft_without_cache_s": results["without_cache"],
        "ratio": results["with_cache"] / results["without_cache"],
        "target": "<= 0.5",
    }


# ---------------------------------------------------------------- speculative decoding and batched decode (#18)
CODE_FILE = '''class Inventory:
    """Items in a shop, with their prices and how many are in stock."""

    def __init__(self):
        self.items = {}

    def add(self, name, price, count=1):
        if name in self.items:
            old_price, old_count = self.items[name]
            self.items[name] = (price, old_count + count)
        else:
            self.items[name] = (price, count)

    def remove(self, name, count=1):
        if name not in self.items:
            raise KeyError(f"no such item: {name}")
        price, have = self.items[name]
        if count > have:
            raise ValueError(f"only {have} of {name} left")
        if count == have:
            del self.items[name]
        else:
            self.items[name] = (price, have - count)

    def total_value(self):
        return sum(price * count for price, count in self.items.values())

    def cheapest(self):
        if not self.items:
            return None
        return min(self.items, key=lambda name: self.items[name][0])

    def report(self):
        lines = []
        for name, (price, count) in sorted(self.items.items()):
            lines.append(f"{name}: {count} at {price:.2f}")
        lines.append(f"total: {self.total_value():.2f}")
        return "\\n".join(lines)


def load_inventory(rows):
    inventory = Inventory()
    for name, price, count in rows:
        inventory.add(name, float(price), int(count))
    return inventory
'''
TEXT_FILE = (
    "The lighthose stood at the end of a long stone pier, and evry evening the keeper climbed its one hundred and "
    "twelve steps to light the lamp. He had done this for thirty years. The ships that passed in the night never "
    "knew his name, but they trusted the light, and the light had never failed them. In the winter the storms came "
    "from the north and the waves broke over the pier, and the keeper would watch from the lantern room as the "
    "spray rose higher than the galery rail. In the summer the sea was calm and the evenings were long, and he "
    "would sit on the gallery with a cup of tea and watch the fishing boats come home.\n\n"
    "One morning in early spring he found a bottle on the rocks below the pier. It was green glass, sealed with "
    "wax, and inside it was a letter folded many times. The paper was dry. He carried it up the steps to the "
    "lantern room and opened it on the table by the window, where the light was best. The letter was written in "
    "a careful hand, in ink that had faded to brown, and it was adressed to whoever finds this. He read it twice. "
    "Then he put on his coat, locked the door of the lighthouse behind him, and walked into the town to find the "
    "harbour master, who kept the old records of every ship that had ever sailed from the bay."
)
TEXT_PROMPT = (
    "<|im_start|>user\nRewrite this text with the spelling mistakes corrected. Change nothing else.\n\n"
    f"{TEXT_FILE}<|im_end|>\n<|im_start|>assistant\n"
)
REWRITE_PROMPT = (
    "<|im_start|>user\nRewrite this Python code with the class `Inventory` renamed to `Stock` (everywhere). "
    f"Change nothing else and output only the code.\n\n{CODE_FILE}<|im_end|>\n<|im_start|>assistant\n"
)
STORY_PROMPT = "<|im_start|>user\nWrite a long story about a lighthouse keeper.<|im_end|>\n<|im_start|>assistant\n"
SPEC_TOKENS = 256


def _first_difference(a: str, b: str) -> int | None:
    return next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
        None if len(a) == len(b) else min(len(a), len(b)),
    )


def _similarity(reply: str, given: str) -> float:
    import difflib

    return round(difflib.SequenceMatcher(None, reply[: len(given)], given).ratio(), 3)


def speculative(rounds: int = 4) -> dict[str, Any]:
    """1. input-grounded stream (correct the typos of a ~330-token text, greedy, 256 tokens): textgen's API with
    speculation vs raw ``Llama.create_completion`` and vs llama-cpp-python with ``LlamaPromptLookupDecoding``,
    same tokens out; the same for a ~400-token code file to rewrite (for the record: the default model writes other
    code instead of copying it); 2. open-ended stream (a story): textgen with speculation on vs off, two pairs a
    round. Medians of alternating runs; the story's ratio is the median of its adjacent on/off pairs' ratios."""
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    common = {"n_ctx": 4096, "n_threads": THREADS, "n_threads_batch": THREADS, "n_batch": 512, "verbose": False}
    raw = Llama(str(MODEL), **common)
    raw_code = Llama(str(MODEL), **common)  # its own instance: one Llama caches one prompt
    # logits_all: llama-cpp-python sizes its score buffer from the argument, not from the draft model it forces on
    pld = Llama(str(MODEL), draft_model=LlamaPromptLookupDecoding(num_pred_tokens=10), logits_all=True, **common)
    bias = EOG_BIAS_IDS
    body = {"prompt": TEXT_PROMPT, "max_tokens": SPEC_TOKENS, "temperature": 0, "logit_bias": EOG_BIAS,
            "stream_options": {"include_usage": True}}  # fmt: skip
    code = {**body, "prompt": REWRITE_PROMPT}
    story = {**body, "prompt": STORY_PROMPT}
    runs: dict[str, list[float]] = {k: [] for k in ("raw", "pld", "ours", "ours_off", "code_raw", "code_ours")}
    runs.update(story_on=[], story_off=[])
    texts: dict[str, str] = {}

    def local(llm: Any, name: str, prompt: str = TEXT_PROMPT) -> None:
        started = time.perf_counter()
        out = llm.create_completion(prompt, max_tokens=SPEC_TOKENS, temperature=0, logit_bias=bias)
        runs[name].append(out["usage"]["completion_tokens"] / (time.perf_counter() - started))
        texts[name] = out["choices"][0]["text"]

    def remote(url: str, request: dict[str, Any], name: str) -> None:
        result = stream_completion(url, request)
        runs[name].append(result.tokens / (result.ended - result.started))
        texts[name] = result.text

    with textgen("--threads", str(THREADS)) as on, textgen("--threads", str(THREADS), "--no-speculative") as off:
        for llm in (raw, pld):
            llm.create_completion(TEXT_PROMPT, max_tokens=8, temperature=0)
        raw_code.create_completion(REWRITE_PROMPT, max_tokens=8, temperature=0)
        stream_completion(on.url, {**code, "max_tokens": 8})
        for url in (on.url, off.url):
            stream_completion(url, {**body, "max_tokens": 8})
        for round_ in range(rounds):
            steps = (
                lambda: local(raw, "raw"),
                lambda: local(pld, "pld"),
                lambda: remote(on.url, body, "ours"),
                lambda: remote(off.url, body, "ours_off"),
                lambda: local(raw_code, "code_raw", REWRITE_PROMPT),
                lambda: remote(on.url, code, "code_ours"),
                lambda: remote(on.url, story, "story_on"),
                lambda: remote(off.url, story, "story_off"),
            ) + (  # the story twice a round: its target (0.97) lies within what this machine's speed wanders
                lambda: remote(off.url, story, "story_off"),
                lambda: remote(on.url, story, "story_on"),
            )
            for step in steps if round_ % 2 == 0 else steps[::-1]:  # each pair in both orders: this machine drifts
                time.sleep(0.3)
                step()
        accepted = metrics(on.url, "textgen_speculative_")
    for llm in (raw, raw_code, pld):
        llm.close()
    med = {k: statistics.median(v) for k, v in runs.items()}
    return {
        "input_grounded": {
            "textgen_tokens_per_s": med["ours"],
            "textgen_speculation_off_tokens_per_s": med["ours_off"],
            "raw_tokens_per_s": med["raw"],
            "prompt_lookup_tokens_per_s": med["pld"],
            "ratio_vs_raw": med["ours"] / med["raw"],
            "ratio_vs_prompt_lookup": med["ours"] / med["pld"],
            "target": ">= 1.5 vs raw, >= 1.2 vs LlamaPromptLookupDecoding",
            "same_text_as_raw": texts["ours"] == texts["raw"],
            "first_difference_vs_raw": _first_difference(texts["ours"], texts["raw"]),
            "same_text_as_speculation_off": texts["ours"] == texts["ours_off"],
            "raw_same_as_prompt_lookup": texts["raw"] == texts["pld"],
            "similarity_to_the_given_text": _similarity(texts["ours"], TEXT_FILE),
        },
        "input_grounded_code": {
            "textgen_tokens_per_s": med["code_ours"],
            "raw_tokens_per_s": med["code_raw"],
            "ratio_vs_raw": med["code_ours"] / med["code_raw"],
            "same_text_as_raw": texts["code_ours"] == texts["code_raw"],
            "similarity_to_the_given_file": _similarity(texts["code_ours"], CODE_FILE),
            "target": "none (for the record: the default model does not reproduce code it is given)",
        },
        "open_ended": {
            "speculation_on_tokens_per_s": med["story_on"],
            "speculation_off_tokens_per_s": med["story_off"],
            # each on run has its off run next to it in time: the median of those pairs' ratios, which a shift of
            # this machine's speed between rounds does not move as it moves the medians of the two sides
            "ratio": statistics.median(a / b for a, b in zip(runs["story_on"], runs["story_off"], strict=True)),
            "ratio_of_medians": med["story_on"] / med["story_off"],
            "target": ">= 0.97",
        },
        "server_metrics": accepted,
        "runs": runs,
    }


def engine_in_process(clients: int = 8, temperature: float = 0.8) -> dict[str, Any]:
    """The decode phase of textgen's llama.cpp scheduler in this process, as the server runs it (same
    options, speculation planner on, events handed to an asyncio loop the way the HTTP layer gets them) but with no
    HTTP, JSON or clients: every ``llama_decode`` is timed, so a step splits into the engine's own compute and what
    the scheduler does around it (sampling, bookkeeping, drafting, handing events over)."""
    import asyncio

    import llama_cpp

    from modules.generation.params import GenerationParams
    from modules.loaders.base import TokenSink
    from modules.loaders.llama_cpp import LlamaCppBackend

    calls: list[tuple[float, float, int]] = []  # (start, end, tokens) of each llama_decode
    arrivals: list[float] = []  # when each token's event reached the event loop
    real = llama_cpp.llama_decode

    def timed(ctx: Any, batch: Any) -> int:
        began = time.perf_counter()
        code = real(ctx, batch)
        calls.append((began, time.perf_counter(), int(batch.n_tokens)))
        return int(code)

    backend = LlamaCppBackend.load(MODEL, {"threads": THREADS, "parallel": clients})
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, name="bench-loop", daemon=True).start()
    bias = EOG_BIAS_IDS

    async def run_all() -> list[tuple[float, float]]:
        async def one(i: int) -> tuple[float, float]:
            queue: asyncio.Queue[Any] = asyncio.Queue()
            params = GenerationParams(max_new_tokens=NEW_TOKENS, temperature=temperature, seed=i, logit_bias=bias)
            ids = backend.encode(f"{PROMPT} Chapter {i + 1}." if clients > 1 else PROMPT)
            backend.submit(ids, params, threading.Event(), TokenSink(loop, queue, i))
            first = 0.0
            while True:
                _, event = await queue.get()
                if isinstance(event, BaseException):
                    raise event
                first = first or time.perf_counter()
                if event.piece:
                    arrivals.append(time.perf_counter())
                if event.finish_reason:
                    return first, time.perf_counter()

        return await asyncio.gather(*(one(i) for i in range(clients)))

    llama_cpp.llama_decode = timed
    try:
        asyncio.run_coroutine_threadsafe(run_all(), loop).result(300)  # warm-up: graphs, sampler, caches
        calls.clear()
        arrivals.clear()
        spans = asyncio.run_coroutine_threadsafe(run_all(), loop).result(300)
    finally:
        llama_cpp.llama_decode = real
        loop.call_soon_threadsafe(loop.stop)
        backend.unload()
    low, high = max(s[0] for s in spans), min(s[1] for s in spans)  # every stream decoding
    steps = [c for c in calls if low <= c[0] and c[1] <= high]
    wall = steps[-1][1] - steps[0][0]
    decode = sum(c[1] - c[0] for c in steps)
    tokens = sum(1 for t in arrivals if steps[0][0] < t <= steps[-1][1])
    return {
        "steps": len(steps),
        "step_ms": 1000 * wall / len(steps),
        "decode_ms_per_step": 1000 * decode / len(steps),
        "around_decode_ms_per_step": 1000 * (wall - decode) / len(steps),
        "tokens_fed_per_step": sum(c[2] for c in steps) / len(steps),
        "tokens_per_step": tokens / len(steps),
        "decode_phase_tokens_per_s": tokens / wall,
    }


def raw_batched_decode(clients: int = 8, steps: int = NEW_TOKENS, flash_attn: int = 0) -> float:
    """Tokens/s of ``llama_decode`` over ``clients`` sequences, one token each per step, after their prompts:
    no HTTP, no sampling (the engine's own limit for this batch shape; ``flash_attn``: llama.cpp's setting)."""
    import llama_cpp
    from llama_cpp._internals import LlamaBatch, LlamaContext, LlamaModel

    llama_cpp.llama_backend_init()
    model = LlamaModel(path_model=str(MODEL), params=llama_cpp.llama_model_default_params(), verbose=False)
    params = llama_cpp.llama_context_default_params()
    params.n_ctx, params.n_seq_max, params.n_batch, params.n_ubatch = 4096 * clients, clients, 512, 512
    params.n_threads = params.n_threads_batch = THREADS
    params.flash_attn_type = flash_attn
    ctx = LlamaContext(model=model, params=params, verbose=False)
    holder = LlamaBatch(n_tokens=512, embd=0, n_seq_max=1, verbose=False)
    batch = holder.batch
    prompts = [
        model.tokenize(f"{PROMPT} Chapter {i + 1}.".encode(), add_bos=True, special=True) for i in range(clients)
    ]
    n = 0
    for seq, ids in enumerate(prompts):
        for pos, token in enumerate(ids):
            batch.token[n], batch.pos[n], batch.n_seq_id[n], batch.seq_id[n][0], batch.logits[n] = (
                token,
                pos,
                1,
                seq,
                False,
            )
            n += 1
    batch.n_tokens = n
    assert llama_cpp.llama_decode(ctx.ctx, batch) == 0
    started = time.perf_counter()
    for step in range(steps):
        for seq, ids in enumerate(prompts):
            batch.token[seq], batch.pos[seq], batch.n_seq_id[seq] = 28, len(ids) + step, 1
            batch.seq_id[seq][0], batch.logits[seq] = seq, True
        batch.n_tokens = clients
        assert llama_cpp.llama_decode(ctx.ctx, batch) == 0
    elapsed = time.perf_counter() - started
    holder.close()
    ctx.close()
    model.close()
    return clients * steps / elapsed
