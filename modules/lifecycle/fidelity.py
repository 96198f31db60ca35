"""Proof that an exported GGUF is the same model: greedy agreement with the HF source, and PPL / KLD against F16.

Greedy agreement: the same prompt token ids go to transformers (float32) and to llama.cpp (the GGUF, through
:class:`LlamaCppBackend`, so the AMX guard applies); both pick the most likely token 32 times with end-of-text
banned. Where they part, the HF model's logit margin between its choice and llama.cpp's says whether it was a
near-tie (rounding) or a real difference. For quantized files, perplexity on :data:`FIDELITY_TEXT` (shipped in the
repo) and the mean KL divergence of the next-token distributions against the F16 file measure what was lost.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from modules.errors import TextgenError

FIDELITY_TEXT = Path(__file__).with_name("data") / "fidelity.txt"
PROMPTS = (
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
    "The history of the printing press begins",
    "def fibonacci(n):\n",
    "<|im_start|>user\nList three fruits.<|im_end|>\n<|im_start|>assistant\n",
    "Once upon a time, in a small village by the sea,",
)
TOKENS = 32
TEXT_TOKENS = 384  # tokens of FIDELITY_TEXT scored (enough for a stable ratio, quick on CPU)
# Where greedy outputs part, the HF model's logit margin between its token and llama.cpp's: a rounding near-tie is
# small (SmolLM2-135M: 0.01-0.02 for F16 and Q4_1 alike, on AMD EPYC and Intel Xeon), a conversion that computes
# another function is not (the same model converted with a wrong activation: 1.2-3.0 on every prompt).
REAL_MARGIN = 0.5
LOSSLESS = ("F32", "F16", "BF16")
HF_FP32_SHARE = 0.85  # of the available RAM the fp32 HF copy may take beside the GGUF


class FidelityFailed(TextgenError):
    """The exported file is not the model it came from (numbers in the message); nothing was kept."""


@dataclass
class PromptAgreement:
    """One prompt's greedy comparison."""

    prompt: str
    agreed: int  # leading tokens that are the same
    total: int
    margin: float | None = None  # HF logit(its token) - logit(llama.cpp's token) where they part; None if equal

    @property
    def identical(self) -> bool:
        """Whether all compared tokens agree."""
        return self.agreed == self.total


@dataclass
class FidelityReport:
    """What export says about a GGUF file (numbers a user can check)."""

    path: str
    size_bytes: int = 0
    bits_per_weight: float = 0.0
    agreement: list[PromptAgreement] = field(default_factory=list)
    perplexity: float | None = None
    kld: float | None = None  # mean KL(F16 || this), nats per token
    top1_same: float | None = None  # share of positions where this file's top token is F16's
    tokens_per_s: float | None = None
    seconds: float = 0.0
    tokenizer_mismatch: list[str] = field(default_factory=list)  # prompts the two tokenizers split differently
    hf_skipped: str = ""  # why there is no comparison with the HF model (its fp32 copy would not fit in RAM)

    @property
    def prompts_identical(self) -> int:
        """How many prompts agree on every compared token."""
        return sum(a.identical for a in self.agreement)

    def to_dict(self) -> dict[str, Any]:
        """Plain data (JSON, the UI table)."""
        data = asdict(self)
        data["prompts_identical"] = self.prompts_identical
        return data

    def summary(self) -> str:
        """One line for the CLI and the UI."""
        parts = [f"{Path(self.path).name}: {self.size_bytes / 1e6:.1f} MB, {self.bits_per_weight:.2f} bpw"]
        if self.tokenizer_mismatch:
            parts.append(f"the tokenizers differ on {len(self.tokenizer_mismatch)} prompt(s)")
        if self.agreement:
            parts.append(f"greedy agreement {self.prompts_identical}/{len(self.agreement)} prompts")
        if self.hf_skipped:
            parts.append(f"no comparison with the HF model: {self.hf_skipped}")
        if self.perplexity is not None:
            parts.append(f"PPL {self.perplexity:.3f}")
        if self.kld is not None:
            parts.append(f"KLD vs F16 {self.kld:.5f}")
        if self.tokens_per_s is not None:
            parts.append(f"{self.tokens_per_s:.1f} tok/s")
        return ", ".join(parts)


def load_gguf(path: Path, n_ctx: int = 1024) -> Any:
    """The GGUF in our llama.cpp backend (one slot, the AMX guard applied)."""
    from modules.loaders.llama_cpp import LlamaCppBackend

    return LlamaCppBackend.load(Path(path), {"n_ctx": n_ctx, "parallel": 1})


