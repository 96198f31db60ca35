"""Server settings: one pydantic schema that is the source of the CLI flags, settings.yaml and env.

Precedence (lowest to highest): code defaults < ``user_data/settings.yaml`` (or ``--settings FILE``) <
environment (``TEXTGEN_<FIELD>``) < command line. Per-model settings sit between settings.yaml and the
explicit values: a value given on the command line or in the environment always wins.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

log = logging.getLogger(__name__)

DEFAULT_MODEL = "SmolLM2-135M-Instruct.Q4_1.gguf"
ENV_PREFIX = "TEXTGEN_"


class SettingsError(ValueError):
    """A settings file, environment variable or flag holds a value the schema refuses."""


class Settings(BaseModel):
    """Every server setting. Each field becomes ``--field-name`` on the command line."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    # --- model ---
    model: str | None = Field(
        DEFAULT_MODEL,
        description="Model to load at startup: a file or folder name under --model-dir. 'none' starts without one.",
    )
    loader: str | None = Field(
        None,
        description="Backend to load the model with (llama.cpp, transformers, exllamav2, exllamav3, remote). Default: detected from the format.",
    )
    auto: bool = Field(
        False,
        description="Load with this machine's plan (python -m modules.lifecycle recommend MODEL): loader, context, "
        "GPU layers, threads, batch, quantization, where nothing else sets them.",
    )
    model_dir: Path = Field(Path("models"), description="Folder holding the models.")
    lora_dir: Path = Field(Path("loras"), description="Folder holding the LoRA adapters.")
    user_data_dir: Path = Field(
        Path("user_data"), description="Folder holding presets, characters, templates, chat logs and settings.yaml."
    )
    n_ctx: int | None = Field(
        None, ge=16, description="Context length per sequence, in tokens. Default: the model's own, capped at 4096."
    )
    threads: int | None = Field(None, ge=1, description="CPU threads for generation. Default: physical cores.")
    threads_batch: int | None = Field(
        None, ge=1, description="CPU threads for prompt processing. Default: as --threads."
    )
    n_gpu_layers: int = Field(
        0, ge=-1, description="Layers to offload to the GPU (-1: all). Ignored without a GPU build."
    )
    n_batch: int = Field(512, ge=1, description="Largest number of prompt tokens fed to the model in one step.")
    parallel: int = Field(4, ge=1, le=64, description="Generations that can run at the same time (slots).")
    prompt_cache: bool = Field(
        True, description="Reuse a slot's KV cache for the longest common prompt prefix (--no-prompt-cache: off)."
    )
    flash_attn: bool | None = Field(
        None,
        description="llama.cpp: flash attention (--no-flash-attn: off). Default: on when layers run on a GPU, off on "
        "the CPU, where llama.cpp's flash attention is slower (2x per step at 900 tokens of context here).",
    )
    speculative: bool = Field(
        True,
        description="llama.cpp: speculative decoding. Each step also checks a guess of the next tokens (what followed "
        "the same words earlier in the prompt or reply, or --draft-model's guess) and keeps the ones the model "
        "confirms: the output is unchanged, copies and edits of given text come faster. Drafts shrink or stop when "
        "they do not pay (--no-speculative: off).",
    )
    draft_model: Path | None = Field(
        None,
        description="llama.cpp: a small GGUF of the same model family (same vocabulary) that drafts the tokens "
        "speculative decoding checks, instead of prompt lookup: a path, or a file or folder name under models/.",
    )
    draft_max: int = Field(16, ge=1, le=64, description="llama.cpp: most draft tokens per sequence and step.")
    draft_min: int = Field(
        0,
        ge=0,
        le=64,
        description="llama.cpp: fewest draft tokens per sequence and step whenever prompt lookup or the draft model "
        "has a guess, whatever the planner expects them to gain (0: the planner alone decides). For machines where "
        "its cost fit is wrong, and for testing the speculation path on any CPU; the output is unchanged.",
    )
    amx: bool = Field(
        False,
        description="llama.cpp: use the engine's AMX matrix path where the build has one (Intel Sapphire Rapids and "
        "newer). Off by default: it crashes on many such machines and VMs.",
    )
    max_queue: int = Field(
        64, ge=0, description="Requests that may wait for a free slot; beyond that the API answers 503."
    )
    # --- transformers ---
    dtype: str = Field("auto", description="transformers: weights dtype (auto, float32, bfloat16, float16).")
    load_in_8bit: bool = Field(False, description="transformers: load the weights in 8 bits with bitsandbytes.")
    load_in_4bit: bool = Field(False, description="transformers: load the weights in 4 bits with bitsandbytes.")
    compute_dtype: str = Field(
        "float32", description="transformers 4-bit: dtype of the computations (float32, bfloat16, float16)."
    )
    quant_type: str = Field("nf4", description="transformers 4-bit: quantization type (nf4 or fp4).")
    use_double_quant: bool = Field(False, description="transformers 4-bit: quantize the quantization constants too.")
    cpu: bool = Field(False, description="transformers: run on the CPU even when a GPU is present.")
    gpu_memory: list[str] = Field(
        default_factory=list,
        description="transformers: most memory to use on each GPU, e.g. 10GiB 8GiB (offloads the rest).",
    )
    cpu_memory: str | None = Field(None, description="transformers: most CPU memory for offloaded weights, e.g. 32GiB.")
    attn_implementation: Literal["eager", "sdpa", "flash_attention_2", "flash_attention_3", "flex_attention"] | None = (
        Field(
            None,
            description="transformers: attention kernel (sdpa, eager, flash_attention_2, ...). Only these built-in "
            "names: transformers also takes Hub kernel repos here, which download and run code.",
        )
    )
    trust_remote_code: bool = Field(
        False, description="transformers: run Python code shipped with a model (off: safer)."
    )
    # --- ExLlamaV2 / ExLlamaV3 ---
    gpu_split: str | None = Field(
        None, description="ExLlamaV2/V3: GiB per GPU, comma-separated (e.g. 20,24); default: automatic."
    )
    cache_8bit: bool = Field(False, description="ExLlamaV2/V3: 8-bit KV cache (as --cache-type q8).")
    cache_q4: bool = Field(False, description="ExLlamaV2/V3: 4-bit KV cache (as --cache-type q4).")
    cache_type: str | None = Field(
        None,
        description="ExLlamaV2/V3: KV cache type: fp16, q8, q6 or q4; ExLlamaV3 also takes 2..8 bits as key,value "
        "(e.g. 4,6). Default: fp16.",
    )
    cache_size: int | None = Field(
        None,
        ge=256,
        description="ExLlamaV2/V3: tokens the KV cache holds for all running generations together. "
        "Default: --max-seq-len times --parallel.",
    )
    max_seq_len: int | None = Field(
        None,
        ge=256,
        description="ExLlamaV2/V3: context length per sequence, rounded down to a multiple of 256. "
        "Default: the model's, capped at 4096.",
    )
    # --- remote engine ---
    remote_url: str | None = Field(
        None, description="remote: base URL of an OpenAI-compatible engine (vLLM, llama-server, textgen)."
    )
    remote_api_key: str | None = Field(None, description="remote: API key for that engine.")
    # --- vLLM, started by textgen ---
    vllm_python: Path = Field(
        Path(".venv-vllm/bin/python"),
        description="vllm: the Python of the venv vLLM is installed in (`make vllm` makes .venv-vllm).",
    )
    vllm_args: str = Field(
        "",
        description="vllm: more flags for the engine, as on its command line (e.g. '--max-num-seqs 64 "
        "--tensor-parallel-size 2').",
    )
    vllm_kv_cache_gb: float | None = Field(
        None,
        gt=0,
        description="vllm: memory for the engine's KV cache in GiB (VLLM_CPU_KVCACHE_SPACE on a CPU). "
        "Default: what --n-ctx for --parallel chats needs, at least 1 GiB.",
    )
    vllm_start_timeout: int = Field(
        900, ge=10, description="vllm: seconds the engine may take to start (about 100 on 2 CPU cores)."
    )
    vllm_restarts: int = Field(
        2, ge=0, le=10, description="vllm: how often an engine that died is started again before textgen gives up."
    )
    # --- server ---
    listen: bool = Field(False, description="Listen on all interfaces (0.0.0.0) instead of 127.0.0.1.")
    listen_host: str | None = Field(None, description="Host name or address to listen on (overrides --listen).")
    listen_port: int = Field(7860, ge=1, le=65535, description="Port of the web UI and the API.")
    nowebui: bool = Field(False, description="Serve the API only, without the web UI.")
    api: bool = Field(True, description="Serve the OpenAI-compatible API (the 'openai' extension); --no-api: off.")
    api_port: int | None = Field(
        None,
        ge=1,
        le=65535,
        description="Also serve the API (and the UI) on this port, e.g. 5000 as text-generation-webui.",
    )
    api_key: str | None = Field(None, description="Require this key (Bearer or x-api-key) on the API.")
    admin_key: str | None = Field(
        None,
        description="Key for the admin API endpoints (model and LoRA load/unload, downloads, switching models through "
        "a request's model field, the image pipeline). It does not default to --api-key: with --api-key and no "
        "--admin-key the admin endpoints answer 403. Without any key the API is open.",
    )
    allowed_hosts: list[str] = Field(
        default_factory=list,
        description="Host names the server may be reached by, besides IP addresses, localhost, *.localhost and "
        "--listen-host (a guard against DNS rebinding: a request for another name is answered 403). For a reverse "
        "proxy or a LAN name, e.g. --allowed-hosts textgen.lan; .example.org allows every name under it; * any.",
    )
    api_cors_origins: list[str] = Field(
        default_factory=list, description="Origins allowed to call the API from a browser (CORS). Default: none."
    )
    extensions: list[str] = Field(
        default_factory=list,
        description="Extensions to load at startup (folder names), besides the API ('openai', see --api).",
    )
    allow_remote_images: bool = Field(
        False,
        description="Let API clients send images as http(s) URLs for the server to fetch (public addresses only, "
        "20 MiB, 15 s, 3 redirects at most). Off: only data URLs are accepted, so a client cannot make the server "
        "connect anywhere.",
    )
    max_request_mb: float = Field(
        32,
        gt=0,
        description="Largest API request body in MiB; a bigger one is answered 413 before it is read "
        "(the web UI's uploads are not affected).",
    )
    max_upload_mb: float = Field(
        100,
        gt=0,
        description="Largest file the web UI accepts in one upload (chat pictures, histories, characters, "
        "notebooks), in MiB; a bigger one is refused with a message before it is stored.",
    )
    gradio_auth: str | None = Field(None, description="Web UI logins as 'user:password' pairs separated by commas.")
    gradio_auth_path: Path | None = Field(None, description="File with one 'user:password' per line, for the web UI.")
    gradio_admin: list[str] = Field(
        default_factory=list,
        description="Web UI users (from --gradio-auth) who may load models and LoRAs, download, export, train, switch "
        "extensions and save settings; the other users can only chat and generate. Without --gradio-auth the local "
        "user is the admin.",
    )
    multi_user: bool = Field(False, description="Each signed-in user sees only their own chat histories.")
    enable_code_execution: bool = Field(
        False,
        description="Let the Code notebook run Python cells in a Jupyter kernel per browser session. The kernel runs "
        "any code with the server's rights (no sandbox): turn on only where every user may run programs here.",
    )
    verbose: bool = Field(False, description="Log debug messages, including every prompt.")

    @field_validator("dtype", "compute_dtype")
    @classmethod
    def _dtype(cls, value: str) -> str:
        value = value.lower()
        if value not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError("must be auto, float32, bfloat16 or float16")
        return value

    @field_validator("quant_type")
    @classmethod
    def _quant_type(cls, value: str) -> str:
        if value.lower() not in ("nf4", "fp4"):
            raise ValueError("must be nf4 or fp4")
        return value.lower()

    @field_validator("loader")
    @classmethod
    def _lower_loader(cls, value: str | None) -> str | None:
        return value.lower() if value else value

    def startup_extensions(self) -> list[str]:
        """The extensions to load: the API first (unless --no-api), then --extensions in order, once each."""
        names = (["openai"] if self.api else []) + [e for e in self.extensions if e != "openai" or self.api]
        return list(dict.fromkeys(names))

    @property
    def host(self) -> str:
        """The address uvicorn binds to."""
        if self.listen_host:
            return self.listen_host
        return "0.0.0.0" if self.listen else "127.0.0.1"

    @property
    def exposed(self) -> bool:
        """True when the server listens beyond this machine (--listen or a non-loopback --listen-host)."""
        import ipaddress

        host = self.host.strip("[]")
        if host.lower() == "localhost":
            return False
        try:
            return not ipaddress.ip_address(host).is_loopback
        except ValueError:
            return True  # a host name: assume others can reach it

    def auth_pairs(self) -> list[tuple[str, str]]:
        """Web UI credentials from --gradio-auth and --gradio-auth-path."""
        text = self.gradio_auth or ""
        if self.gradio_auth_path:
            text += "," + self.gradio_auth_path.read_text(encoding="utf-8").replace("\n", ",")
        pairs = []
        for item in text.split(","):
            item = item.strip()
            if not item:
                continue
            user, sep, password = item.partition(":")
            if not sep or not user:
                raise SettingsError(f"gradio auth entry {item!r} is not 'user:password'")
            pairs.append((user.strip(), password.strip()))
        return pairs


