"""What every generation endpoint shares: the model to serve with, GenerationParams from a request, chat prompts
with tools and response formats, and running several generations in worker threads as one async stream.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import Any

import anyio
from fastapi import Request

from extensions.openai import tools as tooling
from extensions.openai.auth import caller_id, is_admin
from extensions.openai.errors import APIError
from extensions.openai.metrics import METRICS
from extensions.openai.protocol import (
    OPENAI_SHAPED,
    ChatCompletionRequest,
    ChatMessage,
    ResponseFormat,
    TextgenExtras,
)
from modules import models, shared
from modules.chat.prompt import ChatOptions, build_chat_prompt, instruction_template
from modules.errors import ContextOverflow, InvalidRequest, ModelNotLoaded
from modules.generation.params import GenerationParams
from modules.generation.pipeline import Delta, DeltaBuilder, GenerationStats, current_model, launch_to, prepare
from modules.generation.presets import load_preset
from modules.images import load_image
from modules.loaders.base import Backend, TokenEvent, TokenSink

log = logging.getLogger(__name__)
_switch_lock = asyncio.Lock()


# ------------------------------------------------------------------ the model
def _local_match(name: str) -> str | None:
    names = models.model_names()
    if name in names:
        return name
    for candidate in names:
        path = PurePosixPath(candidate)
        if name in (path.stem, path.parent.name if str(path.parent) != "." else None):
            return candidate
    return None


def _is_loaded(name: str) -> bool:
    loaded = shared.model_name
    if loaded is None:
        return False
    path = PurePosixPath(loaded)
    return name in (loaded, path.stem, path.parent.name)


async def serving_backend(request: Request, requested: str | None) -> Backend:
    """The backend for a generation request.

    A name that is not a local model (``gpt-4o``) is served by the loaded model. A local model that is not the
    loaded one is loaded first, when the caller may load models and nothing else is generating.
    """
    if requested and not _is_loaded(requested):
        local = _local_match(requested)
        if local is not None:
            if not is_admin(request):
                raise APIError(403, f"loading {local} needs the admin key", type_="permission_error", param="model")
            async with _switch_lock:
                if not _is_loaded(requested):
                    if shared.running_generations():
                        raise APIError(
                            503,
                            f"{local} is not loaded and the server is busy with {shared.model_name}; retry shortly",
                            type_="service_unavailable",
                            code="server_busy",
                            headers={"Retry-After": "2"},
                        )
                    await anyio.to_thread.run_sync(models.load_model, local)
    try:
        return current_model()
    except ModelNotLoaded as exc:
        raise APIError(503, str(exc), type_="service_unavailable", code="model_not_loaded") from exc


# ------------------------------------------------------------------ parameters
def generation_params(req: TextgenExtras, *, max_tokens: int | None, default_max: int) -> GenerationParams:
    """GenerationParams from a request: the model's recommended sampling < preset < textgen sampler fields < OpenAI
    fields."""
    values: dict[str, Any] = models.recommended_sampling()[0]
    if req.preset:
        values.update(load_preset(req.preset))
    for name in GenerationParams.field_names():
        if name not in OPENAI_SHAPED and getattr(req, name, None) is not None:
            values[name] = getattr(req, name)
    for name in ("temperature", "top_p", "seed", "presence_penalty", "frequency_penalty"):
        value = getattr(req, name, None)
        if value is not None:
            values[name] = value
    stop = getattr(req, "stop", None)
    if stop is not None:
        values["stop"] = [stop] if isinstance(stop, str) else stop
    bias = getattr(req, "logit_bias", None)
    if bias:
        try:
            values["logit_bias"] = {int(k): float(v) for k, v in bias.items()}
        except ValueError as exc:
            raise InvalidRequest("logit_bias keys must be token ids", param="logit_bias") from exc
        if any(not -100 <= v <= 100 for v in values["logit_bias"].values()):
            raise InvalidRequest("logit_bias values must be between -100 and 100", param="logit_bias")
    values["max_new_tokens"] = max_tokens if max_tokens is not None else default_max
    if req.grammar:
        values["grammar"] = req.grammar
    return GenerationParams.from_dict(values)


def validate_schema(schema: Any, param: str) -> dict[str, Any]:
    """A JSON schema, checked against the metaschema: an invalid one is a 400."""
    import jsonschema

    if not isinstance(schema, dict):
        raise InvalidRequest("the JSON schema must be an object", param=param)
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        raise InvalidRequest(f"invalid JSON schema: {exc.message}", param=param) from exc
    return schema


def response_schema(fmt: ResponseFormat | None) -> dict[str, Any] | None:
    """The JSON schema a ``response_format`` constrains the output to; None for text.

    ``json_object`` alone is any JSON object; with a ``schema`` (llama-cpp-python's and Together's form, which
    instructor sends too) that schema is honoured exactly as ``json_schema`` is.
    """
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        if fmt.schema_ is None:
            return {"type": "object"}
        return validate_schema(fmt.schema_, "response_format.schema")
    if fmt.json_schema is None or fmt.json_schema.schema_ is None:
        raise InvalidRequest("json_schema.schema is required", param="response_format.json_schema")
    return validate_schema(fmt.json_schema.schema_, "response_format.json_schema.schema")


def check_constraints(params: GenerationParams, backend: Backend) -> None:
    """400 when the output is to be constrained (schema or grammar) and the backend cannot, or both are set."""
    if (params.json_schema is not None or params.grammar) and not backend.supports_grammar:
        raise InvalidRequest(
            f"the {backend.loader_name} backend cannot constrain output (response_format, grammar, required tools)",
            param="response_format",
        )
    if params.grammar and params.json_schema is not None:
        raise InvalidRequest("grammar cannot be combined with response_format or required tools", param="grammar")
    if params.regex and (params.grammar or params.json_schema is not None):
        raise InvalidRequest("regex cannot be combined with grammar, response_format or required tools", param="regex")


# ------------------------------------------------------------------ chat prompts
def _content(content: Any, index: int, vision: bool, images: list[Any]) -> str | list[dict[str, Any]]:
    """A message's text; for a vision model, content parts with ``{"type": "image"}`` where images go."""
    if content is None or isinstance(content, str):
        return content or ""
    texts: list[str] = []
    parts: list[dict[str, Any]] = []
    where = f"messages[{index}].content"
    for part in content:
        kind = part.get("type")
        if kind in ("text", "input_text", "output_text"):
            texts.append(str(part.get("text", "")))
            parts.append({"type": "text", "text": str(part.get("text", ""))})
        elif kind in ("image_url", "input_image", "image"):
            if not vision:
                raise InvalidRequest(
                    "the loaded model cannot see images; send text only or load a vision model", param=where
                )
            url = part.get("image_url")
            url = url.get("url") if isinstance(url, dict) else (url or part.get("url"))
            if not isinstance(url, str):
                raise InvalidRequest("an image part needs image_url.url", param=where)
            images.append(load_image(url, where))
            parts.append({"type": "image"})
        else:
            raise InvalidRequest(f"unsupported content part type {kind!r}", param=where)
    return parts if any(p["type"] == "image" for p in parts) else "\n".join(texts)