def _gguf_greedy(backend: Any, ids: list[int], n: int, banned: list[int] | None = None) -> tuple[list[int], float]:
    from modules.generation.params import GenerationParams

    # -100 bans: the HF side's end tokens too, so both sides ban the same set
    bias = {token: -100.0 for token in banned or []}
    params = GenerationParams(temperature=0, max_new_tokens=n, ban_eos=True, seed=0, logit_bias=bias)
    start = time.perf_counter()
    out = [e.token_id for e in backend.generate(ids, params, threading.Event()) if e.token_id >= 0]
    return out, len(out) / max(time.perf_counter() - start, 1e-9)


def _hf_greedy(model: Any, ids: list[int], n: int, banned: list[int]) -> tuple[list[int], list[Any]]:
    import torch

    tokens: list[int] = []
    rows: list[Any] = []
    with torch.no_grad():
        out = model(torch.tensor([ids]), use_cache=True)
        for _ in range(n):
            logits = out.logits[0, -1].float()
            logits[banned] = -math.inf
            token = int(torch.argmax(logits))
            tokens.append(token)
            rows.append(logits)
            out = model(torch.tensor([[token]]), past_key_values=out.past_key_values, use_cache=True)
    return tokens, rows


def load_hf(source: Path) -> tuple[Any, Any]:
    """The HF model in float32 on CPU, and its tokenizer (no network)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(source), dtype=torch.float32, local_files_only=True)
    return model.eval(), AutoTokenizer.from_pretrained(str(source), local_files_only=True)


def hf_fits(source: Path, gguf: Path, available: int | None = None) -> str:
    """Why the HF model's fp32 copy cannot be loaded beside the GGUF here ("" when it can): parameters from the
    safetensors headers, 4 bytes each, plus the GGUF file, against the available RAM."""
    import psutil

    from modules.lifecycle.memory import count_from_safetensors

    files = sorted(Path(source).glob("*.safetensors"))
    if not files:
        return ""
    params = count_from_safetensors(files)[0].total
    need = params * 4 + Path(gguf).stat().st_size
    have = int((psutil.virtual_memory().available if available is None else available) * HF_FP32_SHARE)
    if need <= have:
        return ""
    return f"its fp32 copy and the file need {need / 2**30:.1f} GiB, {have / 2**30:.1f} GiB of RAM is free"


def greedy_agreement(
    hf: tuple[Any, Any], backend: Any, prompts: tuple[str, ...] = PROMPTS, n: int = TOKENS
) -> tuple[list[PromptAgreement], float, list[str]]:
    """Compare greedy continuations of an HF model and a loaded GGUF, each prompt split by each side's own
    tokenizer; also returns llama.cpp's tokens/s and the prompts the two tokenizers split differently (a tokenizer
    conversion bug: those are compared from llama.cpp's split)."""
    model, tokenizer = hf
    eos = model.generation_config.eos_token_id
    gguf_eog = list(getattr(backend.metadata, "eos_token_ids", None) or [])  # llama.cpp's end-of-generation set
    banned = sorted({*(eos if isinstance(eos, list) else [eos]), tokenizer.eos_token_id, *gguf_eog} - {None})
    results, speeds, mismatched = [], [], []
    for prompt in prompts:
        ids = backend.encode(prompt, add_special=False)
        if list(tokenizer(prompt, add_special_tokens=False).input_ids) != list(ids):
            mismatched.append(prompt)
        got, speed = _gguf_greedy(backend, ids, n, banned)
        speeds.append(speed)
        want, rows = _hf_greedy(model, ids, n, banned)
        agreed = next((i for i, (a, b) in enumerate(zip(want, got, strict=False)) if a != b), min(len(want), len(got)))
        margin = None
        if agreed < min(len(want), len(got)):
            row = rows[agreed]
            margin = float(row[want[agreed]] - row[got[agreed]])
        results.append(PromptAgreement(prompt=prompt, agreed=agreed, total=n, margin=margin))
    return results, float(np.median(speeds)) if speeds else 0.0, mismatched


def verdict(report: dict[str, Any], quant: str) -> str:
    """Why an exported file must not be used ("" when it may): the tokenizers split a prompt differently; a lossless
    type (F32, F16, BF16) parts from the HF model where the HF model was sure (margin above REAL_MARGIN) on any
    prompt; a quantized one does so on most prompts. A quantized file's own loss (PPL, KLD) is reported, not judged."""
    problems = []
    if report.get("tokenizer_mismatch"):
        problems.append(f"the GGUF's tokenizer splits {len(report['tokenizer_mismatch'])} prompt(s) differently")
    agreement = report.get("agreement") or []
    # a parting where the HF model was sure, or a GGUF reply that ended early (no token to compare: not judged
    # by a margin, but not an agreement either)
    real = [a for a in agreement if (a.get("margin") is not None and a["margin"] > REAL_MARGIN)
            or (a.get("margin") is None and a.get("agreed", 0) < a.get("total", 0))]  # fmt: skip
    allowed = 0 if quant.upper() in LOSSLESS else len(report.get("agreement") or []) // 2
    if len(real) > allowed:
        where = ", ".join(
            f"token {a['agreed']} " + (f"(margin {a['margin']:.2f})" if a.get("margin") is not None else "(it ended)")
            for a in real
        )
        problems.append(
            f"it parts from the HF model where that model was sure on {len(real)} of "
            f"{len(report['agreement'])} prompts: {where}"
        )
    return "; ".join(problems)


