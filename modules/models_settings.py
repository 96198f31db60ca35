"""Per-model settings: metadata defaults < user_data/models_settings.yaml (regex keys) < the model's textgen.yaml.

Values given on the command line or in the environment still win, and the load call's own overrides
(Model tab, ``/v1/internal/model/load`` args) win over everything.

The security settings (:data:`modules.settings.SECURITY_KEYS`: ``trust_remote_code``, ``remote_url``, keys, paths,
the listen address, auth, extensions, ...) are never taken from a model folder or models_settings.yaml: such a
value is logged and ignored. An API load request that names one is refused (:func:`check_request_overrides`).
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from modules import shared
from modules.errors import InvalidRequest, ModelLoadError
from modules.loaders.base import ModelMetadata
from modules.settings import SECURITY_KEYS, Settings, SettingsError, read_yaml

log = logging.getLogger(__name__)

DEFAULT_CTX_CAP = 4096
MODEL_YAML = "textgen.yaml"
# Keys allowed in per-model settings that are not server settings.
MODEL_ONLY_KEYS = ("instruction_template", "chat_template", "preset", "sampling", "system_message")


@dataclass
class ModelSettings:
    """The options a backend is loaded with, and where non-default ones came from."""

    loader: str | None = None
    options: dict[str, Any] = field(default_factory=dict)  # Settings fields -> values
    extra: dict[str, Any] = field(default_factory=dict)  # instruction_template, preset, ...
    sources: dict[str, str] = field(default_factory=dict)  # option -> "metadata" | file name | "flag" | "load"


def metadata_defaults(meta: ModelMetadata) -> dict[str, Any]:
    """Defaults the model's own metadata implies."""
    values: dict[str, Any] = {}
    if meta.context_length:
        values["n_ctx"] = min(meta.context_length, DEFAULT_CTX_CAP)
    return values


def model_yaml_path(model_path: Path) -> Path:
    """Where a model's own settings live: ``FOLDER/textgen.yaml`` or ``NAME.textgen.yaml`` beside a file."""
    if model_path.is_dir():
        return model_path / MODEL_YAML
    if model_path.parent.resolve() != shared.models_dir().resolve():
        return model_path.parent / MODEL_YAML  # a GGUF in its own folder
    return model_path.with_name(model_path.stem + "." + MODEL_YAML)


def user_patterns(model_name: str) -> list[tuple[str, dict[str, Any]]]:
    """Entries of user_data/models_settings.yaml whose regex matches the model name, in file order."""
    path = shared.user_data_dir() / "models_settings.yaml"
    if not path.is_file():
        return []
    try:
        data = read_yaml(path)
    except SettingsError as exc:
        raise ModelLoadError(str(exc)) from exc
    matches = []
    for pattern, values in data.items():
        try:
            hit = re.search(str(pattern), model_name, flags=re.IGNORECASE)
        except re.error as exc:
            raise ModelLoadError(f"{path.name}: key {pattern!r} is not a valid regex: {exc}") from exc
        if hit and isinstance(values, dict):
            matches.append((str(pattern), values))
    return matches


def check_request_overrides(values: dict[str, Any] | None, where: str = "args") -> None:
    """Refuse a request's load settings that name a security setting (InvalidRequest, a 400 at the API)."""
    for key in values or {}:
        name = str(key).replace("-", "_")
        if name in SECURITY_KEYS:
            raise InvalidRequest(
                f"{where}.{key} cannot be set by a request: it is a security setting, set only on the command "
                "line, in the environment or in settings.yaml",
                param=f"{where}.{key}",
                code="setting_not_allowed",
            )


def _apply(result: ModelSettings, values: dict[str, Any], source: str, *, trusted: bool = False) -> None:
    """Apply one layer. Only a ``trusted`` layer (the load call's own overrides) may set a security setting."""
    for key, value in values.items():
        key = str(key).replace("-", "_")
        if key in SECURITY_KEYS and not trusted:
            log.warning(  # the value is not logged: it may be a key
                "%s: %s ignored: security settings are only read from the command line, the environment and "
                "settings.yaml",
                source,
                key,
            )
            continue
        if key == "loader":
            result.loader = str(value)
        elif key == "sampling":  # merged over the layers below, each key checked
            result.extra["sampling"] = {**result.extra.get("sampling", {}), **_sampling(value, source)}
            result.sources[key] = f"{result.sources[key]} < {source}" if key in result.sources else source
            continue
        elif key in Settings.model_fields:
            result.options[key] = value
        elif key in MODEL_ONLY_KEYS:
            result.extra[key] = value
        else:
            log.warning("%s: unknown per-model setting %r ignored", source, key)
            continue
        result.sources[key] = source


def _sampling(values: Any, source: str) -> dict[str, Any]:
    """The valid GenerationParams values of a recommended-sampling mapping; the rest is logged and dropped."""
    from modules.errors import InvalidRequest
    from modules.generation.params import GenerationParams

    kept: dict[str, Any] = {}
    for key, value in values.items() if isinstance(values, dict) else []:
        try:
            GenerationParams.from_dict({str(key): value})
        except (InvalidRequest, TypeError, ValueError) as exc:
            log.warning("%s: sampling %s=%r ignored: %s", source, key, value, exc)
            continue
        kept[str(key)] = value
    return kept


def resolve(
    model_name: str, model_path: Path, meta: ModelMetadata, overrides: dict[str, Any] | None = None
) -> ModelSettings:
    """The settings to load ``model_name`` with, after every layer of precedence."""
    result = ModelSettings(options=shared.settings.model_dump())
    if meta.sampling:
        _apply(result, {"sampling": meta.sampling}, "the model's metadata")
    for key, value in metadata_defaults(meta).items():
        if result.options.get(key) is None:
            result.options[key] = value
            result.sources[key] = "metadata"
    for pattern, values in user_patterns(model_name):
        _apply(result, values, f"models_settings.yaml [{pattern}]")
    own = model_yaml_path(model_path)
    if model_path.exists() and own.is_file():
        try:
            _apply(result, read_yaml(own), own.name)
        except SettingsError as exc:
            raise ModelLoadError(str(exc)) from exc
    for key in shared.explicit:
        if key == "loader" and shared.settings.loader:
            result.loader = shared.settings.loader
            result.sources["loader"] = "flag"
        elif key in result.options:
            result.options[key] = getattr(shared.settings, key)
            result.sources[key] = "flag"
    _apply(result, overrides or {}, "load", trusted=True)  # the caller (Model tab, API) checked them
    try:
        validated = Settings(**result.options)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        raise ModelLoadError(f"invalid settings for {model_name}: {problems}") from exc
    result.options = validated.model_dump()
    if result.options.get("n_ctx") is None:
        result.options["n_ctx"] = DEFAULT_CTX_CAP
    return result
