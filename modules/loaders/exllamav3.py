"""ExLlamaV3 backend: EXL3 models on CUDA through exllamav3's paged generator, so concurrent requests batch.

Built against exllamav3 1.6.5 (turboderp-org/exllamav3; the paths below are in that tree):

- Loading is ``Config.from_directory`` -> ``Model.from_config`` -> ``Cache(model, max_num_tokens, layer_type,
  k_bits, v_bits)`` -> ``model.load(use_per_device=...)`` -> ``Tokenizer.from_config`` (model_init.py). The cache
  must exist before ``model.load()``, which allocates it (``Generator.iterate`` asserts ``cache.initialized``);
  ``max_num_tokens`` must be a multiple of 256 (cache/fp16.py, cache/quant.py), quantized layers take 2..8 bits.
- ``Tokenizer.from_config`` merges the end tokens of config.json, tokenizer_config.json and
  generation_config.json into ``config.eos_token_id_list`` (tokenizer/tokenizer.py); all of them stop a reply.
- Samplers are a ``CustomSampler`` over ``SS_*`` steps (generator/sampler/custom.py), in ComboSampler's order
  (presets.py) so the fused kernel takes the tail. There is no typical-p, tail-free, top-a, Mirostat or dynamic
  temperature step: those parameters are refused, not ignored.
- Results have the same shape as exllamav2's, plus ``stage: "error"`` for a job the generator reaped; a job's
  ``token_probs`` come from the softmax of its raw logits (``Job.receive_logits``), so they need no repair.

The scheduler thread (exllama_common) owns the generator. Without CUDA the loader refuses with a clear message.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

from modules.errors import BackendUnavailable, InvalidRequest, ModelLoadError
from modules.generation.params import GenerationParams
from modules.loaders import OPTIONS
from modules.loaders.base import ModelMetadata
from modules.loaders.exllama_common import (
    LOAD_ERRORS,
    ExllamaBackend,
    cache_choice,
    cache_tokens,
    context_tokens,
    require_cuda,
)

log = logging.getLogger(__name__)
SUPPORTED = frozenset(
    {
        "seed", "ban_eos", "min_tokens", "temperature", "temperature_last", "top_k", "top_p", "min_p",
        "xtc_threshold", "xtc_probability", "repetition_penalty", "repetition_penalty_range", "presence_penalty",
        "frequency_penalty", "dry_multiplier", "dry_base", "dry_allowed_length", "dry_sequence_breakers",
        "logit_bias", "logprobs", "top_logprobs",
    }
)  # fmt: skip
WHOLE_CONTEXT = int(10e7)  # SS_RepP / SS_PresFreqP's own default sustain_range
MAX_CHUNK = 2048  # prompt tokens per prefill pass (the generator's default)


def cache_bits(kind: str) -> tuple[int, int] | None:
    """(k_bits, v_bits) for a quantized cache ("q4", "4", "4,6", "q4,q6"), None for fp16; ModelLoadError if bad."""
    if kind in ("fp16", "f16", "half"):
        return None
    parts = [p for p in re.split(r"[,/]", kind) if p]
    try:
        bits = [int(p.removeprefix("q")) for p in parts]
    except ValueError:
        bits = []
    if len(bits) == 1:
        bits = bits * 2
    if len(bits) != 2 or not all(2 <= b <= 8 for b in bits):
        raise ModelLoadError(
            f"ExLlamaV3 cannot make a {kind!r} cache: --cache-type takes fp16, q2..q8, or key,value bits like 4,6"
        )
    return bits[0], bits[1]


class ExLlamaV3Backend(ExllamaBackend):
    """EXL3-quantized models on one or several CUDA GPUs."""

    loader_name = "exllamav3"
    library = "ExLlamaV3"
    option_names = OPTIONS["exllamav3"]
    supported_params = SUPPORTED
    required_packages = ("exllamav3",)

    def __init__(self) -> None:
        super().__init__()
        self.config: Any = None

    @classmethod
    def _check_cache(cls, kind: str) -> None:
        cache_bits(kind)

    @classmethod
    def load(cls, path: Path, options: dict[str, Any]) -> ExLlamaV3Backend:
        """Load an EXL3 folder: config, model (auto-split or --gpu-split), cache, tokenizer and generator."""
        require_cuda("ExLlamaV3")
        try:
            import exllamav3
        except ImportError as exc:
            raise BackendUnavailable(
                f"the exllamav3 package is missing or broken ({exc}): pip install exllamav3"
            ) from exc
        bits = cache_bits(cache_choice(options))
        self = cls()
        self.path = path
        try:
            self.config = config = exllamav3.Config.from_directory(str(path))
            trained = int(config.max_position_embeddings)
            self._context = context_tokens(trained, options.get("max_seq_len"))
            parallel = int(options.get("parallel") or 4)
            size = cache_tokens(self._context, parallel, options.get("cache_size"))
            self.model = exllamav3.Model.from_config(config)
            if bits is None:
                self.cache = exllamav3.Cache(self.model, max_num_tokens=size, layer_type=exllamav3.CacheLayer_fp16)
            else:
                self.cache = exllamav3.Cache(
                    self.model,
                    max_num_tokens=size,
                    layer_type=exllamav3.CacheLayer_quant,
                    k_bits=bits[0],
                    v_bits=bits[1],
                )
            split = [float(x) for x in str(options.get("gpu_split") or "").split(",") if x.strip()] or None
            self.model.load(use_per_device=split, max_chunk_size=MAX_CHUNK)  # allocates the cache made above
            self.tokenizer = exllamav3.Tokenizer.from_config(config)
            self.generator = exllamav3.Generator(
                model=self.model,
                cache=self.cache,
                tokenizer=self.tokenizer,
                max_batch_size=parallel,
                max_chunk_size=MAX_CHUNK,
            )
        except LOAD_ERRORS as exc:  # the library's checks are asserts: report them, free what was loaded
            self._release()
            raise ModelLoadError(f"ExLlamaV3 could not load {path.name}: {exc}") from exc
        self.max_parallel = parallel
        tok = self.tokenizer
        ends = [*list(getattr(config, "eos_token_id_list", None) or []), tok.eos_token_id]
        self.stop_ids = [int(e) for i, e in enumerate(ends) if e is not None and e not in ends[:i]]
        self.metadata = ModelMetadata(
            name=path.name,
            architecture="exl3",
            context_length=trained,
            bos_token=tok.bos_token or "",
            eos_token=tok.eos_token or "",
            bos_token_id=tok.bos_token_id,
            eos_token_ids=list(self.stop_ids),
            extra={
                "n_vocab": int(tok.actual_vocab_size),
                "cache": "fp16" if bits is None else f"q{bits[0]},{bits[1]}",
                "cache_tokens": size,
            },
        )
        self._start(options)
        return self

    def _release(self) -> None:
        if self.generator is not None and hasattr(self.generator, "close"):  # close() frees pinned host memory
            try:
                self.generator.close()
            except Exception:
                log.exception("ExLlamaV3: closing the generator failed")
        if self.model is not None:
            try:
                self.model.unload()
            except Exception:
                log.exception("ExLlamaV3: unloading failed")
        self.model = self.cache = self.generator = None

    def encode(self, text: str, add_special: bool = True) -> list[int]:
        ids = self.tokenizer.encode(text, add_bos=add_special, encode_special_tokens=True)
        return [int(t) for t in ids[0].tolist()]

    def decode(self, ids: list[int]) -> str:
        return self._decode_ids(ids, True)

    def _decode_ids(self, ids: list[int], special: bool) -> str:
        import torch

        return str(self.tokenizer.decode(torch.tensor(ids, dtype=torch.long), decode_special_tokens=special))

    # ---------------------------------------------------------------- jobs
    def _new_job(self, prompt_ids: list[int], params: GenerationParams, max_new_tokens: int, key: int) -> Any:
        import torch
        from exllamav3 import Job

        want = params.logprobs or params.top_logprobs > 0
        return Job(
            input_ids=torch.tensor([prompt_ids], dtype=torch.long),
            max_new_tokens=max_new_tokens,
            min_new_tokens=params.min_tokens,
            sampler=self._sampler(params),
            seed=params.resolved_seed(),
            stop_conditions=[] if params.ban_eos else list(self.stop_ids),
            decode_special_tokens=not params.skip_special_tokens,
            return_top_tokens=params.top_logprobs,
            return_probs=want,
            identifier=key,
        )

    def _sampler(self, params: GenerationParams) -> Any:
        """A ``CustomSampler`` for a request: penalties first, then truncation, temperature and the draw."""
        from exllamav3.generator import sampler as s

        steps: list[Any] = []
        if params.logit_bias:
            steps.append(s.SS_LogitBias({t: float("-inf") if v <= -100 else v for t, v in params.logit_bias.items()}))
        if params.ban_eos:
            steps.append(s.SS_BanTokens(list(self.stop_ids)))
        window = params.repetition_penalty_range or WHOLE_CONTEXT
        if params.repetition_penalty != 1.0:
            steps.append(s.SS_RepP(params.repetition_penalty, window, 0))
        if params.presence_penalty or params.frequency_penalty:
            steps.append(s.SS_PresFreqP(params.presence_penalty, params.frequency_penalty, window, 0))
        if params.dry_multiplier > 0:
            if not hasattr(s, "SS_DRY"):  # 1.4.1 has none, 1.6.5 has
                raise InvalidRequest(
                    "this exllamav3 has no DRY sampler: upgrade it (1.6.5 has)", param="dry_multiplier"
                )
            breakers = s.dry_sequence_breaker_tokens(self.tokenizer, tuple(params.dry_sequence_breakers))
            steps.append(
                s.SS_DRY(params.dry_multiplier, params.dry_base, params.dry_allowed_length, 0, breakers or None)
            )
        if params.greedy:
            return s.CustomSampler([*steps, s.SS_Argmax()])
        if not params.temperature_last:
            steps.append(s.SS_Temperature(params.temperature))
        if params.min_p > 0:
            steps.append(s.SS_MinP(params.min_p))
        if params.top_k > 0:
            steps.append(s.SS_TopK(params.top_k))
        if params.top_p < 1.0:
            steps.append(s.SS_TopP(params.top_p))
        if params.xtc_probability > 0:
            steps.append(s.SS_XTC(params.xtc_probability, params.xtc_threshold, tokenizer=self.tokenizer))
        if params.temperature_last:
            steps.append(s.SS_Temperature(params.temperature))
        return s.CustomSampler([*steps, s.SS_Sample()])