def text_ids(backend: Any, limit: int = TEXT_TOKENS) -> list[int]:
    """The fidelity text's token ids (BOS if the model uses one), cut to ``limit``."""
    return list(backend.encode(FIDELITY_TEXT.read_text(encoding="utf-8"), add_special=True))[:limit]


def logprob_rows(backend: Any, ids: list[int]) -> np.ndarray:
    """Next-token log-probabilities at every position of ``ids`` (shape: len-1 x vocab, float32)."""
    rows = backend._log_softmax_rows(ids, set(range(len(ids) - 1)))  # the backend's scoring context
    return np.stack([rows[i].astype(np.float32) for i in range(len(ids) - 1)])


def perplexity(rows: np.ndarray, ids: list[int]) -> float:
    """exp(mean negative log-likelihood of each next token)."""
    picked = rows[np.arange(len(ids) - 1), np.asarray(ids[1:])]
    return float(math.exp(-float(picked.astype(np.float64).mean())))


def kl_divergence(reference: np.ndarray, rows: np.ndarray) -> tuple[float, float]:
    """Mean KL(reference || rows) over positions, and the share of positions with the same top token."""
    ref = reference.astype(np.float64)
    kld = (np.exp(ref) * (ref - rows.astype(np.float64))).sum(axis=1)
    same = float((reference.argmax(axis=1) == rows.argmax(axis=1)).mean())
    return float(kld.mean()), same


def reference(path: Path) -> tuple[list[int], np.ndarray]:
    """The fidelity text's ids and next-token log-probabilities under a GGUF (the F16 file, for KLD)."""
    backend = load_gguf(path)
    try:
        ids = text_ids(backend)
        return ids, logprob_rows(backend, ids)
    finally:
        backend.unload()


def summary(data: dict[str, Any]) -> str:
    """:meth:`FidelityReport.summary` of a report's dict."""
    fields = {k: v for k, v in data.items() if k in FidelityReport.__dataclass_fields__}
    fields["agreement"] = [PromptAgreement(**a) for a in data.get("agreement") or []]
    text = FidelityReport(**fields).summary()
    if data.get("onnx_max_abs_diff") is not None:  # an ONNX export's check (modules/lifecycle/onnx_export.py)
        text += f", max |logit diff| vs transformers {data['onnx_max_abs_diff']:.2e}"
        text += f", top-1 agreement {data['top1_agreement']:.1%}" + ("" if data.get("kv_cache") else " (no KV cache)")
    return text


def check_gguf(
    path: Path,
    hf_source: Path | None = None,
    reference: tuple[list[int], np.ndarray] | None = None,
    prompts: tuple[str, ...] = PROMPTS,
    n: int = TOKENS,
    hf: tuple[Any, Any] | None = None,
) -> tuple[FidelityReport, tuple[list[int], np.ndarray]]:
    """Measure one GGUF: greedy agreement with ``hf_source`` (if given), PPL, KLD against ``reference`` (the F16
    file's ids and rows, if given). Returns the report and this file's (ids, rows), a reference for the next."""
    from modules.lifecycle.quantize import bits_per_weight

    start = time.perf_counter()
    path = Path(path)
    report = FidelityReport(path=str(path), size_bytes=path.stat().st_size, bits_per_weight=bits_per_weight(path))
    if hf is None and hf_source is not None:
        report.hf_skipped = hf_fits(hf_source, path)
    backend = load_gguf(path)
    try:
        if hf is None and hf_source is not None and not report.hf_skipped:
            hf = load_hf(hf_source)
        if hf is not None:
            report.agreement, report.tokens_per_s, report.tokenizer_mismatch = greedy_agreement(hf, backend, prompts, n)
        else:
            _, report.tokens_per_s = _gguf_greedy(backend, backend.encode(prompts[0], add_special=False), n)
        ids = reference[0] if reference is not None else text_ids(backend)
        rows = logprob_rows(backend, ids)
    finally:
        backend.unload()
    report.perplexity = perplexity(rows, ids)
    if reference is not None:
        report.kld, report.top1_same = kl_divergence(reference[1], rows)
    report.seconds = time.perf_counter() - start
    return report, (ids, rows)
