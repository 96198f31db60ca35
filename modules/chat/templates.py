"""Chat templates: render the model's own jinja2 template in a sandbox, with a fallback and user templates.

Instruction templates in ``user_data/instruction-templates/NAME.yaml`` use text-generation-webui's format:
a mapping with an ``instruction_template`` key holding the jinja2 source.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from modules import shared
from modules.errors import InvalidRequest
from modules.paths import UnsafePath, safe_child
from modules.settings import SettingsError, read_yaml

# Used when the model carries no template of its own (ChatML, the most widely trained format).
FALLBACK_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
FALLBACK_NAME = "ChatML"


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False, sort_keys: bool = False) -> str:
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=1)
def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


@lru_cache(maxsize=32)
def _compile(source: str) -> jinja2.Template:
    try:
        return _environment().from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise InvalidRequest(f"chat template has a syntax error (line {exc.lineno}): {exc.message}") from exc


def render(
    template: str | None,
    messages: list[dict[str, Any]],
    *,
    add_generation_prompt: bool = True,
    bos_token: str = "",
    eos_token: str = "",
    tools: list[dict[str, Any]] | None = None,
    **extra: Any,
) -> str:
    """Render ``messages`` with ``template`` (the fallback when None) the way the model was trained."""
    compiled = _compile(template or FALLBACK_TEMPLATE)
    context: dict[str, Any] = {
        "messages": messages,
        "add_generation_prompt": add_generation_prompt,
        "bos_token": bos_token,
        "eos_token": eos_token,
        **extra,
    }
    if tools:
        context["tools"] = tools
    try:
        return compiled.render(**context)
    except jinja2.exceptions.SecurityError as exc:
        raise InvalidRequest(f"chat template refused by the sandbox: {exc}") from exc
    except jinja2.exceptions.TemplateError as exc:
        raise InvalidRequest(f"chat template error: {exc}", param="messages") from exc


def templates_dir() -> Any:
    """The folder of user instruction templates."""
    return shared.user_data_dir() / "instruction-templates"


def list_instruction_templates() -> list[str]:
    """Names of the instruction templates in user_data."""
    folder = templates_dir()
    if not folder.is_dir():
        return []
    return sorted((p.stem for p in folder.glob("*.yaml")), key=str.lower)


def load_instruction_template(name: str) -> str:
    """The jinja2 source of a user instruction template."""
    try:
        path = safe_child(templates_dir(), f"{name}.yaml")
    except UnsafePath as exc:
        raise InvalidRequest(f"invalid instruction template name: {exc}", param="instruction_template") from exc
    if not path.is_file():
        raise InvalidRequest(
            f"instruction template {name!r} does not exist (have: {', '.join(list_instruction_templates()) or 'none'})",
            param="instruction_template",
        )
    try:
        data = read_yaml(path)
    except SettingsError as exc:
        raise InvalidRequest(str(exc), param="instruction_template") from exc
    source = data.get("instruction_template")
    if not isinstance(source, str) or not source.strip():
        raise InvalidRequest(f"{path.name} has no 'instruction_template' text", param="instruction_template")
    return source