@dataclass
class LoadedSettings:
    """The settings plus where each value came from."""

    settings: Settings
    explicit: frozenset[str] = frozenset()  # fields given on the command line or in the environment
    extension_params: dict[str, dict[str, Any]] = field(default_factory=dict)  # from 'name-key' yaml entries
    extra: dict[str, Any] = field(default_factory=dict)  # other settings.yaml keys (UI defaults)
    settings_file: Path | None = None
    notes: list[str] = field(default_factory=list)  # text-generation-webui flags renamed or ignored, to be logged


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _flags(name: str) -> list[str]:
    """``--n-ctx`` and, as text-generation-webui spells many, ``--n_ctx``."""
    return [_flag(name), "--" + name] if "_" in name else [_flag(name)]


def _base_type(annotation: Any) -> tuple[Any, bool]:
    """(inner type, is_list) for an annotation like ``int | None`` or ``list[str]``."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return _base_type(args[0])
    if origin in (list, Sequence):
        return typing.get_args(annotation)[0], True
    return annotation, False


# Settings that decide what code runs, where data goes or who may connect. Only the command line, the environment and
# settings.yaml set them: a model folder's textgen.yaml, user_data/models_settings.yaml and an API load request's
# ``args`` cannot (modules/models_settings.py). Besides these names: every Path-typed field, every ``*_key``,
# ``*_dir`` and ``*_path``, and every ``allow_*``, ``enable_*`` and ``gradio_*`` field, present and future.
_SECURITY_NAMES = (
    "trust_remote_code",
    "remote_url",
    "vllm_args",
    "listen",
    "listen_host",
    "listen_port",
    "api",
    "api_port",
    "nowebui",
    "api_cors_origins",
    "extensions",
    "multi_user",
    "verbose",
    "max_request_mb",
    "max_upload_mb",
)


def _is_security_field(name: str) -> bool:
    inner, _ = _base_type(Settings.model_fields[name].annotation)
    return (
        name in _SECURITY_NAMES
        or inner is Path
        or name.endswith(("_key", "_dir", "_path"))
        or name.startswith(("allow_", "enable_", "gradio_"))
    )


SECURITY_KEYS: frozenset[str] = frozenset(n for n in Settings.model_fields if _is_security_field(n))


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser generated from :class:`Settings`; unset flags are absent from the result."""
    parser = argparse.ArgumentParser(
        prog="server.py",
        description="textgen: a local LLM workbench (web UI and OpenAI-compatible API).",
        argument_default=argparse.SUPPRESS,
    )
    parser.add_argument("--settings", type=Path, help="Settings file to read instead of user_data/settings.yaml.")
    for name, info in Settings.model_fields.items():
        inner, is_list = _base_type(info.annotation)
        help_text = info.description or ""
        default = info.get_default(call_default_factory=True)
        if default not in (None, [], False):
            help_text += f" (default: {' '.join(map(str, default)) if isinstance(default, list) else default})"
        if inner is bool:
            parser.add_argument(*_flags(name), action=argparse.BooleanOptionalAction, help=help_text)
        elif is_list:
            parser.add_argument(*_flags(name), nargs="*", metavar=name.upper(), help=help_text)
        else:
            kind = {int: int, float: float, Path: Path}.get(inner, str)
            parser.add_argument(*_flags(name), type=kind, metavar=name.upper(), help=help_text)
    return parser


