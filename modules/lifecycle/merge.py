"""Merge a PEFT LoRA into its base in 16 bit and save the result as safetensors with tokenizer and chat template.

A base that is quantized with bitsandbytes (4 or 8 bit, on disk or as a loaded model) is dequantized in place
first; it is never reloaded from anywhere else, so what is merged is exactly the base the LoRA was trained on.
The merged folder also records the adapter's training parameters (``textgen_merge.json``) for the model card.
The folder is written as ``.DIR.partial`` and renamed when complete.
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from modules import jobs
from modules.errors import InvalidRequest, TextgenError
from modules.lifecycle.convert import refuse_existing, refuse_overlap, staged_folder

MERGE_INFO = "textgen_merge.json"
TOKENIZER_FILES = ("chat_template.jinja", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


class MergeError(TextgenError):
    """The adapter does not fit the base, or the merge failed."""


@dataclass
class MergeArgs:
    """A base model and a LoRA adapter, merged into a new HF folder."""

    base: Path  # the base model's HF folder (may be saved bitsandbytes 4/8-bit)
    lora: Path  # the PEFT adapter folder
    output: Path  # the merged model's folder (must not exist, unless overwrite)
    dtype: str = "float16"  # float16 or bfloat16 (float32 also accepted)
    overwrite: bool = False


def _dtype(name: str) -> Any:
    import torch

    table = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
    if name not in table:
        raise InvalidRequest(f"dtype must be one of {', '.join(table)}, not {name!r}", "dtype")
    return table[name]


def is_quantized(model: Any) -> bool:
    """Whether a loaded transformers model holds bitsandbytes weights."""
    return getattr(model, "quantization_config", None) is not None or bool(getattr(model, "is_loaded_in_4bit", False))


def dequantized(model: Any, dtype: Any) -> Any:
    """The same model with bitsandbytes layers turned back into plain linear layers (in place)."""
    if is_quantized(model):
        model = model.dequantize()
        # the loading steps that unpacked the 4-bit weights cannot be reversed, and no longer apply when saving
        kept = []
        for conversion in getattr(model, "_weight_conversions", None) or []:
            try:
                conversion.reverse_transform()
            except NotImplementedError:
                continue
            kept.append(conversion)
        model._weight_conversions = kept
    return model.to(dtype)


def merge_loaded(model: Any, lora: Path, dtype: Any) -> Any:
    """Merge the adapter at ``lora`` into a loaded base model (dequantized first); returns the plain model."""
    from peft import PeftModel

    base = dequantized(model, dtype)
    try:
        peft_model = PeftModel.from_pretrained(base, str(lora), is_trainable=False)
    except (ValueError, KeyError, RuntimeError) as exc:
        raise MergeError(f"the adapter {Path(lora).name} does not fit this base model: {exc}") from exc
    merged = peft_model.merge_and_unload()
    return merged.to(dtype)


def merge(args: MergeArgs, report: jobs.Reporter, cancel: threading.Event) -> Path:
    """Merge ``args.lora`` into ``args.base`` and save to ``args.output``; returns the output folder."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base, lora, output = Path(args.base), Path(args.lora), Path(args.output)
    if not (base / "config.json").is_file():
        raise InvalidRequest(f"{base} is not a Hugging Face model folder (no config.json)", "base")
    if not (lora / "adapter_config.json").is_file():
        raise InvalidRequest(f"{lora} is not a PEFT adapter folder (no adapter_config.json)", "lora")
    refuse_overlap(output, base=base, lora=lora)
    refuse_existing(output, args.overwrite)
    dtype = _dtype(args.dtype)
    report(done=0, total=4, message="loading the base model")
    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32, local_files_only=True)
    jobs.check(cancel)
    report(done=1, total=4, message="merging the adapter" + (" (base dequantized)" if is_quantized(model) else ""))
    was_quantized = is_quantized(model)
    merged = merge_loaded(model, lora, dtype)
    if hasattr(merged.config, "quantization_config"):
        del merged.config.quantization_config
    jobs.check(cancel)
    report(done=2, total=4, message="saving safetensors")
    with staged_folder(output, cancel, args.overwrite) as tmp:
        merged.save_pretrained(str(tmp), safe_serialization=True)
        source = lora if (lora / "tokenizer_config.json").is_file() else base
        AutoTokenizer.from_pretrained(str(source), local_files_only=True).save_pretrained(str(tmp))
        for name in TOKENIZER_FILES:  # the chat template exactly as the user had it
            if (source / name).is_file() and not (tmp / name).is_file():
                shutil.copy2(source / name, tmp / name)
        (tmp / MERGE_INFO).write_text(json.dumps(merge_info(base, lora, args.dtype, was_quantized), indent=2))
        jobs.check(cancel)
        report(done=3, total=4, message="finishing")
    report(done=4, total=4, message=f"merged into {output.name}")
    return output


def public_name(value: Any) -> Any:
    """What may leave this machine for a local path: its last part (``/home/me/data/chat.jsonl`` -> ``chat.jsonl``);
    a Hub id (``ORG/NAME`` that is no folder here) stays as it is; other values unchanged, lists and dicts inside."""
    if isinstance(value, dict):
        return {k: public_name(v) for k, v in value.items()}
    if isinstance(value, list):
        return [public_name(v) for v in value]
    if not isinstance(value, str) or not value:
        return value
    hub_id = bool(re.fullmatch(r"[\w.-]+/[\w.-]+", value)) and not Path(value).exists()
    if hub_id or ("/" not in value and "\\" not in value and not Path(value).exists()):
        return value
    return Path(value.replace("\\", "/")).name


def merge_info(base: Path, lora: Path, dtype: str, was_quantized: bool) -> dict[str, Any]:
    """What the model card says about the merge: base, adapter, its LoRA settings and training parameters; names
    and Hub ids only, never a path of this machine (the file is uploaded with the model)."""
    config = json.loads((lora / "adapter_config.json").read_text())
    info: dict[str, Any] = {
        "base_model": public_name(config.get("base_model_name_or_path") or base.name),
        "adapter": lora.name,
        "dtype": dtype,
        "base_was_quantized": was_quantized,
        "lora": {k: config.get(k) for k in ("r", "lora_alpha", "lora_dropout", "target_modules") if k in config},
    }
    for name in ("training_parameters.json", "training_args.json", "textgen_training.json"):
        if (lora / name).is_file():
            with contextlib.suppress(json.JSONDecodeError):
                info["training"] = public_name(json.loads((lora / name).read_text()))
            break
    return info
