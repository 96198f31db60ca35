"""Helpers of the transformers backend: loading (quantization, offload, GGUF, vision), xgrammar constraints
and the PEFT LoRA stack.

Structured output uses xgrammar: it compiles JSON schemas, regexes and GBNF-style grammars against the model's
own tokenizer, is maintained by the MLC/SGLang people, runs on the CPU with torch tensors, and masks a step in
microseconds. (llguidance and outlines-core would do too; xgrammar was already proven on this machine.)
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from modules.errors import InvalidRequest, ModelLoadError, NotSupported
from modules.generation.params import GenerationParams
from modules.loaders import prequantized

if TYPE_CHECKING:
    from modules.loaders.transformers import TransformersBackend

log = logging.getLogger(__name__)


@dataclass
class LoadedObjects:
    """What loading produced."""

    model: Any
    tokenizer: Any
    processor: Any
    vision: bool
    device: Any
    config: Any
    dtype: Any  # the loaded model's (torch.float32 ...), not the option
    vocab: int
    quantized: str | None


def _dtype(torch: Any, name: str | None) -> Any:
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}.get(name or "")


def load_model_objects(path: Path, options: dict[str, Any]) -> LoadedObjects:
    """Load model, tokenizer (and processor for vision models) with the options' quantization and placement."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoProcessor, AutoTokenizer

    gguf = path.is_file() and path.suffix.lower() == ".gguf"
    folder = path.parent if gguf else path
    common: dict[str, Any] = {"local_files_only": True, "trust_remote_code": bool(options.get("trust_remote_code"))}
    if gguf:
        common["gguf_file"] = path.name
    elif not any(folder.glob("*.safetensors")) and not any(folder.glob("*.bin")):
        raise ModelLoadError(f"{folder.name} holds no weights (*.safetensors or *.bin)")
    config = AutoConfig.from_pretrained(str(folder), **common)
    quantized = prequantized.check(config, folder.name)  # GPTQ/AWQ: transformers reads quantization_config itself
    if quantized and (options.get("load_in_4bit") or options.get("load_in_8bit")):
        raise ModelLoadError(f"{folder.name} is already {quantized}-quantized: load it without --load-in-4bit/8bit")
    vision = getattr(config, "vision_config", None) is not None
    cuda = torch.cuda.is_available() and not options.get("cpu")
    dtype = _dtype(torch, options.get("dtype")) or ("auto" if cuda else torch.float32)
    # weights_only: a pickled .bin checkpoint is read with torch.load(weights_only=True), never run as code
    kwargs: dict[str, Any] = {**common, "dtype": dtype, "weights_only": True}
    if options.get("attn_implementation"):
        kwargs["attn_implementation"] = options["attn_implementation"]
    if options.get("load_in_4bit") or options.get("load_in_8bit"):
        from transformers import BitsAndBytesConfig

        four = bool(options.get("load_in_4bit"))
        quantized = "4-bit" if four else "8-bit"
        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=four,
            load_in_8bit=not four,
            bnb_4bit_compute_dtype=_dtype(torch, options.get("compute_dtype")) or torch.float32,
            bnb_4bit_quant_type=str(options.get("quant_type") or "nf4"),
            bnb_4bit_use_double_quant=bool(options.get("use_double_quant")),
        )
        if not cuda and dtype == "auto":
            kwargs["dtype"] = torch.float32
    if cuda:
        kwargs["device_map"] = "auto"
        gpu_memory = [m for m in options.get("gpu_memory") or [] if m]
        if gpu_memory or options.get("cpu_memory"):
            memory: dict[Any, str] = {i: _memory(m) for i, m in enumerate(gpu_memory)}
            if options.get("cpu_memory"):
                memory["cpu"] = _memory(options["cpu_memory"])
            kwargs["max_memory"] = memory
    elif quantized:
        kwargs["device_map"] = {"": "cpu"}
    processor = None
    if vision:
        from transformers import AutoModelForImageTextToText

        model = AutoModelForImageTextToText.from_pretrained(str(folder), **kwargs)
        processor = AutoProcessor.from_pretrained(str(folder), **common)
        tokenizer = processor.tokenizer
    else:
        model = AutoModelForCausalLM.from_pretrained(str(folder), **kwargs)
        tokenizer = AutoTokenizer.from_pretrained(str(folder), **common)
    model.eval()
    if quantized == "4-bit":
        unpack_4bit_rightly(model)
    output = model.get_output_embeddings()
    vocab = int(output.weight.shape[0]) if output is not None else int(getattr(config, "vocab_size", len(tokenizer)))
    device = next(model.parameters()).device
    loaded_dtype = getattr(model, "dtype", None) or kwargs["dtype"]  # what "auto" became, not what was asked
    log.info("transformers: %s on %s (%s%s)", folder.name, device, loaded_dtype, f", {quantized}" if quantized else "")
    return LoadedObjects(model, tokenizer, processor, vision, device, config, loaded_dtype, vocab, quantized)