def _env_values(env: Mapping[str, str]) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for name, info in Settings.model_fields.items():
        raw = env.get(ENV_PREFIX + name.upper())
        if raw is None:
            continue
        inner, is_list = _base_type(info.annotation)
        if is_list:
            values[name] = [v for v in raw.replace(",", " ").split() if v]
        elif inner is bool:
            values[name] = raw.strip().lower() in ("1", "true", "yes", "on")
        else:
            values[name] = raw
    return values


def read_yaml(path: Path) -> dict[str, Any]:
    """Read a YAML mapping; an empty file is an empty mapping."""
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        raise SettingsError(f"{path}: not valid YAML: {exc}") from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise SettingsError(f"{path}: expected a mapping of setting names to values")
    return data


def _split_yaml(data: dict[str, Any], path: Path) -> tuple[dict[str, Any], dict[str, dict[str, Any]], dict[str, Any]]:
    """Split settings.yaml into schema fields, extension params ('name-key') and other keys."""
    fields: dict[str, Any] = {}
    ext: dict[str, dict[str, Any]] = {}
    extra: dict[str, Any] = {}
    for key, value in data.items():
        key = str(key)
        norm = key.replace("-", "_")
        if norm in Settings.model_fields:
            fields[norm] = value
        elif "-" in key:
            ext_name, _, param = key.partition("-")
            ext.setdefault(ext_name, {})[param] = value
        else:
            extra[key] = value
    return fields, ext, extra


