"""Remote backend: any OpenAI-compatible engine (vLLM, llama-server, llama-cpp-python's server, TensorRT-LLM's
trtllm-serve, another textgen) does the generating.

Prompts are still built here (templates, history, extensions), then sent to the engine's ``/v1/completions`` with
``stream: true``; the engine's text comes back as token events. Tokenization uses the engine's endpoint when it
has one (textgen's ``/v1/internal/encode``, llama-server's and vLLM's ``/tokenize``, llama-cpp-python's
``/extras/tokenize``, trtllm-serve's ``/_internal/tokenize``); otherwise token counts are estimated at four
characters per token. Closing the stream (Stop, a client gone) stops the engine.

trtllm-serve refuses any field its ``CompletionRequest`` does not declare (``extra="forbid"`` in
tensorrt_llm/serve/openai_protocol.py), so it gets only those: ``ignore_eos`` for ban_eos, ``response_format``
for schemas, regexes and grammars, and the samplers it lacks are refused here rather than sent.

vLLM is known by its ``/version`` endpoint and its model card (``owned_by: vllm``). It batches by itself, so no cap of
ours stands in front of it; from 0.10.2 on it reads ``structured_outputs`` (older ones ``guided_json`` and the like);
it ignores the fields it does not declare, so the samplers it lacks are refused here; it streams the token ids of
each chunk (``return_token_ids``), so usage counts tokens, not chunks; and its ``max_model_len`` is the context.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import socket
import threading
from collections.abc import Generator, Iterator
from pathlib import Path
from typing import Any

import httpx

from modules.errors import EngineUnavailable, InvalidRequest, ModelLoadError, NotSupported, QueueFull, TextgenError
from modules.generation.params import GenerationParams
from modules.loaders import OPTIONS
from modules.loaders.base import Backend, ModelMetadata, QueuePlace, TokenEvent, TopLogprob

log = logging.getLogger(__name__)
# textgen's and text-generation-webui's sampler names; vLLM and llama-server understand the common ones.
PASSTHROUGH = (
    "top_k", "min_p", "typical_p", "repetition_penalty", "repetition_penalty_range", "dry_multiplier", "dry_base",
    "dry_allowed_length", "xtc_threshold", "xtc_probability", "mirostat_mode", "mirostat_tau", "mirostat_eta",
    "dynatemp_range", "dynatemp_exponent", "temperature_last", "top_a", "tfs", "epsilon_cutoff", "eta_cutoff",
    "no_repeat_ngram_size", "ban_eos", "min_tokens", "grammar", "regex",
)  # fmt: skip
# What trtllm-serve's CompletionRequest takes (tensorrt_llm/serve/openai_protocol.py), as GenerationParams names;
# vLLM's CompletionRequest (vllm/entrypoints/openai/completion/protocol.py) takes the same ones
TRTLLM_PARAMS = VLLM_PARAMS = frozenset(
    {
        "max_new_tokens", "stop", "skip_special_tokens", "seed", "temperature", "top_p", "top_k", "min_p",
        "repetition_penalty", "presence_penalty", "frequency_penalty", "logit_bias", "logprobs", "top_logprobs",
        "ban_eos", "min_tokens", "json_schema", "regex", "grammar",
    }
)  # fmt: skip
STRUCTURED_OUTPUTS_SINCE = (0, 10, 2)  # vLLM's structured_outputs field; before it guided_json, guided_regex, ...
# streams in flight to an engine that batches by itself (it runs --max-num-seqs of them, queues the rest) before
# textgen adds --max-queue of its own and then answers 503
ENGINE_BATCH = 1024


class RemoteBackend(Backend):
    """A model served by another OpenAI-compatible engine."""

    loader_name = "remote"
    supports_logprobs = True
    supports_grammar = True
    option_names = OPTIONS["remote"]
    supported_params = frozenset(GenerationParams.field_names())
    required_packages = ("httpx",)

    def __init__(self) -> None:
        super().__init__()
        self.client: httpx.Client | None = None
        self.model_id = ""
        self.models: list[str] = []
        self._context = 4096
        self._tokenizer: str | None = None  # "textgen" | "llama-server" | "vllm" | "llama-cpp-python" | "trtllm"
        self.dialect = "openai"  # "openai" (textgen) | "vllm" | "llama.cpp" | "trtllm": which request fields to send
        self.engine_version: tuple[int, ...] = ()  # vLLM's, from its /version
        self._slots: threading.Semaphore | None = threading.Semaphore(1)  # None: the engine batches, no cap here
        self._waiting = 0  # streams in flight, running or queued; guarded by _lock
        self._max_queue = 64
        self._lock = threading.Lock()

    @classmethod
    def check(cls, path: Path, options: dict[str, Any]) -> None:
        """A --remote-url to reach (the engine itself is asked when loading)."""
        super().check(path, options)
        url = str(options.get("remote_url") or "")
        if not url:
            raise ModelLoadError("the remote loader needs --remote-url (e.g. http://gpu-box:8000)")
        if not url.startswith(("http://", "https://")):
            raise ModelLoadError(f"--remote-url must start with http:// or https://, not {url!r}")

    @classmethod
    def load(cls, path: Path, options: dict[str, Any]) -> RemoteBackend:
        """Connect, pick the model (``--model``, else the engine's first), learn its template and tokenizer."""
        url = str(options.get("remote_url") or "").rstrip("/")
        if not url:
            raise ModelLoadError("the remote loader needs --remote-url (e.g. http://gpu-box:8000)")
        self = cls()
        self.connect(url, str(path) if str(path) not in ("", ".") else "", options)
        self.path = path
        return self

    def connect(self, url: str, wanted: str, options: dict[str, Any]) -> None:
        """Talk to the engine at ``url``: the model ``wanted`` (else its first), its context, tokenizer, dialect."""
        url = url.rstrip("/").removesuffix("/v1")
        headers = {"Authorization": f"Bearer {options['remote_api_key']}"} if options.get("remote_api_key") else {}
        # no connection cap of httpx's (100 by default, then a PoolTimeout): generate() bounds the streams in flight
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        self.client = httpx.Client(base_url=url, headers=headers, timeout=httpx.Timeout(30, read=600), limits=limits)
        try:
            listing = self.client.get("/v1/models")
            listing.raise_for_status()
            data = listing.json().get("data", [])
        except (httpx.HTTPError, ValueError) as exc:
            raise ModelLoadError(f"cannot reach the engine at {url}: {exc}") from exc
        self.models = [str(m.get("id")) for m in data if m.get("id")]
        if wanted and self.models and wanted not in self.models:
            raise ModelLoadError(f"the engine at {url} serves {', '.join(self.models)}, not {wanted!r}")
        self.model_id = wanted or (self.models[0] if self.models else "")
        card: dict[str, Any] = next((m for m in data if m.get("id") == self.model_id), {})
        parallel = int(options.get("parallel") or 4)
        self._slots = threading.Semaphore(parallel)
        self.max_parallel = parallel
        max_queue = options.get("max_queue")
        self._max_queue = 64 if max_queue is None else int(max_queue)
        self.metadata = ModelMetadata(name=self.model_id, architecture="remote", extra={"url": url})
        info = self._engine_info()
        trained = card.get("max_model_len") or info.get("context_length")
        # the engine's own limit is the context; --n-ctx only where the engine tells none
        self._context = int(trained or options.get("n_ctx") or 4096)
        self.metadata.context_length = int(trained) if trained else None
        self.metadata.chat_template = info.get("chat_template")
        self.metadata.bos_token = info.get("bos_token") or ""
        self.metadata.eos_token = info.get("eos_token") or ""
        self.metadata.add_bos_token = bool(info.get("add_bos_token", False))
        self._tokenizer = self._find_tokenizer()
        if self._tokenizer == "vllm" and not self.metadata.bos_token:
            self._learn_bos()
        if card.get("owned_by") == "tensorrt_llm":  # trtllm-serve's ModelCard
            self.dialect = "trtllm"
            self.supported_params = TRTLLM_PARAMS  # type: ignore[misc]  # the others are refused, not sent
        elif card.get("owned_by") == "vllm":
            self.dialect = "vllm"
            self.engine_version = self._vllm_version()
            self.supported_params = VLLM_PARAMS  # type: ignore[misc]  # it would ignore the others without a word
            self._slots, self.max_parallel = None, ENGINE_BATCH  # it batches: the engine queues, not us
        elif self._tokenizer in ("llama-server", "llama-cpp-python"):
            self.dialect = "llama.cpp"
        log.info(
            "remote: %s at %s (%s%s; tokenizer: %s; context %d)",
            self.model_id,
            url,
            self.dialect,
            " " + ".".join(map(str, self.engine_version)) if self.engine_version else "",
            self._tokenizer or "estimated",
            self._context,
        )

    def _learn_bos(self) -> None:
        """Whether the engine's tokenizer starts a text with BOS (vLLM says it only by tokenizing): then
        prompts are encoded with it, as the engine would, and sent as token ids."""
        try:
            plain, special = self.encode("a", add_special=False), self.encode("a", add_special=True)
        except TextgenError:
            return
        self.metadata.add_bos_token = len(special) == len(plain) + 1 and special[1:] == plain
        if self.metadata.add_bos_token:
            self.metadata.bos_token_id = special[0]
            with contextlib.suppress(TextgenError):
                self.metadata.bos_token = self.decode(special[:1])

    def _vllm_version(self) -> tuple[int, ...]:
        """vLLM's version from its ``/version`` (e.g. ``0.32.0`` -> (0, 32, 0)); () when it does not say."""
        assert self.client is not None
        try:
            text = str(self.client.get("/version").json().get("version", ""))
        except (httpx.HTTPError, ValueError, AttributeError):
            return ()
        parts = []
        for part in text.split("."):
            digits = "".join(itertools.takewhile(str.isdigit, part))
            if not digits:
                break
            parts.append(int(digits))
        return tuple(parts)

    def _engine_info(self) -> dict[str, Any]:
        """Template and special tokens from a textgen (model info) or llama-server (/props) engine."""
        assert self.client is not None
        for path in ("/v1/internal/model/info", "/props"):
            try:
                response = self.client.get(path)
                if response.status_code == 200:
                    data = response.json()
                    if isinstance(data, dict):
                        settings = data.get("default_generation_settings") or {}
                        return {**data, "context_length": data.get("context_length") or settings.get("n_ctx")}
            except (httpx.HTTPError, ValueError):
                continue
        return {}

    def _find_tokenizer(self) -> str | None:
        probes = [
            ("textgen", "/v1/internal/encode", {"text": "hello"}),
            ("llama-server", "/tokenize", {"content": "hello"}),
            ("vllm", "/tokenize", {"model": self.model_id, "prompt": "hello"}),
            ("llama-cpp-python", "/extras/tokenize", {"input": "hello"}),
            ("trtllm", "/_internal/tokenize", {"prompt": "hello"}),
        ]
        assert self.client is not None
        for kind, path, body in probes:
            try:
                response = self.client.post(path, json=body)
                if response.status_code == 200 and isinstance(response.json().get("tokens"), list):
                    return kind
            except (httpx.HTTPError, ValueError):
                continue
        return None

    def unload(self) -> None:
        """Close the connection (the engine keeps its model)."""
        if self.client is not None:
            self.client.close()
            self.client = None

    def served_models(self) -> list[str]:
        """The models the engine serves."""
        return list(self.models)

    @property
    def context_length(self) -> int:
        return self._context

    def _require(self) -> httpx.Client:
        if self.client is None:
            raise ModelLoadError("the remote engine has been disconnected")
        return self.client

    def _post(self, path: str, body: dict[str, Any], key: str) -> Any:
        """``body[key]`` of the engine's JSON answer to a POST; an engine that cannot be reached, answers an error
        or something else than expected is an EngineUnavailable (503), a request it refuses an InvalidRequest."""
        client = self._require()
        try:
            response = client.post(path, json=body)
        except httpx.TransportError as exc:
            raise EngineUnavailable(f"the remote engine cannot be reached: {exc}") from exc
        if response.status_code >= 400:
            raise engine_error(response)
        try:
            return response.json()[key]
        except (ValueError, KeyError, TypeError) as exc:
            raise EngineUnavailable(f"the remote engine's {path} answered without {key!r}") from exc

    def encode(self, text: str, add_special: bool = True) -> list[int]:
        if self._tokenizer == "textgen":
            return list(self._post("/v1/internal/encode", {"text": text}, "tokens"))
        if self._tokenizer == "llama-server":
            return list(self._post("/tokenize", {"content": text, "add_special": add_special}, "tokens"))
        if self._tokenizer == "vllm":
            body = {"model": self.model_id, "prompt": text, "add_special_tokens": add_special}
            return list(self._post("/tokenize", body, "tokens"))
        if self._tokenizer == "llama-cpp-python":  # adds BOS where the model wants one, as its completions do
            return list(self._post("/extras/tokenize", {"input": text}, "tokens"))
        if self._tokenizer == "trtllm":
            return list(self._post("/_internal/tokenize", {"prompt": text}, "tokens"))
        self._require()
        return [0] * max(1, len(text) // 4)  # no tokenizer endpoint: an estimate, for counting only

    def decode(self, ids: list[int]) -> str:
        if self._tokenizer == "textgen":
            return str(self._post("/v1/internal/decode", {"tokens": ids}, "text"))
        if self._tokenizer == "llama-server":
            return str(self._post("/detokenize", {"tokens": ids}, "content"))
        if self._tokenizer == "vllm":
            return str(self._post("/detokenize", {"model": self.model_id, "tokens": ids}, "prompt"))
        if self._tokenizer == "llama-cpp-python":
            return str(self._post("/extras/detokenize", {"tokens": ids}, "text"))
        self._require()
        raise NotSupported("the remote engine offers no detokenizer")

    def token_piece(self, token_id: int, special: bool = False) -> bytes:
        return self.decode([token_id]).encode("utf-8") if self._tokenizer not in (None, "trtllm") else b""

    def _body(self, prompt_ids: list[int], params: GenerationParams, extra: dict[str, Any]) -> dict[str, Any]:
        text = extra.get("prompt_text")
        prompt: Any = text if isinstance(text, str) and (text or not prompt_ids) else prompt_ids
        if self._tokenizer == "vllm" and prompt_ids:  # its own token ids: the prompt it reads is the one we counted
            prompt = prompt_ids  # (text would get a BOS of its own on top: one token over the context at the end)
        body: dict[str, Any] = {
            "model": self.model_id,
            "prompt": prompt,
            "max_tokens": params.max_new_tokens,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "stream": True,
        }
        if params.seed >= 0:  # -1 is textgen's "random"; vLLM and trtllm-serve would take it as a fixed seed
            body["seed"] = params.seed
        if self.dialect == "trtllm":
            return _trtllm_body(body, params)
        if self.dialect == "vllm":
            return _vllm_body(body, params, self.engine_version)
        if self.dialect == "llama.cpp":  # its servers default to top_k 40, min_p 0.05 and repeat_penalty 1.1
            body.update(top_k=params.top_k, min_p=params.min_p, repeat_penalty=params.repetition_penalty)
        if params.stop:
            body["stop"] = params.stop
        if params.presence_penalty:
            body["presence_penalty"] = params.presence_penalty
        if params.frequency_penalty:
            body["frequency_penalty"] = params.frequency_penalty
        if params.logit_bias:
            body["logit_bias"] = {str(k): v for k, v in params.logit_bias.items()}
        if params.logprobs or params.top_logprobs:
            body["logprobs"] = max(1, params.top_logprobs)
        if params.json_schema is not None:
            body["json_schema"] = body["guided_json"] = params.json_schema
        changed = params.non_default()
        for name in PASSTHROUGH:
            if name in changed:
                body[name] = changed[name]
        if params.grammar:
            body["guided_grammar"] = params.grammar
        if params.regex:
            body["guided_regex"] = params.regex
        return body

    def generate(
        self,
        prompt_ids: list[int],
        params: GenerationParams,
        cancel: threading.Event,
        extra: dict[str, Any] | None = None,
    ) -> Iterator[TokenEvent]:
        """Queue, then stream the engine's completion as token events."""
        self._require()
        body = self._body(prompt_ids, params, extra or {})
        with self._lock:
            if self._waiting >= self._max_queue + self.max_parallel:
                raise QueueFull()
            self._waiting += 1
        place = QueuePlace(self._leave)
        return place.guard(self._stream(body, cancel, place))

    def _leave(self) -> None:
        with self._lock:
            self._waiting -= 1

    def _stream(self, body: dict[str, Any], cancel: threading.Event, place: QueuePlace) -> Iterator[TokenEvent]:
        try:
            client = self._require()
            slots = self._slots
            if slots is None:
                yield from self._events(client, body, cancel)
                return
            while not slots.acquire(timeout=0.2):
                if cancel.is_set():
                    yield TokenEvent(-1, b"", finish_reason="cancelled")
                    return
            try:
                yield from self._events(client, body, cancel)
            finally:
                slots.release()
        finally:
            place.release()

    def _events(self, client: httpx.Client, body: dict[str, Any], cancel: threading.Event) -> Iterator[TokenEvent]:
        try:
            with client.stream("POST", "/v1/completions", json=body) as response:
                if response.status_code >= 400:
                    response.read()
                    raise engine_error(response)
                finish = "stop"
                watcher = _HangUpOnCancel(response, cancel)
                try:
                    for line in response.iter_lines():
                        if cancel.is_set():
                            break
                        if line.startswith("data: ") and line != "data: [DONE]":
                            finish = yield from self._chunk(line, finish)
                except httpx.HTTPError as exc:
                    if not cancel.is_set():
                        raise EngineUnavailable(
                            f"the reply was cut off: the engine's connection broke ({exc})"
                        ) from exc
                finally:
                    watcher.stop()
                if cancel.is_set():
                    yield TokenEvent(-1, b"", finish_reason="cancelled")
                    return  # leaving the block closes the connection: the engine stops
                yield TokenEvent(-1, b"", finish_reason=finish)
        except httpx.TransportError as exc:
            raise EngineUnavailable(f"the remote engine cannot be reached: {exc}") from exc

    @staticmethod
    def _chunk(line: str, finish: str) -> Generator[TokenEvent, None, str]:
        """The token events of one ``data:`` line; returns the finish reason so far."""
        try:
            chunk = json.loads(line[6:])
        except ValueError as exc:
            raise EngineUnavailable(f"the remote engine sent a line that is not JSON: {line[:200]!r}") from exc
        events, finish = _chunk_events(chunk, finish)
        yield from events
        return finish

    def stats(self) -> dict[str, Any]:
        return {"slots": self.max_parallel, "queue_depth": max(0, self._waiting - self.max_parallel)}


class _HangUpOnCancel:
    """Cut a streaming response's connection as soon as ``cancel`` is set, so Stop works while the engine is
    silent (a long prefill) and not only when the next line arrives.

    Closing the response from another thread does not wake a read blocked on its socket; shutting the socket
    down does: the read fails at once and the engine sees the client gone.
    """

    def __init__(self, response: httpx.Response, cancel: threading.Event) -> None:
        self.response, self.cancel = response, cancel
        self._done = False
        self._lock = threading.Lock()
        threading.Thread(target=self._watch, name="remote-cancel", daemon=True).start()

    def stop(self) -> None:
        """The stream is over: never touch its connection again (it may go back to the pool)."""
        with self._lock:
            self._done = True

    def _watch(self) -> None:
        while not self._done:
            if not self.cancel.wait(0.05):
                continue
            with self._lock:
                if self._done:
                    return
                stream = self.response.extensions.get("network_stream")
                sock = stream.get_extra_info("socket") if stream is not None else None
                if sock is not None:
                    with contextlib.suppress(OSError):
                        sock.shutdown(socket.SHUT_RDWR)
            return


def engine_error(response: httpx.Response) -> TextgenError:
    """What an engine's error answer means for our client: a request it refuses (400, 422) is the client's
    mistake, a full engine (429) says retry, anything else is the engine failing (503 here, never a 500)."""
    try:
        message = _error_message(response.json().get("error")) or response.text
    except (ValueError, AttributeError):
        message = response.text
    message = message[:500]
    if response.status_code in (400, 422):
        return InvalidRequest(f"the remote engine refused the request: {message}")
    if response.status_code == 429:
        return QueueFull()
    return EngineUnavailable(f"the remote engine answered {response.status_code}: {message}")


def _error_message(error: Any) -> str:
    """The text of an OpenAI-style error: ``{"message": ...}`` or a plain value."""
    return str((error.get("message") if isinstance(error, dict) else error) or "")


def _chunk_events(chunk: dict[str, Any], finish: str) -> tuple[list[TokenEvent], str]:
    """The token events of one streamed completion chunk, and the finish reason so far."""
    if "error" in chunk:
        raise EngineUnavailable(f"the remote engine failed during the reply: {_error_message(chunk['error'])}")
    choices = chunk.get("choices") or []
    if not choices:
        return [], finish
    choice = choices[0]
    text = choice.get("text") or ""
    ids = choice.get("token_ids")
    events: list[TokenEvent] = []
    if isinstance(ids, list) and ids:  # vLLM's return_token_ids: one event per token, the text on the first
        found = _logprobs_each(choice.get("logprobs"), len(ids))
        pieces = (choice.get("logprobs") or {}).get("tokens")
        if not (isinstance(pieces, list) and len(pieces) == len(ids) and "".join(map(str, pieces)) == text):
            pieces = [text] + [""] * (len(ids) - 1)
        for n, token_id in enumerate(ids):
            logprob, tops = found[n]
            piece = str(pieces[n]).encode("utf-8")
            events.append(TokenEvent(int(token_id), piece, logprob=logprob, top_logprobs=tops))
    elif text:
        logprob, tops = _logprobs(choice.get("logprobs"))
        events.append(TokenEvent(0, text.encode("utf-8"), logprob=logprob, top_logprobs=tops))
    if choice.get("finish_reason"):
        finish = "length" if choice["finish_reason"] == "length" else "stop"
    return events, finish


def _declared_fields(body: dict[str, Any], params: GenerationParams) -> dict[str, Any]:
    """``body`` with the sampling fields trtllm-serve and vLLM both declare, where ``params`` sets them."""
    changed = params.non_default()
    for name in ("stop", "presence_penalty", "frequency_penalty", "top_k", "min_p", "repetition_penalty", "min_tokens"):
        if name in changed:
            body[name] = changed[name]
    if params.logit_bias:  # both take biases in [-100, 100] only; -100 bans the token there too
        body["logit_bias"] = {str(k): max(-100.0, min(100.0, v)) for k, v in params.logit_bias.items()}
    if params.logprobs or params.top_logprobs:
        body["logprobs"] = max(1, params.top_logprobs)
    if params.ban_eos:
        body["ignore_eos"] = True
    if not params.skip_special_tokens:
        body["skip_special_tokens"] = False
    return body


def _constraint(params: GenerationParams) -> tuple[str, Any] | None:
    """What the output must follow: ("json", schema), ("regex", pattern), ("grammar", GBNF) or None."""
    if params.json_schema is not None:
        return "json", params.json_schema
    if params.regex:
        return "regex", params.regex
    if params.grammar:
        return "grammar", params.grammar
    return None


def _trtllm_body(body: dict[str, Any], params: GenerationParams) -> dict[str, Any]:
    """The fields of trtllm-serve's CompletionRequest for ``params`` (it answers 400 to any other field)."""
    _declared_fields(body, params)
    constraint = _constraint(params)
    if constraint is not None:
        kind, value = constraint
        body["response_format"] = (
            {"type": "json", "schema": value} if kind == "json" else {"type": "regex", "regex": value}
            if kind == "regex" else {"type": "ebnf", "ebnf": value}
        )  # fmt: skip
    return body


def _vllm_body(body: dict[str, Any], params: GenerationParams, version: tuple[int, ...]) -> dict[str, Any]:
    """The fields of vLLM's CompletionRequest for ``params``; ``version`` picks its structured-output field."""
    _declared_fields(body, params)
    current = not version or version >= STRUCTURED_OUTPUTS_SINCE
    constraint = _constraint(params)
    if constraint is not None:
        kind, value = constraint
        if current:
            body["structured_outputs"] = {kind: value}
        else:
            body[f"guided_{kind}"] = value
    if current:
        body["return_token_ids"] = True
    return body


def _logprobs_each(data: Any, count: int) -> list[tuple[float | None, list[TopLogprob] | None]]:
    """Each of a chunk's ``count`` tokens' logprob and alternatives (None where the chunk has none)."""
    out: list[tuple[float | None, list[TopLogprob] | None]] = [(None, None)] * count
    if not isinstance(data, dict):
        return out
    values = data.get("token_logprobs") or []
    tops = data.get("top_logprobs") or []
    for n in range(min(count, len(values))):
        top = tops[n] if n < len(tops) and isinstance(tops[n], dict) else {}
        alternatives = [TopLogprob(0, token.encode("utf-8"), float(value)) for token, value in top.items()]
        out[n] = (float(values[n]) if values[n] is not None else None, alternatives if top else None)
    return out


def _logprobs(data: Any) -> tuple[float | None, list[TopLogprob] | None]:
    """The last token's logprob and alternatives from a legacy completions logprobs object."""
    if not isinstance(data, dict) or not data.get("token_logprobs"):
        return None, None
    logprob = data["token_logprobs"][-1]
    tops = (data.get("top_logprobs") or [None])[-1] or {}
    alternatives = [TopLogprob(0, token.encode("utf-8"), float(value)) for token, value in tops.items()]
    return (float(logprob) if logprob is not None else None), alternatives