def template_messages(
    messages: list[ChatMessage], backend: Backend, template: str | None, images: list[Any] | None = None
) -> list[dict[str, Any]]:
    """OpenAI messages as the plain dicts chat templates expect (images collected into ``images``)."""
    knows_calls = bool(template) and "tool_calls" in str(template)
    collected = images if images is not None else []
    result: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        role = {"developer": "system", "function": "tool"}.get(message.role, message.role)
        content = _content(message.content, i, backend.supports_vision, collected)
        text = content if isinstance(content, str) else ""
        entry: dict[str, Any] = {"role": role, "content": content}
        if message.name:
            entry["name"] = message.name
        if message.tool_calls:
            if knows_calls:
                entry["tool_calls"] = [
                    {**c, "function": {**c.get("function", {}), "arguments": _arguments_value(c)}}
                    for c in message.tool_calls
                ]
            else:
                entry["content"] = (text + "\n" if text else "") + "\n".join(
                    tooling.render_call(c) for c in message.tool_calls
                )
        if message.tool_call_id:
            entry["tool_call_id"] = message.tool_call_id
        result.append(entry)
    return result


def _arguments_value(call: dict[str, Any]) -> Any:
    arguments = (call.get("function") or {}).get("arguments", "{}")
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return arguments


@dataclass
class ChatJob:
    """A chat request turned into a prompt, parameters and a tool plan."""

    prompt: str
    params: GenerationParams
    plan: tooling.ToolPlan
    n: int
    served_name: str
    reply_prefix: str = ""
    json_mode: bool = False
    images: list[Any] = field(default_factory=list)