def _validate(values: dict[str, Any], source: str) -> Settings:
    try:
        return Settings(**values)
    except ValidationError as exc:
        problems = "; ".join(
            f"{_flag(str(err['loc'][0])) if err['loc'] else source}: {err['msg']}" for err in exc.errors()
        )
        raise SettingsError(f"invalid settings ({source}): {problems}") from exc


def load_settings(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> LoadedSettings:
    """Merge defaults, the settings file, the environment and the command line, in that order."""
    from modules import tgw_compat

    env = os.environ if env is None else env
    given = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    first = vars(parser.parse_known_args(tgw_compat.translate(given)[0])[0])  # where user_data is
    user_data = Path(first.get("user_data_dir") or env.get(ENV_PREFIX + "USER_DATA_DIR") or "user_data")
    from_file = tgw_compat.cmd_flags(user_data)
    args, notes = tgw_compat.translate([*from_file, *given])  # the command line wins over CMD_FLAGS.txt
    if from_file:
        notes.insert(0, f"read {tgw_compat.redacted(from_file)} from {user_data / tgw_compat.CMD_FLAGS}")
    cli = vars(parser.parse_args(args))
    settings_file = cli.pop("settings", None)
    user_data = Path(cli.get("user_data_dir") or env.get(ENV_PREFIX + "USER_DATA_DIR") or "user_data")
    if settings_file is None and (user_data / "settings.yaml").is_file():
        settings_file = user_data / "settings.yaml"
    elif settings_file is not None and not Path(settings_file).is_file():
        raise SettingsError(f"settings file {settings_file} does not exist")

    file_fields: dict[str, Any] = {}
    ext_params: dict[str, dict[str, Any]] = {}
    extra: dict[str, Any] = {}
    if settings_file is not None:
        file_fields, ext_params, extra = _split_yaml(read_yaml(Path(settings_file)), Path(settings_file))
        _validate(file_fields, str(settings_file))
    env_fields = _env_values(env)
    _validate({**file_fields, **env_fields}, "environment")
    merged = {**file_fields, **env_fields, **cli}
    settings = _validate(merged, "command line")
    return LoadedSettings(
        settings=settings,
        explicit=frozenset(env_fields) | frozenset(cli),
        extension_params=ext_params,
        extra=extra,
        settings_file=Path(settings_file) if settings_file else None,
        notes=notes,
    )
