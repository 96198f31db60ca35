"""HF causal LM -> ONNX with ``torch.onnx.export`` (the dynamo exporter), then proof with onnxruntime that it is the
same model.

The graph takes ``input_ids``, ``attention_mask`` (past + new tokens), ``position_ids`` and the KV cache as
``past_key_values.N.key`` / ``.value`` (batch x KV heads x past x head dim; zero-length for the first step) and gives
``logits`` and ``present.N.key`` / ``.value`` (the names optimum uses); batch, sequence and past axes are dynamic. A
model whose cache graph fails to export or to match transformers (hybrid or recurrent caches) gets the graph without
one (``input_ids, attention_mask -> logits``, every step reruns the sequence); the result's ``kv_cache`` says which.
Weights are float32 (4 bytes per parameter, whatever the source's dtype), in ``model.onnx.data`` beside
``model.onnx``; the tokenizer, config, generation config and chat template files are copied next to them.

After writing, the folder is loaded with onnxruntime (CPU) and compared with transformers (float32) on
:data:`fidelity.PROMPTS <modules.lifecycle.fidelity.PROMPTS>`: the largest absolute logit difference over every
prompt position (the prompts also go through as one right-padded batch, to check the dynamic axes), the share of
positions whose top token is the same, and :data:`TOKENS` greedy tokens from each, decoded in onnxruntime through
its own cache (each step's logits are compared too). An export that disagrees beyond
:data:`MAX_ABS_DIFF` / :data:`MIN_TOP1` is refused and nothing is left under the output name.
"""

from __future__ import annotations

import logging
import math
import shutil
import threading
import warnings
from pathlib import Path
from typing import Any

import numpy as np

from modules import jobs
from modules.errors import BackendUnavailable, InvalidRequest, TextgenError
from modules.lifecycle import convert
from modules.lifecycle.fidelity import PROMPTS

log = logging.getLogger(__name__)

PACKAGES = ("onnx", "onnxscript", "onnxruntime")
"""What torch.onnx.export and the check import (requirements-onnx.txt pins them)."""

TOKENS = 16
"""Greedy tokens compared per prompt (transformers reruns the whole sequence for each, as the reference)."""

MAX_ABS_DIFF = 0.05
"""The largest logit difference (float32 against float32) an export may show before it is refused."""

MIN_TOP1 = 0.99
"""The smallest share of prompt positions whose top token must match transformers'."""

SIDE_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
)
"""Copied from the source folder beside model.onnx when present."""


class OnnxMismatch(TextgenError):
    """The exported graph does not compute what the HF model computes; nothing was written."""


def require_packages() -> None:
    """Raise :class:`BackendUnavailable` naming what is missing (onnx, onnxscript, onnxruntime)."""
    import importlib

    missing = []
    for name in PACKAGES:
        try:
            importlib.import_module(name)
        except ImportError:
            missing.append(name)
    if missing:
        raise BackendUnavailable(
            f"ONNX export needs the optional packages {', '.join(PACKAGES)}; missing: {', '.join(missing)}. "
            "Install them with `pip install -r requirements-onnx.txt` (make dev does)."
        )


def logits_only(model: Any) -> Any:
    """The HF model as a module ``(input_ids, attention_mask) -> logits`` that never builds a KV cache."""
    import torch

    class LogitsOnly(torch.nn.Module):
        def __init__(self, inner: Any) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, input_ids: Any, attention_mask: Any) -> Any:
            return self.inner(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits

    return LogitsOnly(model).eval()


def with_past(model: Any) -> Any:
    """The HF model as ``(input_ids, attention_mask, position_ids, past K/V per layer) -> (logits, present K/V)``."""
    import torch
    from transformers import DynamicCache

    layers = model.config.num_hidden_layers

    class WithPast(torch.nn.Module):
        def __init__(self, inner: Any) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, input_ids: Any, attention_mask: Any, position_ids: Any, *past: Any) -> Any:
            cache = DynamicCache(config=self.inner.config)
            for i in range(layers):
                cache.update(past[2 * i], past[2 * i + 1], i)
            out = self.inner(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                             past_key_values=cache, use_cache=True)  # fmt: skip
            present = [t for layer in out.past_key_values.layers for t in (layer.keys, layer.values)]
            return (out.logits, *present)

    return WithPast(model).eval()


def past_names(layers: int) -> list[str]:
    """The cache inputs' names, optimum's: ``past_key_values.N.key`` / ``.value`` (outputs: ``present.N...``)."""
    return [f"past_key_values.{i}.{kind}" for i in range(layers) for kind in ("key", "value")]


def _export(
    module: Any, example: tuple[Any, ...], names: list[str], outputs: list[str], shapes: Any, path: Path
) -> None:
    import torch

    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        torch.onnx.export(module, example, str(path), input_names=names, output_names=outputs, dynamic_shapes=shapes,
                          dynamo=True, external_data=True, optimize=True, verbose=False)  # fmt: skip


