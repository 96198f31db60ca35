"""ExLlamaV2 backend: EXL2 models on CUDA through exllamav2's dynamic generator, so concurrent requests batch.

Built against exllamav2 0.3.2 (turboderp-org/exllamav2; the paths below are in that tree):

- ``ExLlamaV2Config(model_dir)`` already runs ``prepare()`` (config.py), and keeps only ``eos_token_id[0]``
  of a list; the other end tokens (Llama-3's ``<|eot_id|>``) are read from config.json and
  generation_config.json here and all stop a reply.
- ``ExLlamaV2DynamicGenerator.__init__`` (generator/dynamic.py) asserts that the cache is not
  ``ExLlamaV2Cache_8bit`` (it takes FP16, Q4, Q6 and Q8), that ``cache.max_seq_len`` is a multiple of 256, and,
  when ``paged`` (the default), that flash-attn >= 2.5.7 is installed (``attn.assert_paged_attn``) and not
  disabled in the config. Without it the generator runs unpaged: one sequence at a time.
- One cache serves every job; a job reserves pages for its prompt plus ``max_new_tokens`` when it starts
  (``prepare_for_queue``), so the cache holds a full context for every parallel slot (see exllama_common).

The scheduler thread (exllama_common) owns the generator. Without CUDA the loader refuses with a clear message.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from modules.errors import BackendUnavailable, InvalidRequest, ModelLoadError
from modules.generation.params import GenerationParams
from modules.loaders import OPTIONS
from modules.loaders.base import ModelMetadata, TopLogprob
from modules.loaders.exllama_common import (
    LOAD_ERRORS,
    ExllamaBackend,
    JobEntry,
    cache_choice,
    cache_tokens,
    context_tokens,
    eos_ids_from_files,
    require_cuda,
)

log = logging.getLogger(__name__)
SUPPORTED = frozenset(
    {
        "seed", "ban_eos", "min_tokens", "temperature", "temperature_last", "dynatemp_range", "dynatemp_exponent",
        "top_k", "top_p", "min_p", "typical_p", "top_a", "tfs", "xtc_threshold", "xtc_probability",
        "repetition_penalty", "repetition_penalty_range", "presence_penalty", "frequency_penalty",
        "dry_multiplier", "dry_base", "dry_allowed_length", "dry_sequence_breakers", "mirostat_mode", "mirostat_tau",
        "mirostat_eta", "logit_bias", "logprobs", "top_logprobs",
    }
)  # fmt: skip
CACHE_CLASSES = {
    "fp16": "ExLlamaV2Cache",
    "q8": "ExLlamaV2Cache_Q8",
    "q6": "ExLlamaV2Cache_Q6",
    "q4": "ExLlamaV2Cache_Q4",
}
MIN_DYNATEMP = 0.01  # sampling.cpp divides by the dynamic temperature


class ExLlamaV2Backend(ExllamaBackend):
    """EXL2-quantized models on one or several CUDA GPUs."""

    loader_name = "exllamav2"
    library = "ExLlamaV2"
    option_names = OPTIONS["exllamav2"]
    supported_params = SUPPORTED
    required_packages = ("exllamav2",)

    def __init__(self) -> None:
        super().__init__()
        self.paged = True
        self._breakers: dict[tuple[str, ...], set[int]] = {}

    @classmethod
    def _check_cache(cls, kind: str) -> None:
        if kind not in CACHE_CLASSES:
            raise ModelLoadError(f"ExLlamaV2 has no {kind!r} cache; --cache-type takes {', '.join(CACHE_CLASSES)}")

    @classmethod
    def load(cls, path: Path, options: dict[str, Any]) -> ExLlamaV2Backend:
        """Load an EXL2 folder: config, model (auto-split or --gpu-split), cache, tokenizer and generator."""
        require_cuda("ExLlamaV2")
        try:
            import exllamav2
            from exllamav2 import attn
            from exllamav2.generator import ExLlamaV2DynamicGenerator
        except ImportError as exc:
            raise BackendUnavailable(
                f"the exllamav2 package is missing or broken ({exc}): pip install exllamav2"
            ) from exc
        kind = cache_choice(options)
        cls._check_cache(kind)
        self = cls()
        self.path = path
        try:
            config = exllamav2.ExLlamaV2Config(str(path))  # runs prepare() itself
            config.arch_compat_overrides()  # turns flash-attn off where the model needs what it lacks
            trained = int(config.max_seq_len)
            self._context = context_tokens(trained, options.get("max_seq_len"))
            config.max_seq_len = self._context
            # attn.py sets has_flash_attn_with_paged for flash-attn >= 2.5.7; the paged generator asserts it
            self.paged = bool(getattr(attn, "has_flash_attn_with_paged", False)) and not config.no_flash_attn
            parallel = int(options.get("parallel") or 4) if self.paged else 1
            if not self.paged:
                log.warning(
                    "ExLlamaV2: flash-attn >= 2.5.7 is not usable here, so generations run one at a time "
                    "(pip install flash-attn for batching)"
                )
            size = cache_tokens(self._context, parallel, options.get("cache_size")) if self.paged else self._context
            self.model = exllamav2.ExLlamaV2(config)
            cache_cls = getattr(exllamav2, CACHE_CLASSES[kind])
            if options.get("gpu_split"):
                split = [float(x) for x in str(options["gpu_split"]).split(",") if x.strip()]
                self.model.load(split)
                self.cache = cache_cls(self.model, max_seq_len=size)
            else:
                self.cache = cache_cls(self.model, max_seq_len=size, lazy=True)
                self.model.load_autosplit(self.cache)
            self.tokenizer = exllamav2.ExLlamaV2Tokenizer(config)
            self.generator = ExLlamaV2DynamicGenerator(
                model=self.model,
                cache=self.cache,
                tokenizer=self.tokenizer,
                max_batch_size=parallel,
                max_seq_len=self._context,
                paged=self.paged,
            )
        except LOAD_ERRORS as exc:  # the library's checks are asserts: report them, free what was loaded
            self._release()
            raise ModelLoadError(f"ExLlamaV2 could not load {path.name}: {exc}") from exc
        self.max_parallel = parallel
        tok = self.tokenizer
        self.stop_ids = _unique([*eos_ids_from_files(path), tok.eos_token_id])
        self.metadata = ModelMetadata(
            name=path.name,
            architecture="exl2",
            context_length=trained,
            bos_token=tok.bos_token or "",
            eos_token=tok.eos_token or "",
            bos_token_id=tok.bos_token_id,
            eos_token_ids=list(self.stop_ids),
            extra={"n_vocab": tok.get_vocab_size(), "cache": kind, "cache_tokens": size, "paged": self.paged},
        )
        self._start(options)
        return self

    def _release(self) -> None:
        if self.model is not None:
            try:
                self.model.unload()
            except Exception:  # a half-loaded model: free what can be freed
                log.exception("ExLlamaV2: unloading failed")
        self.model = self.cache = self.generator = None

    def encode(self, text: str, add_special: bool = True) -> list[int]:
        ids = self.tokenizer.encode(text, add_bos=add_special, encode_special_tokens=True)
        return [int(t) for t in ids[0].tolist()]

    def decode(self, ids: list[int]) -> str:
        return self._decode_ids(ids, True)

    def _decode_ids(self, ids: list[int], special: bool) -> str:
        import torch

        return str(self.tokenizer.decode(torch.tensor([ids]), decode_special_tokens=special)[0])

    # ---------------------------------------------------------------- jobs
    def _new_job(self, prompt_ids: list[int], params: GenerationParams, max_new_tokens: int, key: int) -> Any:
        import torch
        from exllamav2.generator import ExLlamaV2DynamicJob

        want = params.logprobs or params.top_logprobs > 0
        return ExLlamaV2DynamicJob(
            input_ids=torch.tensor([prompt_ids]),
            max_new_tokens=max_new_tokens,
            min_new_tokens=params.min_tokens,
            gen_settings=self._settings(params),
            seed=params.resolved_seed(),
            stop_conditions=[] if params.ban_eos else list(self.stop_ids),
            decode_special_tokens=not params.skip_special_tokens,
            return_top_tokens=params.top_logprobs,
            return_probs=want,
            return_logits=want and params.greedy,  # greedy probabilities are 1.0 after top_k=1: see _logprobs
            identifier=key,
        )

    def _settings(self, params: GenerationParams) -> Any:
        """``ExLlamaV2Sampler.Settings`` for a request; every field is set (the library's defaults are not ours)."""
        from exllamav2.generator import ExLlamaV2Sampler

        s = ExLlamaV2Sampler.Settings()
        s.temperature = params.temperature if not params.greedy else 1.0
        s.top_k = 1 if params.greedy else params.top_k
        s.top_p, s.min_p, s.typical, s.top_a, s.tfs = (
            params.top_p,
            params.min_p,
            params.typical_p,
            params.top_a,
            params.tfs,
        )
        s.token_repetition_penalty = params.repetition_penalty
        s.token_repetition_range = params.repetition_penalty_range or -1
        s.token_presence_penalty, s.token_frequency_penalty = params.presence_penalty, params.frequency_penalty
        s.temperature_last = params.temperature_last
        if params.dynatemp_range > 0 and not params.greedy:
            # sampling.cpp softmaxes at `temperature`, then post_softmax_temperature rescales by the entropy-based
            # temperature when max_temp > min_temp: the two stack. Dynamic temperature replaces the fixed one
            # (as llama.cpp does), so the softmax runs at 1.
            s.temperature = 1.0
            s.min_temp = max(MIN_DYNATEMP, params.temperature - params.dynatemp_range)
            s.max_temp = params.temperature + params.dynatemp_range
            s.temp_exponent = params.dynatemp_exponent
        if params.mirostat_mode == 1:  # exllamav2's mirostat truncates by surprise against mu: that is v2
            raise InvalidRequest(
                "ExLlamaV2 implements Mirostat 2 only: use mirostat_mode 2, or llama.cpp or transformers for mode 1",
                param="mirostat_mode",
            )
        s.mirostat, s.mirostat_tau, s.mirostat_eta = params.mirostat_mode > 0, params.mirostat_tau, params.mirostat_eta
        s.xtc_probability, s.xtc_threshold = params.xtc_probability, params.xtc_threshold
        s.dry_multiplier, s.dry_base, s.dry_allowed_length = (
            params.dry_multiplier,
            params.dry_base,
            params.dry_allowed_length,
        )
        if params.dry_multiplier > 0:
            s.dry_sequence_breakers = self._breaker_ids(params.dry_sequence_breakers)
        if params.logit_bias:  # exllamav2 reads token_bias, sized like its own disallow_tokens() makes it
            import torch

            vocab = int(self.tokenizer.config.vocab_size)
            bias = torch.zeros((vocab + (-vocab % 32),), dtype=torch.float)
            for token, value in params.logit_bias.items():
                if 0 <= token < vocab:
                    bias[token] = float("-inf") if value <= -100 else value
            s.token_bias = bias
        if params.ban_eos:
            s.disallow_tokens(self.tokenizer, list(self.stop_ids))
        return s

    def _breaker_ids(self, breakers: list[str]) -> set[int]:
        """Token ids whose text contains a DRY sequence breaker (exllamav2 takes ids, not strings)."""
        key = tuple(breakers)
        if key not in self._breakers:
            pieces = self.tokenizer.get_id_to_piece_list(True)
            self._breakers[key] = {i for i, piece in enumerate(pieces) if any(b and b in piece for b in breakers)}
        return self._breakers[key]

    def _logprobs(
        self, entry: JobEntry, result: dict[str, Any], i: int
    ) -> tuple[float | None, list[TopLogprob] | None]:
        """Greedy jobs read the log probabilities off the returned logits, the others off the sampler's.

        exllamav2 reports the probability after truncation (ext_sampling.cpp: ``output_probs = temp_probs[0]``),
        and greedy decoding is top_k=1, so every greedy token would read 0.0 and every alternative log(0). The
        job's ``logits`` (returned with ``return_logits``) are the ones it sampled from, after penalties and bias.
        """
        logits = result.get("logits")
        if not entry.greedy or logits is None:
            return super()._logprobs(entry, result, i)
        import torch

        vocab = int(self.tokenizer.get_vocab_size())
        logp = torch.log_softmax(logits[0, i, :vocab].float(), dim=-1)
        token = int(result["token_ids"][0, i])
        top = None
        if result.get("top_k_tokens") is not None:
            values, ids = torch.topk(logp, min(int(result["top_k_tokens"].shape[-1]), vocab))
            top = [
                TopLogprob(int(t), self.token_piece(int(t), True), float(v)) for t, v in zip(ids, values, strict=True)
            ]
        return float(logp[token]), top


def _unique(ids: list[int | None]) -> list[int]:
    out: list[int] = []
    for item in ids:
        if item is not None and int(item) not in out:
            out.append(int(item))
    return out
