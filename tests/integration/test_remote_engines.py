"""The remote backend against third-party engines: llama-cpp-python's real server (``python -m llama_cpp.server``)
on the default model, and a stand-in trtllm-serve that refuses undeclared fields as the real one does.

Everything listens on 127.0.0.1 only.
"""

from __future__ import annotations

import http.server
import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from modules import models, shared
from modules.errors import InvalidRequest
from modules.generation.params import GenerationParams
from modules.generation.pipeline import check_params, generate_reply
from modules.loaders.remote import RemoteBackend
from modules.settings import load_settings
from tests.conftest import ROOT, default_model_path, free_port


class LlamaCppServer:
    """``python -m llama_cpp.server`` on the default model, on a free port of 127.0.0.1."""

    def __init__(self, tmp: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = tmp / "llama_cpp_server.log"
        self._log = open(self.log_path, "wb")
        command = [
            sys.executable, "-m", "llama_cpp.server", "--model", str(default_model_path()), "--model_alias", "smol",
            "--host", "127.0.0.1", "--port", str(self.port), "--n_ctx", "2048", "--n_threads", "2",
        ]  # fmt: skip
        self.proc = subprocess.Popen(command, cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama_cpp.server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url + "/v1/models", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.3)
        raise TimeoutError(f"llama_cpp.server not ready after 60 s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


@pytest.fixture(scope="module")
def llama_cpp_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LlamaCppServer]:
    server = LlamaCppServer(tmp_path_factory.mktemp("llama-cpp-server"))
    try:
        yield server
    finally:
        server.stop()


LONG = 800  # tokens of the generation that Stop interrupts (min_tokens keeps it going)


def reply(prompt: str, params: GenerationParams, cancel: threading.Event | None = None) -> tuple[list[str], Any]:
    deltas, stats = [], None
    for delta in generate_reply(prompt, params, cancel=cancel):
        deltas.append(delta.text)
        stats = delta.stats or stats
    return deltas, stats


def test_llama_cpp_server_streams_stops_cancels_and_counts_tokens(
    llama_cpp_server: LlamaCppServer, hub: object, user_data: Path
) -> None:
    import llama_cpp

    shared.init(
        load_settings(
            ["--user-data-dir", str(user_data), "--loader", "remote", "--remote-url", llama_cpp_server.url], env={}
        )
    )
    backend = models.load_model("smol")
    assert isinstance(backend, RemoteBackend) and backend.dialect == "llama.cpp"
    # token counts through its /extras/tokenize agree with llama.cpp's own tokenizer on the same file
    vocab = llama_cpp.Llama(str(default_model_path()), vocab_only=True, verbose=False)
    assert backend.encode("Hello world, how are you?") == vocab.tokenize(b"Hello world, how are you?", special=True)
    assert backend.decode(backend.encode("Hello world")).strip() == "Hello world"

    deltas, stats = reply("The capital of France is", GenerationParams(temperature=0, max_new_tokens=24))
    assert "Paris" in "".join(deltas) and len([d for d in deltas if d]) > 3  # streamed, piece by piece
    assert stats.new_tokens > 3 and stats.tokens_per_second > 0

    text = "".join(reply("Count: one, two, three, four,", GenerationParams(temperature=0, stop=[","]))[0])
    assert "," not in text and text.strip()  # the reply ends before the stop string

    rate = stats.tokens_per_second
    limit = max(10.0, LONG / rate / 2)  # half the time the whole long generation would take at this speed
    cancel, started = threading.Event(), time.monotonic()
    long = GenerationParams(temperature=0.8, max_new_tokens=LONG, min_tokens=LONG)  # no early end of text
    for n, _ in enumerate(generate_reply("Tell me a very long story.", long, cancel=cancel)):
        if n == 3:
            cancel.set()
    assert time.monotonic() - started < limit
    started = time.monotonic()
    _, quick = reply("Hi", GenerationParams(max_new_tokens=4))
    assert quick.finish_reason in ("length", "stop")
    waited = time.monotonic() - started
    # the engine serves one request at a time: the next one waits for the long one unless Stop ended it
    assert waited < limit, f"the next request waited {waited:.1f} s: the engine kept generating"
    deadline = time.monotonic() + 5
    while "Disconnected from client" not in llama_cpp_server.log() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert "Disconnected from client" in llama_cpp_server.log()


# ---------------------------------------------------------------------------------------------- trtllm-serve
# CompletionRequest's fields in tensorrt_llm/serve/openai_protocol.py (NVIDIA/TensorRT-LLM); its base model has
# ConfigDict(extra="forbid"), so any other field is a 400
TRTLLM_FIELDS = {
    "model", "prompt", "best_of", "echo", "frequency_penalty", "logit_bias", "logprobs", "max_tokens", "n",
    "presence_penalty", "seed", "stop", "stream", "stream_options", "suffix", "temperature", "top_p", "user",
    "lora_request", "prompt_ignore_length", "use_beam_search", "top_k", "top_p_min", "min_p", "repetition_penalty",
    "length_penalty", "early_stopping", "stop_token_ids", "include_stop_str_in_output", "ignore_eos", "min_tokens",
    "skip_special_tokens", "spaces_between_special_tokens", "truncate_prompt_tokens", "return_context_logits",
    "detokenize", "thinking_token_budget", "add_special_tokens", "response_format", "disaggregated_params",
    "priority", "conversation_params",
}  # fmt: skip


class TrtllmStandIn:
    """Answers like trtllm-serve: its ModelCard, /_internal/tokenize, and completions that refuse extra fields."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        engine = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def _json(self, status: int, body: object) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                if self.path == "/v1/models":
                    card = {"id": "trt", "object": "model", "created": 0, "owned_by": "tensorrt_llm"}
                    self._json(200, {"object": "list", "data": [card]})
                else:
                    self._json(404, {"detail": "Not Found"})

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
                if self.path == "/_internal/tokenize":
                    tokens = list(range(len(body["prompt"].split())))
                    self._json(200, {"count": len(tokens), "tokens": tokens})
                    return
                if self.path != "/v1/completions":
                    self._json(404, {"detail": "Not Found"})
                    return
                engine.bodies.append(body)
                extra = sorted(set(body) - TRTLLM_FIELDS)
                if extra:
                    message = "; ".join(f"{name}: Extra inputs are not permitted" for name in extra)
                    self._json(400, {"object": "error", "message": message, "type": "BadRequestError", "code": 400})
                    return
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                for text, finish in ((" Paris", None), (".", "stop")):
                    chunk = {"choices": [{"index": 0, "text": text, "finish_reason": finish}]}
                    self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
                self.wfile.write(b"data: [DONE]\n\n")

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def trtllm() -> Iterator[TrtllmStandIn]:
    engine = TrtllmStandIn()
    yield engine
    engine.close()


def test_trtllm_serve_gets_only_fields_it_declares(trtllm: TrtllmStandIn) -> None:
    backend = RemoteBackend.load(Path("trt"), {"remote_url": trtllm.url})
    try:
        assert backend.dialect == "trtllm" and backend.encode("one two three") == [0, 1, 2]
        params = GenerationParams(
            temperature=0.7, top_k=20, min_p=0.05, repetition_penalty=1.1, presence_penalty=0.1, seed=-1,
            stop=["\n"], ban_eos=True, min_tokens=2, logprobs=True, top_logprobs=2, logit_bias={5: -200},
            json_schema={"type": "object"}, skip_special_tokens=False,
        )  # fmt: skip
        check_params(backend, params, strict=True)  # every one of these has a field there
        events = list(backend.generate([1, 2], params, threading.Event(), {"prompt_text": "The capital is"}))
        assert b"".join(e.piece for e in events) == b" Paris." and events[-1].finish_reason == "stop"
        sent = trtllm.bodies[-1]
        assert set(sent) <= TRTLLM_FIELDS and "seed" not in sent  # -1 means random: no fixed seed is sent
        assert sent["ignore_eos"] is True and sent["response_format"] == {"type": "json", "schema": {"type": "object"}}
        assert sent["logit_bias"] == {"5": -100.0} and sent["logprobs"] == 2 and sent["skip_special_tokens"] is False
        with pytest.raises(InvalidRequest, match="typical_p"):
            check_params(backend, GenerationParams(typical_p=0.9), strict=True)  # refused, not sent
        ignored = GenerationParams(typical_p=0.9, dry_multiplier=0.5, grammar="root ::= [a-z]+")
        check_params(backend, ignored, strict=False)
        events = list(backend.generate([1], ignored, threading.Event(), {"prompt_text": "Hi"}))
        assert events[-1].finish_reason == "stop" and set(trtllm.bodies[-1]) <= TRTLLM_FIELDS
        assert trtllm.bodies[-1]["response_format"] == {"type": "ebnf", "ebnf": "root ::= [a-z]+"}
    finally:
        backend.unload()