def unpack_4bit_rightly(model: Any) -> None:
    """On a CPU with AVX512-BF16, bitsandbytes (0.50) repacks a 4-bit layer at its first reply (absmax
    transposed, in bf16) and unpacks it when the layer's state dict is read, as PEFT does to apply a LoRA. Its
    unpacking leaves the absmax transposed where there is no double quantisation, and from then on the model
    answers garbage, also once the LoRA is gone. This unpacks such a layer first, absmax in its own order; a
    double-quantised one bitsandbytes unpacks right itself."""
    import bitsandbytes as bnb

    try:
        from bitsandbytes.functional import _convert_weight_packed_for_cpu_inverse
    except ImportError:  # a bitsandbytes without the CPU repacking
        return

    def unpack(module: Any, prefix: str, keep_vars: bool) -> None:
        weight = module.weight
        state = getattr(weight, "quant_state", None)
        if state is None or not getattr(state, "packing_format_for_cpu", False) or state.original_nested:
            return
        absmax = state.absmax  # [K / blocksize, N] as packed
        weight.data, state = _convert_weight_packed_for_cpu_inverse(weight.data, state)
        state.absmax = absmax.T.reshape(-1).to(state.dtype).contiguous()

    for module in model.modules():
        if isinstance(module, bnb.nn.Linear4bit):
            module.register_state_dict_pre_hook(unpack)


def _memory(value: str) -> str:
    text = str(value).strip()
    if not re.fullmatch(r"\d+(\.\d+)?\s*(GiB|MiB|GB|MB)", text, flags=re.IGNORECASE):
        raise ModelLoadError(f"memory limit {value!r} must look like 10GiB or 512MiB")
    return text


class Matcher:
    """One request's grammar state: masks the logits before sampling, advances with each token."""

    def __init__(self, compiled: Any, vocab: int) -> None:
        import xgrammar as xgr

        self._xgr = xgr
        self._matcher = xgr.GrammarMatcher(compiled)
        self._bitmask = xgr.allocate_token_bitmask(1, vocab)

    def mask(self, scores: Any) -> None:
        """Set the logits of tokens the grammar forbids to -inf (in place)."""
        self._matcher.fill_next_token_bitmask(self._bitmask)
        self._xgr.apply_token_bitmask_inplace(scores, self._bitmask)

    def accept(self, token: int) -> None:
        """Advance the grammar with the chosen token."""
        self._matcher.accept_token(token)

    def terminated(self) -> bool:
        """True once the grammar is complete."""
        return bool(self._matcher.is_terminated())