def prepare_chat(req: ChatCompletionRequest, backend: Backend) -> ChatJob:
    """Build the prompt and parameters of a chat completion request (400s for anything wrong)."""
    req.log_unknown_fields("chat.completions")
    if req.user:
        log.info("chat completion for user %r", req.user[:64])
    tools_raw = [t.model_dump(exclude_none=True) for t in req.tools or []]
    choice = req.tool_choice
    if req.functions and not tools_raw:
        tools_raw = [{"type": "function", "function": f.model_dump(exclude_none=True)} for f in req.functions]
        choice = req.function_call if req.function_call is not None else choice
        if isinstance(choice, dict) and "name" in choice:
            choice = {"type": "function", "function": {"name": choice["name"]}}
    plan = tooling.plan_tools(tools_raw, choice, req.parallel_tool_calls)
    if req.stream_options is not None and not req.stream:
        raise InvalidRequest("stream_options is only allowed with stream: true", param="stream_options")
    if req.top_logprobs and not req.logprobs:
        raise InvalidRequest("top_logprobs needs logprobs: true", param="top_logprobs")
    max_tokens = req.max_completion_tokens or req.max_tokens
    params = generation_params(req, max_tokens=max_tokens, default_max=backend.context_length)
    params = params.replace(logprobs=bool(req.logprobs), top_logprobs=req.top_logprobs or 0)

    json_mode = False
    schema = response_schema(req.response_format)
    if schema is not None:
        if plan.forced:
            raise InvalidRequest(
                "response_format cannot be combined with a required tool call", param="response_format"
            )
        params = params.replace(json_schema=schema)
        json_mode = True
    if plan.forced:
        params = params.replace(json_schema=tooling.forced_schema(plan))
    check_constraints(params, backend)

    mode = req.mode or "instruct"
    template = instruction_template(backend, req.instruction_template) if mode != "chat" else None
    images: list[Any] = []
    messages = template_messages(req.messages, backend, template, images)
    if images and mode != "instruct":
        raise InvalidRequest("images need the instruct mode", param="messages")
    template_kwargs: dict[str, Any] = {}
    if plan.active:
        if tooling.template_knows_tools(template):
            template_kwargs["tools"] = (
                plan.tools if plan.mode != "named" else [t for t in plan.tools if t["function"]["name"] == plan.named]
            )
        else:
            messages = _with_system(messages, tooling.system_prompt(plan))
    system = "\n\n".join(m["content"] for m in messages if m["role"] == "system") or None
    history = [m for m in messages if m["role"] != "system"]
    if mode == "instruct":
        history = messages
        system = None
    if not history:
        raise InvalidRequest("messages must hold at least one non-system message", param="messages")
    continuing = bool(req.continue_final_message) and history[-1]["role"] == "assistant" and not plan.forced
    options = ChatOptions(
        mode=mode,
        character=req.character,
        user_name=req.user_name or "You",
        user_bio=(req.user_bio or "") + ("\n" + system if system else ""),
        instruction_template=req.instruction_template,
        continue_last=continuing,
        template_kwargs=template_kwargs,
    )
    if req.chat_instruct_command:
        options.chat_instruct_command = req.chat_instruct_command
    chat = build_chat_prompt(backend, history, options, params.max_new_tokens)
    if chat.stop:
        params = params.replace(stop=[*params.stop, *chat.stop])
    return ChatJob(
        prompt=chat.prompt,
        params=params,
        plan=plan,
        n=req.n,
        served_name=req.model or shared.model_name or "",
        reply_prefix="",
        json_mode=json_mode,
        images=images,
    )


def count_chat_tokens(req: ChatCompletionRequest, backend: Backend) -> int:
    """The prompt tokens a chat request would be given: rendered and tokenized as when it runs (hooks included).

    A prompt too long for the context is still counted.
    """
    job = prepare_chat(req, backend)
    try:
        prepared = prepare(job.prompt, job.params, backend, strict=True, is_chat=True, images=job.images or None)
    except ContextOverflow as exc:
        return exc.prompt_tokens
    close = getattr(prepared.custom, "close", None)
    if close is not None:  # an extension's reply that will never run
        close()
    return len(prepared.prompt_ids)