def _export_with_past(model: Any, path: Path) -> None:
    import torch

    cfg = model.config
    layers, kv_heads = cfg.num_hidden_layers, getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (2, 4), generator=generator)
    past = [torch.randn(2, kv_heads, 3, head_dim, generator=generator) for _ in range(2 * layers)]
    example = (ids, torch.ones((2, 7), dtype=torch.long), torch.arange(3, 7).expand(2, 4).clone(), *past)
    batch, sequence, total, past_len = (torch.export.Dim(n) for n in ("batch", "sequence", "total", "past_sequence"))
    shapes = {"input_ids": {0: batch, 1: sequence}, "attention_mask": {0: batch, 1: total},
              "position_ids": {0: batch, 1: sequence}, "past": tuple({0: batch, 2: past_len} for _ in past)}  # fmt: skip
    names = past_names(layers)
    outputs = ["logits", *(n.replace("past_key_values", "present") for n in names)]
    _export(with_past(model), example, ["input_ids", "attention_mask", "position_ids", *names], outputs, shapes, path)


def _export_logits_only(model: Any, path: Path) -> None:
    import torch

    # batch 2, not 1 (a size-1 axis would be fixed in the graph); two distinct tensors: one tensor passed as both
    # inputs is traced as one, and the graph then reads the mask as the ids
    ids = torch.randint(0, model.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    batch, sequence = torch.export.Dim("batch"), torch.export.Dim("sequence")
    shapes = {"input_ids": {0: batch, 1: sequence}, "attention_mask": {0: batch, 1: sequence}}
    _export(logits_only(model), (ids, torch.ones_like(ids)), ["input_ids", "attention_mask"], ["logits"], shapes, path)


def export_onnx(
    source: Path, output: Path, report: jobs.Reporter, cancel: threading.Event, overwrite: bool = False
) -> dict[str, Any]:
    """Export ``source`` into the folder ``output`` and check it; returns the fidelity dict (see module doc)."""
    require_packages()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    report(done=0, total=4, message="loading the model (float32)")
    try:
        model = AutoModelForCausalLM.from_pretrained(str(source), dtype=torch.float32, local_files_only=True).eval()
        tokenizer = AutoTokenizer.from_pretrained(str(source), local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise InvalidRequest(f"{source} is not a causal LM transformers can load: {exc}", "source") from exc
    jobs.check(cancel)
    output.parent.mkdir(parents=True, exist_ok=True)
    with convert.staged_folder(output, cancel, overwrite) as tmp:
        tmp.mkdir(parents=True)
        report(done=1, total=4, message="exporting to ONNX (torch.onnx.export, with the KV cache)")
        result = None
        try:
            _export_with_past(model, tmp / "model.onnx")
        except Exception as exc:  # a cache this wrapper cannot rebuild from tensors (hybrid, recurrent)
            log.warning("ONNX export with a KV cache failed (%s); exporting without one", exc)
        else:
            jobs.check(cancel)
            report(done=2, total=4, message="checking with onnxruntime against transformers")
            result = check(tmp / "model.onnx", model, tokenizer, cancel)
            if not agrees(result):
                log.warning("the ONNX graph with a KV cache does not match transformers; exporting without one")
                result = None
        if result is None:
            for leftover in tmp.iterdir():
                leftover.unlink()
            report(done=1, total=4, message="exporting to ONNX (torch.onnx.export, without a KV cache)")
            _export_logits_only(model, tmp / "model.onnx")
            jobs.check(cancel)
            report(done=2, total=4, message="checking with onnxruntime against transformers")
            result = check(tmp / "model.onnx", model, tokenizer, cancel)
        jobs.check(cancel)
        report(done=3, total=4, message="copying tokenizer, config and chat template")
        for name in SIDE_FILES:
            if (source / name).is_file():
                shutil.copy2(source / name, tmp / name)
        result["size_bytes"] = sum(p.stat().st_size for p in tmp.glob("model.onnx*"))
        params = sum(p.numel() for p in model.parameters())
        result["bits_per_weight"] = result["size_bytes"] * 8 / max(params, 1)
        result["path"] = str(output / "model.onnx")
        if not agrees(result):
            raise OnnxMismatch(
                f"the ONNX export of {source.name} does not match transformers: max |logit diff| "
                f"{result['onnx_max_abs_diff']:.3g} (limit {MAX_ABS_DIFF}), top-1 agreement "
                f"{result['top1_agreement']:.1%} (at least {MIN_TOP1:.0%} needed); nothing was written"
            )
    report(done=4, total=4, message="done")
    return result


def agrees(result: dict[str, Any]) -> bool:
    """Whether a check's numbers are within :data:`MAX_ABS_DIFF` and :data:`MIN_TOP1`."""
    return result["onnx_max_abs_diff"] <= MAX_ABS_DIFF and result["top1_agreement"] >= MIN_TOP1


class OnnxCausalLM:
    """An exported folder's ``model.onnx`` in onnxruntime (CPU): full-sequence logits and greedy decoding, with the
    KV cache when the graph has one."""

    def __init__(self, path: Path) -> None:
        import onnxruntime as ort

        self.session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        inputs = {i.name: i for i in self.session.get_inputs()}
        self.past = [name for name in inputs if name.startswith("past_key_values.")]
        self.kv_cache = bool(self.past)
        self.positions = "position_ids" in inputs
        self.cache_shape = tuple(inputs[self.past[0]].shape[1:]) if self.past else ()  # (kv heads, past, head dim)

    def run(self, ids: np.ndarray, mask: np.ndarray, past: list[np.ndarray] | None = None) -> list[np.ndarray]:
        """Logits (batch x sequence x vocab), then the new cache tensors (if any), for ``ids`` after ``past``."""
        feed: dict[str, np.ndarray] = {"input_ids": ids.astype(np.int64), "attention_mask": mask.astype(np.int64)}
        if self.kv_cache:
            if past is None:
                heads, _, dim = self.cache_shape
                past = [np.zeros((ids.shape[0], heads, 0, dim), np.float32) for _ in self.past]
            start = past[0].shape[2]
            feed.update(zip(self.past, past, strict=True))
        else:
            start = 0
        if self.positions:
            feed["position_ids"] = np.broadcast_to(np.arange(start, start + ids.shape[1]), ids.shape).astype(np.int64)
        return [np.asarray(x) for x in self.session.run(None, feed)]

    def logits(self, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
        """Logits of a whole batch (right-padded, mask 0 on the padding), no cache."""
        return self.run(ids, mask)[0]

    def greedy(self, ids: list[int], n: int, banned: list[int]) -> tuple[list[int], list[np.ndarray]]:
        """``n`` greedy tokens after ``ids`` (the cache carried between steps when the graph has one) and the
        last-position logits of each step."""
        tokens: list[int] = []
        rows: list[np.ndarray] = []
        seq, step, past = list(ids), list(ids), None
        for _ in range(n):
            x = np.asarray([step if self.kv_cache else seq])
            out = self.run(x, np.ones((1, len(seq)), np.int64), past)
            row = out[0][0, -1].astype(np.float32)
            rows.append(row.copy())
            row[banned] = -math.inf
            tokens.append(int(row.argmax()))
            seq.append(tokens[-1])
            step, past = [tokens[-1]], (out[1:] if self.kv_cache else None)
        return tokens, rows


def _torch_greedy(model: Any, ids: list[int], n: int, banned: list[int]) -> tuple[list[int], list[np.ndarray]]:
    import torch

    tokens: list[int] = []
    rows: list[np.ndarray] = []
    seq = list(ids)
    with torch.no_grad():
        for _ in range(n):
            row = model(torch.tensor([seq]), use_cache=False).logits[0, -1].float().numpy().copy()
            rows.append(row.copy())
            row[banned] = -math.inf
            tokens.append(int(row.argmax()))
            seq.append(tokens[-1])
    return tokens, rows


def check(path: Path, model: Any, tokenizer: Any, cancel: threading.Event) -> dict[str, Any]:
    """Compare the ONNX graph at ``path`` with the HF model: logits, top-1 and greedy agreement (see module doc)."""
    import torch

    onnx = OnnxCausalLM(path)
    eos = model.generation_config.eos_token_id
    banned = sorted({*(eos if isinstance(eos, list) else [eos]), tokenizer.eos_token_id} - {None})
    prompts = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]
    width = max(len(p) for p in prompts)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    batch_ids = np.asarray([p + [pad] * (width - len(p)) for p in prompts], dtype=np.int64)
    batch_mask = np.asarray([[1] * len(p) + [0] * (width - len(p)) for p in prompts], dtype=np.int64)
    batch = onnx.logits(batch_ids, batch_mask)
    max_diff, same, positions, agreement = 0.0, 0, 0, []
    for i, (prompt, ids) in enumerate(zip(PROMPTS, prompts, strict=True)):
        jobs.check(cancel)
        with torch.no_grad():
            want = model(torch.tensor([ids]), use_cache=False).logits[0].float().numpy()
        x = np.asarray([ids])
        for got in (onnx.logits(x, np.ones_like(x))[0], batch[i, : len(ids)]):
            max_diff = max(max_diff, float(np.abs(want - got).max()))
            same += int((want.argmax(-1) == got.argmax(-1)).sum())
            positions += len(ids)
        ref, ref_rows = _torch_greedy(model, ids, TOKENS, banned)
        got_tokens, got_rows = onnx.greedy(ids, TOKENS, banned)
        agreed = next((k for k, (a, b) in enumerate(zip(ref, got_tokens, strict=True)) if a != b), TOKENS)
        for k in range(min(agreed + 1, TOKENS)):  # the same inputs up to where they part: the cached steps too
            max_diff = max(max_diff, float(np.abs(ref_rows[k] - got_rows[k]).max()))
        margin = (
            float(ref_rows[agreed][ref[agreed]] - ref_rows[agreed][got_tokens[agreed]]) if agreed < TOKENS else None
        )
        agreement.append({"prompt": prompt, "agreed": agreed, "total": TOKENS, "margin": margin})
    return {
        "format": "onnx",
        "agreement": agreement,
        "prompts_identical": sum(a["agreed"] == a["total"] for a in agreement),
        "onnx_max_abs_diff": max_diff,
        "top1_agreement": same / max(positions, 1),
        "kv_cache": onnx.kv_cache,
        "provider": "CPUExecutionProvider",
    }