class GrammarFactory:
    """Compiles JSON schemas, regexes and grammars for the loaded tokenizer (cached per text)."""

    def __init__(self, tokenizer: Any, vocab: int) -> None:
        import xgrammar as xgr

        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab)
        self.compiler = xgr.GrammarCompiler(self.info)
        self.vocab = vocab
        self.special_ids = set(getattr(tokenizer, "all_special_ids", []) or [])

    def token_bytes(self) -> list[bytes]:
        """Every token's raw bytes (byte-level BPE and SentencePiece alike)."""
        return [bytes(b) if not isinstance(b, bytes) else b for b in self.info.decoded_vocab]

    def matcher(self, params: GenerationParams) -> Matcher | None:
        """A matcher for the request's constraint, or None; an invalid one is an InvalidRequest."""
        try:
            if params.json_schema is not None:
                compiled = self.compiler.compile_json_schema(json.dumps(params.json_schema), any_whitespace=False)
            elif params.grammar:
                compiled = self.compiler.compile_grammar(params.grammar)
            elif params.regex:
                compiled = self.compiler.compile_regex(params.regex)
            else:
                return None
        except (RuntimeError, ValueError, TypeError) as exc:
            param = "response_format" if params.json_schema is not None else ("grammar" if params.grammar else "regex")
            raise InvalidRequest(f"the {param} could not be compiled: {exc}", param=param) from exc
        return Matcher(compiled, self.vocab)


class LoraStack:
    """PEFT adapters applied on top of the base model without reloading it; several can be active at once."""

    def __init__(self, backend: TransformersBackend) -> None:
        self.backend = backend
        self.active: dict[str, str] = {}  # adapter path -> adapter name
        self.scales: dict[str, float] = {}  # adapter path -> scale

    def add(self, path: Path, scale: float) -> None:
        """Load and activate an adapter (scaled by ``scale``)."""
        from peft import PeftModel
        from peft.tuners.lora import LoraLayer

        if not (path / "adapter_config.json").is_file():
            raise NotSupported(f"{path.name} is not a PEFT adapter (adapter_config.json is missing)")
        key = str(path)
        if key in self.active:
            self.remove(path)
        name = re.sub(r"\W", "_", path.name) or "adapter"
        while name in self.active.values():
            name += "_"
        model = self.backend.model
        try:
            if isinstance(model, PeftModel):
                model.load_adapter(key, adapter_name=name, is_trainable=False)
            else:
                self.backend.model = model = PeftModel.from_pretrained(
                    model, key, adapter_name=name, is_trainable=False
                )
        except (ValueError, OSError, RuntimeError, KeyError) as exc:
            raise ModelLoadError(f"{path.name} does not fit this model: {exc}") from exc
        self.active[key] = name
        self.scales[key] = scale
        model.base_model.set_adapter(list(self.active.values()))  # type: ignore[operator]
        if scale != 1.0:
            for module in model.modules():
                if isinstance(module, LoraLayer) and name in module.scaling:
                    module.scaling[name] *= scale
        model.eval()

    def remove(self, path: Path | None) -> None:
        """Deactivate and delete one adapter (or every one); the base model is left as it was."""
        targets = list(self.active) if path is None else [k for k in self.active if Path(k) in (path, path.parent)]
        model = self.backend.model
        for key in targets:
            model.delete_adapter(self.active.pop(key))
            self.scales.pop(key, None)
        if not self.active and targets:
            self.backend.model = model.unload()
        elif targets:
            model.base_model.set_adapter(list(self.active.values()))  # type: ignore[operator]

    def replace(self, adapters: list[tuple[Path, float]]) -> None:
        """Swap the whole set for ``adapters``; when one of them fails, put the previous set back and raise."""
        for path, _ in adapters:
            if not (path / "adapter_config.json").is_file():
                raise NotSupported(f"{path.name} is not a PEFT adapter (adapter_config.json is missing)")
        previous = [(Path(key), self.scales.get(key, 1.0)) for key in self.active]
        try:
            self.remove(None)
            for path, scale in adapters:
                self.add(path, scale)
        except BaseException:
            self.remove(None)
            for path, scale in previous:
                self.add(path, scale)
            raise