def _with_system(messages: list[dict[str, Any]], text: str) -> list[dict[str, Any]]:
    if messages and messages[0]["role"] == "system":
        first = dict(messages[0])
        first["content"] = f"{first['content']}\n\n{text}"
        return [first, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


# ------------------------------------------------------------------ running generations
@dataclass
class Item:
    """A delta from choice ``index`` (``error`` set when that generation failed mid-way)."""

    index: int
    delta: Delta | None = None
    error: BaseException | None = None


@dataclass
class Running:
    """Generations started together (``n`` choices): their event queue, delta builders and cancel events."""

    queue: asyncio.Queue[tuple[Any, TokenEvent | BaseException]]
    builders: list[DeltaBuilder] = field(default_factory=list)
    cancels: list[threading.Event] = field(default_factory=list)
    keys: list[str] = field(default_factory=list)

    def cancel(self) -> None:
        """Stop every generation and forget them (unfinished ones are logged as cancelled)."""
        for event in self.cancels:
            event.set()
        for builder in self.builders:
            if not builder.done:
                builder.finish("cancelled")
        for key in self.keys:
            shared.unregister_generation(key)


async def start(
    prompts: list[str | list[int]],
    params: list[GenerationParams],
    backend: Backend,
    *,
    chat: bool = False,
    images: list[Any] | None = None,
    owner: str = "api",
) -> Running:
    """Check and submit every generation now (so errors come back before any response is sent).

    The backend hands the events to this event loop directly, several per wake-up; no thread per request.
    Each generation is registered as ``OWNER/ID`` (``owner``: :func:`auth.caller_id`) so that
    ``/v1/internal/stop-generation`` can stop one caller's generations.
    """
    loop = asyncio.get_running_loop()
    running = Running(queue=asyncio.Queue())

    def submit() -> None:
        for index, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
            prepared = prepare(prompt, p, backend, strict=True, is_chat=chat, images=images or None)
            cancel = threading.Event()
            launch_to(prepared, backend, cancel, TokenSink(loop, running.queue, index))
            key = f"{owner}/{uuid.uuid4().hex}"
            shared.register_generation(key, cancel)
            running.cancels.append(cancel)
            running.keys.append(key)
            running.builders.append(DeltaBuilder(prepared))

    try:
        await anyio.to_thread.run_sync(submit)
    except BaseException:
        running.cancel()
        raise
    return running


async def start_chat(req: ChatCompletionRequest, request: Request, model: str | None) -> tuple[ChatJob, Running]:
    """Pick the backend, build the chat job and start its ``n`` generations (errors before any response)."""
    backend = await serving_backend(request, model)
    job = await anyio.to_thread.run_sync(prepare_chat, req, backend)
    running = await start(
        [job.prompt] * job.n,
        seeded(job.params, job.n),
        backend,
        chat=True,
        images=job.images,
        owner=caller_id(request),
    )
    return job, running


def seeded(params: GenerationParams, n: int) -> list[GenerationParams]:
    """One parameter set per choice: choice i uses seed + i, so a seeded request reproduces all choices."""
    if n == 1:
        return [params]
    base = params.resolved_seed()
    return [params.replace(seed=(base + i) % (2**31)) for i in range(n)]


DISCONNECT_CHECK_S = 0.25  # how often a non-streaming request looks for its client


async def merge(running: Running, request: Request | None = None) -> AsyncIterator[Item]:
    """Yield the deltas of every running generation as they come, interleaved: whatever has arrived when the
    consumer gets to it becomes one delta per choice (a speculative step brings several tokens at once, and one
    chunk costs a JSON encoding and a socket write however many tokens it carries).

    Leaving the loop (a streaming client that disconnects), or a non-streaming ``request`` whose client goes
    away, cancels them all within one step.
    """
    remaining = len(running.builders)
    checked = time.monotonic()
    try:
        while remaining:
            if request is None:
                tag, event = await running.queue.get()
            else:
                try:
                    tag, event = await asyncio.wait_for(running.queue.get(), timeout=DISCONNECT_CHECK_S)
                except TimeoutError:
                    tag, event = -1, None
                if time.monotonic() - checked >= DISCONNECT_CHECK_S:  # checked while tokens flow, too
                    checked = time.monotonic()
                    if await request.is_disconnected():
                        log.info("client disconnected; generation cancelled")
                        return
                if tag < 0:
                    continue
            if event is None:
                continue
            arrived = [(tag, event)]
            while not running.queue.empty():
                arrived.append(running.queue.get_nowait())
            deltas: dict[int, list[Delta]] = {}
            for tag, event in arrived:
                if running.builders[tag].done:
                    continue
                parts = deltas.setdefault(tag, [])
                failed = _feed(running, tag, event, parts)
                if failed is not None:  # this choice ends with an error; what every choice made before goes first
                    for earlier, made in deltas.items():
                        if made:
                            yield Item(earlier, _joined(made))
                    deltas = {}
                    remaining -= 1
                    yield failed
                elif running.builders[tag].done:  # finished (or a stop string ended it): free the slot
                    running.cancels[tag].set()
                    remaining -= 1
            for tag, parts in deltas.items():
                if parts:
                    yield Item(tag, _joined(parts))
    finally:
        running.cancel()


def _feed(running: Running, tag: int, event: TokenEvent | BaseException, out: list[Delta]) -> Item | None:
    """Feed one event to choice ``tag``'s builder, adding its deltas to ``out``; an error Item when it failed."""
    builder = running.builders[tag]
    if isinstance(event, BaseException):
        builder.done = True
        return Item(tag, error=event)
    try:
        out.extend(builder.feed(event))
    except Exception as exc:  # a bug building deltas ends this choice with an error event, not a cut stream
        log.exception("building a delta failed")
        builder.done = True
        running.cancels[tag].set()
        return Item(tag, error=exc)
    return None


def _joined(parts: list[Delta]) -> Delta:
    """Consecutive deltas of one choice as one: their text, their tokens, the last one's stats."""
    if len(parts) == 1:
        return parts[0]
    return Delta("".join(d.text for d in parts), [t for d in parts for t in d.tokens], parts[-1].stats)


def usage(stats: list[GenerationStats]) -> dict[str, int]:
    """OpenAI usage: the prompt counted once, completions summed over choices."""
    prompt = stats[0].prompt_tokens if stats else 0
    completion = sum(s.new_tokens for s in stats)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def record(endpoint: str, stats: list[GenerationStats], started: float, prompt_tokens: int | None = None) -> None:
    """Count a finished request in the metrics (``prompt_tokens``: when its choices read several prompts)."""
    METRICS.observe_generation(endpoint, stats, time.perf_counter() - started, prompt_tokens)


def finish_reason(stats: GenerationStats | None, calls: bool = False) -> str:
    """OpenAI's finish_reason for our stats."""
    if calls:
        return "tool_calls"
    if stats is None:
        return "stop"
    return {"length": "length", "context": "length"}.get(stats.finish_reason, "stop")


def piece_text(data: bytes) -> str:
    """A token's text for logprob listings (invalid UTF-8 shown with replacement characters)."""
    return data.decode("utf-8", errors="replace")


@dataclass
class ChatEvent:
    """A simplified event of a single-choice chat: text, a complete tool call, or the end."""

    kind: str  # "text" | "call" | "done" | "error"
    text: str = ""
    call: tooling.ToolCall | None = None
    stats: GenerationStats | None = None
    error: BaseException | None = None


async def chat_events(job: ChatJob, running: Running, request: Request | None = None) -> AsyncIterator[ChatEvent]:
    """The events of choice 0 of a chat job, with tool calls parsed out of the text."""
    watcher = tooling.ToolStream(job.plan) if job.plan.active else None
    async for item in merge(running, request):
        if item.error is not None:
            yield ChatEvent("error", error=item.error)
            return
        assert item.delta is not None
        text, calls = watcher.feed(item.delta.text) if watcher else (item.delta.text, [])
        if item.delta.stats is not None and watcher is not None:
            tail, more = watcher.finish()
            text, calls = text + tail, calls + more
        if text:
            yield ChatEvent("text", text=text)
        for call in calls:
            yield ChatEvent("call", call=call)
        if item.delta.stats is not None:
            yield ChatEvent("done", stats=item.delta.stats)
