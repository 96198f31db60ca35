"""text-generation-webui's command line: its flags mapped onto ours, and its ``user_data/CMD_FLAGS.txt``.

People bring launch lines like ``python server.py --api --listen --api-port 5000 --n_ctx 2048``. Every one of our
flags is also accepted with underscores (``--n_ctx``, ``--load_in_4bit``); this module renames the flags whose
names differ, drops the ones that mean nothing here (each with a note saying why), and reads CMD_FLAGS.txt.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from pathlib import Path

CMD_FLAGS = "CMD_FLAGS.txt"

# their flag -> ours (with its arguments kept)
RENAMED = {
    "--ctx-size": "--n-ctx",
    "--gpu-layers": "--n-gpu-layers",
    "--batch-size": "--n-batch",
    "--cache_4bit": "--cache-q4",
    "--cache-4bit": "--cache-q4",
    "--use_flash_attention_2": "--attn-implementation=flash_attention_2",
    "--sdpa": "--attn-implementation=sdpa",
    "--bf16": "--dtype=bfloat16",
    "--gpu_split": "--gpu-split",
    "--no_flash_attn": "--no-flash-attn",
}
# switches that need no counterpart, and why
SWITCHES = {
    "--api": "the API is on by default (--no-api turns it off)",
    "--auto-devices": "weights are placed on the devices automatically",
    "--share": "no public share links: textgen works offline (use --listen for your network)",
    "--auto-launch": "open the printed address in your browser",
    "--public-api": "no public tunnels: textgen works offline",
    "--model-menu": "pick a model in the Model tab",
    "--no-mmap": "llama.cpp memory-maps weights as it sees fit here",
    "--mlock": "not supported; the weights stay wherever the OS keeps them",
    "--no-cache": "the KV cache is always on",
    "--streaming-llm": "not supported; long chats drop their oldest turns",
    "--xformers": "use --attn-implementation sdpa",
    "--api-enable-ipv6": "use --listen-host ::",
    "--chat-buttons": "the chat always has its buttons",
    "--no-stream": "the UI always streams; API clients choose",
    "--numa": "not supported",
    "--cpu-moe": "not supported",
    "--disk": "disk offload is not supported; use --cpu-memory",
}
# flags that take values and have no counterpart
WITH_VALUES = {
    "--lora": "apply adapters in the Model tab or with POST /v1/internal/lora/load",
    "--character": "pick the character in the chat's Character panel",
    "--idle-timeout": "models stay loaded until you unload them",
    "--tensor_split": "use --gpu-split (ExLlamaV2) or --gpu-memory (transformers)",
    "--tensor-split": "use --gpu-split (ExLlamaV2) or --gpu-memory (transformers)",
    "--rope_freq_base": "the model's own RoPE base is used",
    "--compress_pos_emb": "the model's own RoPE scaling is used",
    "--alpha_value": "the model's own RoPE scaling is used",
    "--subpath": "serve behind a reverse proxy that strips the path",
    "--ssl-keyfile": "put a TLS-terminating reverse proxy in front",
    "--ssl-certfile": "put a TLS-terminating reverse proxy in front",
    "--disk-cache-dir": "not used",
    "--n-cpu-moe": "not supported",
}
MEMORY_FLAGS = ("--gpu-memory", "--gpu_memory", "--cpu-memory", "--cpu_memory")  # bare numbers are GiB there


def cmd_flags(user_data: Path) -> list[str]:
    """The flags in ``user_data/CMD_FLAGS.txt`` (``#`` starts a comment), or none."""
    path = user_data / CMD_FLAGS
    if not path.is_file():
        return []
    flags: list[str] = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        try:
            flags += shlex.split(line.split("#", 1)[0])
        except ValueError as exc:
            from modules.settings import SettingsError

            raise SettingsError(f"{path}, line {number}: {exc}") from exc
    return flags


SECRET_FLAG_ENDINGS = ("-key", "_key", "-token", "_token", "-auth", "_auth", "-password", "_password")


def redacted(args: Sequence[str]) -> str:
    """``args`` for a log line, with the values of secret flags (keys, tokens, --gradio-auth) shown as ``***``."""
    shown: list[str] = []
    hide = False
    for arg in args:
        if arg.startswith("--"):
            name, eq, _ = arg.partition("=")
            secret = name.endswith(SECRET_FLAG_ENDINGS)
            shown.append(f"{name}=***" if eq and secret else arg)
            hide = secret and not eq
        else:
            shown.append("***" if hide else arg)
    return " ".join(shown)


def _takes_values(args: Sequence[str], i: int) -> int:
    """How many values follow the flag at ``i`` (up to the next flag)."""
    n = 0
    while i + 1 + n < len(args) and not args[i + 1 + n].startswith("--"):
        n += 1
    return n


def translate(args: Sequence[str]) -> tuple[list[str], list[str]]:
    """(our argv, notes about flags that were renamed or mean nothing here)."""
    out: list[str] = []
    notes: list[str] = []
    i = 0
    while i < len(args):
        arg = args[i]
        flag, eq, value = arg.partition("=")
        if flag in SWITCHES:
            notes.append(f"{flag}: ignored, {SWITCHES[flag]}")
        elif flag in WITH_VALUES:
            skip = 0 if eq else _takes_values(args, i)
            notes.append(f"{flag}: ignored, {WITH_VALUES[flag]}")
            i += skip
        elif flag in RENAMED:
            ours = RENAMED[flag]
            notes.append(f"{flag} is {ours.replace('=', ' ')} here")
            out.append(ours + (f"={value}" if eq and "=" not in ours else ""))
        elif flag in MEMORY_FLAGS:
            values = [value] if eq else list(args[i + 1 : i + 1 + _takes_values(args, i)])
            i += 0 if eq else len(values)
            out += [flag, *(v + "GiB" if v.replace(".", "", 1).isdigit() else v for v in values)]
        else:
            out.append(arg)
        i += 1
    return out, notes
