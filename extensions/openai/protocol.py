"""Request models of the OpenAI-compatible API (pydantic), fields in OpenAI's order, textgen extras fenced off.

Every sampler of GenerationParams is also accepted as an extra field (``top_k``, ``min_p``, ``dry_multiplier``...);
those fields are generated from the dataclass, so adding a sampler adds it here too.
"""

from __future__ import annotations

import json
import logging
import typing
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, create_model, field_validator, model_validator

from modules.errors import InvalidRequest
from modules.generation.params import GenerationParams

log = logging.getLogger(__name__)
_logged_unknown: set[str] = set()

# GenerationParams fields that OpenAI requests carry under their own names and shapes.
OPENAI_SHAPED = {
    "temperature", "top_p", "seed", "stop", "presence_penalty", "frequency_penalty", "logit_bias",
    "logprobs", "top_logprobs", "max_new_tokens", "json_schema",
}  # fmt: skip


class _Base(BaseModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True)

    def log_unknown_fields(self, endpoint: str) -> None:
        """Unknown fields are accepted; each one is logged once per endpoint."""
        for name in self.model_extra or {}:
            key = f"{endpoint}:{name}"
            if key not in _logged_unknown:
                _logged_unknown.add(key)
                log.info("%s: unknown field %r accepted and not used", endpoint, name)


def _sampler_fields() -> dict[str, Any]:
    hints = typing.get_type_hints(GenerationParams)
    fields: dict[str, Any] = {}
    for name, f in GenerationParams.field_info().items():
        if name in OPENAI_SHAPED:
            continue
        fields[name] = (hints[name] | None, Field(None, description=f.metadata["doc"]))
    return fields


SamplerExtras: type[_Base] = create_model("SamplerExtras", __base__=_Base, **_sampler_fields())  # type: ignore[call-overload]


def _breakers(value: str) -> Any:
    """DRY sequence breakers sent as one string: a JSON list, or text-generation-webui's ``"a", "b"`` form."""
    text = value.strip()
    for candidate in (text, f"[{text}]"):
        try:
            parsed = json.loads(candidate)
        except ValueError:
            continue
        if isinstance(parsed, list):
            return parsed
    return [value]


def _token_bans(value: Any) -> dict[str, float]:
    """text-generation-webui's ``custom_token_bans`` ("1, 2" or a list of ids) as logit_bias entries."""
    ids = value.split(",") if isinstance(value, str) else list(value or [])
    try:
        return {str(int(str(i).strip())): -100.0 for i in ids if str(i).strip()}
    except ValueError as exc:
        raise InvalidRequest(
            "custom_token_bans must be token ids separated by commas", param="custom_token_bans"
        ) from exc


def webui_names(data: Any) -> Any:
    """Map text-generation-webui's request names (which SillyTavern sends) onto ours."""
    if not isinstance(data, dict):
        return data
    data = dict(data)
    for theirs, ours in WEBUI_ALIASES.items():
        if theirs in data:
            value = data.pop(theirs)
            if data.get(ours) is None and value not in (None, ""):
                data[ours] = value
    if isinstance(data.get("dry_sequence_breakers"), str):
        data["dry_sequence_breakers"] = _breakers(data["dry_sequence_breakers"])
    if "custom_token_bans" in data:
        bans = _token_bans(data.pop("custom_token_bans"))
        if bans:
            data["logit_bias"] = {**bans, **(data.get("logit_bias") or {})}
    return data


# text-generation-webui's names for fields we call otherwise (the value goes to ours unless ours is also set).
WEBUI_ALIASES = {"ban_eos_token": "ban_eos", "grammar_string": "grammar", "stopping_strings": "stop"}


class TextgenExtras(SamplerExtras):  # type: ignore[misc,valid-type]
    """textgen's own request fields (text-generation-webui's names are accepted too, see ``webui_names``)."""

    _webui = model_validator(mode="before")(webui_names)

    preset: str | None = Field(None, description="Start from this preset in user_data/presets.")
    mode: Literal["instruct", "chat", "chat-instruct"] | None = Field(None, description="Chat prompt mode.")
    character: str | None = Field(None, description="Character (chat modes) from user_data/characters.")
    instruction_template: str | None = Field(None, description="Instruction template from user_data.")
    user_name: str | None = Field(None, description="The user's name in chat modes.")
    user_bio: str | None = Field(None, description="The user persona in chat modes.")
    chat_instruct_command: str | None = Field(None, description="Command wrapping the chat in chat-instruct mode.")
    grammar: str | None = Field(None, description="GBNF grammar the output must follow.")

    def refuse_chat_fields(self) -> None:
        """Raise a 400 naming the first chat-only field set on a request that builds no chat prompt."""
        for name in CHAT_ONLY:
            if getattr(self, name, None) is not None:
                raise InvalidRequest(
                    f"{name} applies to chat requests only; this endpoint takes a raw prompt", param=name
                )


# TextgenExtras fields that shape a chat prompt; a raw completion refuses them.
CHAT_ONLY = ("mode", "character", "instruction_template", "user_name", "user_bio", "chat_instruct_command")


class StreamOptions(_Base):
    include_usage: bool = False


class JSONSchemaFormat(_Base):
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Base):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None
    # llama-cpp-python's and Together's form: {"type": "json_object", "schema": {...}} (honoured like json_schema)
    schema_: dict[str, Any] | None = Field(None, alias="schema")


class FunctionDefinition(_Base):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Base):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class ChatMessage(_Base):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


class ChatCompletionRequest(TextgenExtras):
    """POST /v1/chat/completions"""

    messages: list[ChatMessage] = Field(min_length=1)
    model: str | None = None
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    n: int = Field(1, ge=1, le=16)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    response_format: ResponseFormat | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, ge=0, le=1)
    tools: list[Tool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    user: str | None = None
    continue_final_message: bool | None = Field(
        None, description="Continue the last assistant message instead of starting a new one (as vLLM)."
    )
    # deprecated OpenAI names, mapped onto tools / tool_choice
    functions: list[FunctionDefinition] | None = None
    function_call: str | dict[str, Any] | None = None

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, value: str | list[str] | None) -> str | list[str] | None:
        if isinstance(value, list) and len(value) > 16:
            raise ValueError("at most 16 stop strings")
        return value


class CompletionRequest(TextgenExtras):
    """POST /v1/completions (legacy)"""

    model: str | None = None
    prompt: str | list[str] | list[int] | list[list[int]] = ""
    best_of: int | None = Field(None, ge=1, le=16)
    echo: bool = False
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    logprobs: int | None = Field(None, ge=0, le=20)
    max_tokens: int | None = Field(16, ge=0)
    n: int = Field(1, ge=1, le=16)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    suffix: str | None = None
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, ge=0, le=1)
    user: str | None = None


class EmbeddingRequest(_Base):
    """POST /v1/embeddings"""

    input: str | list[str] | list[int] | list[list[int]]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    user: str | None = None
