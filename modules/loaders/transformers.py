"""transformers backend: HF folders (safetensors) and GGUF files, bitsandbytes 4/8-bit, CPU/GPU offload, dynamic
LoRA with peft, vision-language models, every sampler as a logits processor, and xgrammar-constrained output.

Generation is a token-by-token loop over the model with a KV cache, so every step can be cancelled, every
sampler applied, and log probabilities reported from the distribution the token was drawn from. Up to
``--parallel`` generations run at once, batched into one forward pass per step by the scheduler in
``transformers_batch``; others wait in a bounded queue.
"""

from __future__ import annotations

import inspect
import logging
import pickle
import threading
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from modules.errors import BackendUnavailable, InvalidRequest, ModelLoadError, NotSupported
from modules.generation import sampling
from modules.generation.params import GenerationParams
from modules.loaders import OPTIONS, base, precheck, prequantized
from modules.loaders.base import Backend, ModelMetadata, TokenEvent, TokenSink
from modules.loaders.transformers_batch import Request, Scheduler
from modules.loaders.transformers_support import GrammarFactory, LoraStack, load_model_objects

log = logging.getLogger(__name__)


class TransformersBackend(Backend):
    """Hugging Face models through transformers and torch."""

    loader_name = "transformers"
    supports_lora = True
    supports_grammar = True
    supports_logprobs = True
    supports_logits_processors = True
    option_names = OPTIONS["transformers"]
    supported_params = sampling.SUPPORTED
    required_packages = ("transformers", "torch")

    def __init__(self) -> None:
        super().__init__()
        self.model: Any = None
        self.tokenizer: Any = None
        self.processor: Any = None
        self.vision = False
        self._context = 2048
        self._eos: list[int] = []
        self._device: Any = "cpu"
        self._scheduler: Scheduler | None = None
        self._n_vocab = 0
        self._logits_to_keep = False  # the model's forward takes logits_to_keep (prefill computes one row)
        self._grammars: GrammarFactory | None = None
        self._loras: LoraStack | None = None
        self._pieces: list[bytes] | None = None

    @property
    def supports_vision(self) -> bool:  # type: ignore[override]
        """True when the loaded model takes images."""
        return self.vision

    @classmethod
    def check(cls, path: Path, options: dict[str, Any]) -> None:
        """An HF folder with config.json and complete weights (or a complete GGUF), and bitsandbytes if asked."""
        super().check(path, options)
        if path.is_file() and path.suffix.lower() == ".gguf":
            if not base.package_installed("gguf"):
                raise BackendUnavailable("transformers reads GGUF files with the 'gguf' package: pip install gguf")
            precheck.gguf_file(path)
        else:
            quant = precheck.folder_config(path).get("quantization_config")
            if isinstance(quant, dict):  # GPTQ/AWQ: the library transformers hands it to must be installed
                prequantized.check(types.SimpleNamespace(quantization_config=quant), path.name)
            precheck.hf_folder(path)
        if (options.get("load_in_4bit") or options.get("load_in_8bit")) and not base.package_installed("bitsandbytes"):
            raise BackendUnavailable(
                "--load-in-4bit/--load-in-8bit need the 'bitsandbytes' package: pip install bitsandbytes"
            )

    @classmethod
    def load(cls, path: Path, options: dict[str, Any]) -> TransformersBackend:
        """Load an HF folder or a GGUF file (dequantized)."""
        self = cls()
        self.path = path
        try:
            loaded = load_model_objects(path, options)
        except (OSError, ValueError, RuntimeError, ImportError, KeyError, pickle.UnpicklingError) as exc:
            if "custom code" in str(exc) or "trust_remote_code" in str(exc):
                raise ModelLoadError(
                    f"{path.name} ships its own Python code, which textgen does not run by default; "
                    "load it with --trust-remote-code only if you trust its author"
                ) from exc
            raise ModelLoadError(f"transformers could not load {path.name}: {str(exc).splitlines()[0]}") from exc
        self.model, self.tokenizer, self.processor, self.vision = (
            loaded.model,
            loaded.tokenizer,
            loaded.processor,
            loaded.vision,
        )
        self._device = loaded.device
        config = loaded.config
        text_config = getattr(config, "text_config", None) or config
        trained = getattr(text_config, "max_position_embeddings", None) or 2048
        self._context = min(int(options.get("n_ctx") or trained), int(trained))
        max_queue = options.get("max_queue")
        self.max_parallel = max(1, int(options.get("parallel") or 1))
        self._n_vocab = int(loaded.vocab)
        try:
            self._logits_to_keep = "logits_to_keep" in inspect.signature(self.model.forward).parameters
        except (TypeError, ValueError):
            self._logits_to_keep = False
        eos = getattr(getattr(self.model, "generation_config", None), "eos_token_id", None)
        eos_ids = eos if isinstance(eos, list) else ([eos] if eos is not None else [])
        if self.tokenizer.eos_token_id is not None and self.tokenizer.eos_token_id not in eos_ids:
            eos_ids.append(self.tokenizer.eos_token_id)
        self._eos = [int(e) for e in eos_ids]
        template = getattr(self.processor, "chat_template", None) or getattr(self.tokenizer, "chat_template", None)
        self.metadata = ModelMetadata(
            name=path.name,
            architecture=(getattr(config, "architectures", None) or [type(self.model).__name__])[0],
            context_length=int(trained),
            chat_template=template if isinstance(template, str) else None,
            bos_token=self.tokenizer.bos_token or "",
            eos_token=self.tokenizer.eos_token or "",
            bos_token_id=self.tokenizer.bos_token_id,
            eos_token_ids=list(self._eos),
            add_bos_token=bool(getattr(self.tokenizer, "add_bos_token", False)),
            extra={
                "dtype": str(loaded.dtype),
                "device": str(self._device),
                "n_vocab": loaded.vocab,
                "quantized": loaded.quantized,
            },
        )
        self._grammars = GrammarFactory(self.tokenizer, loaded.vocab)
        self._loras = LoraStack(self)
        self._scheduler = Scheduler(self, self.max_parallel, 64 if max_queue is None else int(max_queue))
        return self

    def unload(self) -> None:
        """Stop the scheduler (requests still running end "cancelled"), drop the model and free (GPU) memory."""
        if self._scheduler is not None:
            self._scheduler.stop()
        self.model = self.tokenizer = self.processor = None
        self._grammars = self._loras = None
        try:
            import torch

            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        except ImportError:
            pass

    # ---------------------------------------------------------------- tokens
    @property
    def context_length(self) -> int:
        return self._context

    def _require(self) -> Any:
        if self.model is None:
            raise ModelLoadError("the model has been unloaded")
        return self.model

    def encode(self, text: str, add_special: bool = True) -> list[int]:
        self._require()
        return list(self.tokenizer.encode(text, add_special_tokens=add_special))

    def decode(self, ids: list[int]) -> str:
        vocab = int(self.metadata.extra.get("n_vocab") or 0)
        if any(not 0 <= t < vocab for t in ids):
            raise InvalidRequest(f"token ids must be between 0 and {vocab - 1}", param="tokens")
        return str(self.tokenizer.decode(ids, skip_special_tokens=False))

    def token_piece(self, token_id: int, special: bool = False) -> bytes:
        assert self._grammars is not None
        if self._pieces is None:
            self._pieces = self._grammars.token_bytes()
        if token_id in self._grammars.special_ids and not special:
            return b""
        return self._pieces[token_id] if 0 <= token_id < len(self._pieces) else b""

    def encode_multimodal(self, prompt: str, images: list[Any]) -> tuple[list[int], dict[str, Any]]:
        """Expand the prompt's image placeholders and turn the images into pixel values."""
        if not self.vision or self.processor is None:
            raise NotSupported("the loaded model cannot see images")
        inputs = self.processor(text=[prompt], images=images, return_tensors="pt")
        ids = inputs.pop("input_ids")[0].tolist()
        inputs.pop("attention_mask", None)
        return ids, dict(inputs)

    # ---------------------------------------------------------------- generation
    def generate(
        self,
        prompt_ids: list[int],
        params: GenerationParams,
        cancel: threading.Event,
        extra: dict[str, Any] | None = None,
    ) -> Iterator[TokenEvent]:
        """Queue the generation (QueueFull when every slot is busy and --max-queue wait) and return its stream."""
        req = self._request(prompt_ids, params, cancel, extra, None)
        assert self._scheduler is not None
        self._scheduler.enqueue(req)
        return self._scheduler.stream(req)

    def submit(
        self,
        prompt_ids: list[int],
        params: GenerationParams,
        cancel: threading.Event,
        sink: TokenSink,
        extra: dict[str, Any] | None = None,
    ) -> None:
        """Queue the generation; the scheduler hands its events to ``sink``, all of a step's at once."""
        req = self._request(prompt_ids, params, cancel, extra, sink)
        assert self._scheduler is not None
        self._scheduler.enqueue(req)

    def _request(
        self,
        prompt_ids: list[int],
        params: GenerationParams,
        cancel: threading.Event,
        extra: dict[str, Any] | None,
        sink: TokenSink | None,
    ) -> Request:
        """The request with its own sampler chain, seeded generator and grammar matcher (refusals raise here)."""
        import torch

        self._require()
        if not prompt_ids:
            raise InvalidRequest("the prompt is empty", param="prompt")
        assert self._grammars is not None
        matcher = self._grammars.matcher(params)  # an invalid grammar is refused here, before streaming
        generator = torch.Generator("cpu").manual_seed(params.resolved_seed())
        chain = sampling.build_chain(
            params,
            vocab=self._n_vocab,
            eos_ids=self._eos,
            prompt_length=len(prompt_ids),
            breaker_ids=self._breaker_ids(params),
            generator=generator,
            extra=list((extra or {}).get("logits_processors") or []),
        )
        return Request(
            prompt=list(prompt_ids),
            params=params,
            cancel=cancel,
            chain=chain,
            generator=generator,
            matcher=matcher,
            model_inputs=dict((extra or {}).get("model_inputs") or {}),
            sink=sink,
        )

    def _breaker_ids(self, params: GenerationParams) -> set[int]:
        if params.dry_multiplier <= 0:
            return set()
        ids: set[int] = set()
        for breaker in params.dry_sequence_breakers:
            ids.update(self.tokenizer.encode(breaker, add_special_tokens=False)[-1:])
        return ids

    def stats(self) -> dict[str, Any]:
        """slots (--parallel), busy_slots, queue_depth, and the scheduler's requests and forward passes (steps)."""
        if self._scheduler is None:
            return {"slots": self.max_parallel, "busy_slots": 0, "queue_depth": 0}
        return self._scheduler.snapshot()

    def _forward_lock(self) -> threading.Lock:
        if self._scheduler is None:
            raise ModelLoadError("the model has been unloaded")
        return self._scheduler.forward_lock

    def _exclusive(self, work: Any) -> None:
        """LoRA changes: wait for running generations to end, holding new ones back meanwhile."""
        if self._scheduler is None:
            raise ModelLoadError("the model has been unloaded")
        self._scheduler.exclusive(work)

    # ---------------------------------------------------------------- scoring
    def _log_softmax_rows(self, prompt_ids: list[int]) -> Any:
        import torch

        model = self._require()
        if len(prompt_ids) > self._context:
            raise InvalidRequest(
                f"the prompt has {len(prompt_ids)} tokens; the context holds {self._context}", param="prompt"
            )
        with self._forward_lock(), torch.inference_mode():
            logits = model(input_ids=torch.tensor([prompt_ids], device=self._device)).logits[0].float().cpu()
        return torch.log_softmax(logits[:, : self._n_vocab], dim=-1)

    def score(self, prompt_ids: list[int], top: int = 0) -> list[tuple[float | None, list[tuple[int, float]]]]:
        import torch

        rows = self._log_softmax_rows(prompt_ids)
        result: list[tuple[float | None, list[tuple[int, float]]]] = [(None, [])]
        for pos in range(len(prompt_ids) - 1):
            row = rows[pos]
            alternatives = []
            if top:
                values, ids = torch.topk(row, top)
                alternatives = [(int(i), float(v)) for i, v in zip(ids, values, strict=True)]
            result.append((float(row[prompt_ids[pos + 1]]), alternatives))
        return result

    def next_token_logprobs(self, prompt_ids: list[int], top: int) -> list[tuple[int, float]]:
        import torch

        if not prompt_ids:
            raise InvalidRequest("the prompt is empty", param="prompt")
        values, ids = torch.topk(self._log_softmax_rows(prompt_ids)[-1], top)
        return [(int(i), float(v)) for i, v in zip(ids, values, strict=True)]

    # ---------------------------------------------------------------- LoRA
    def load_lora(self, path: Path, scale: float = 1.0) -> None:
        """Add a PEFT adapter on top of the loaded model (several stack)."""
        assert self._loras is not None
        loras = self._loras
        self._exclusive(lambda: loras.add(path, scale))

    def unload_lora(self, path: Path | None = None) -> None:
        """Remove one adapter, or all of them."""
        assert self._loras is not None
        loras = self._loras
        self._exclusive(lambda: loras.remove(path))

    def set_loras(self, adapters: list[tuple[Path, float]]) -> None:
        """Replace every adapter at once, between two generations; on failure the previous set is restored."""
        assert self._loras is not None
        loras = self._loras
        self._exclusive(lambda: loras.replace(adapters))
