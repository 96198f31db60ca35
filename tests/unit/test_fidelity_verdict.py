"""When an exported GGUF is refused: the verdict on a fidelity report, and the memory plan for the fp32 HF copy
(the check itself runs on real files in tests/integration/test_export.py)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

from modules.lifecycle import fidelity


def agreement(*margins: float | None) -> list[dict]:
    return [{"prompt": "p", "agreed": 32 if m is None else 5, "total": 32, "margin": m} for m in margins]


def test_a_near_tie_passes_a_sure_parting_does_not() -> None:
    assert fidelity.verdict({"agreement": agreement(None, None, 0.02, None, 0.01)}, "F16") == ""
    assert "1 of 5 prompts" in fidelity.verdict({"agreement": agreement(None, 2.1, None, None, None)}, "F16")
    assert "1 of 5" in fidelity.verdict({"agreement": agreement(None, 2.1, None, None, None)}, "bf16")
    # a quantized file may part for real on a few prompts; on most, it is another model
    assert fidelity.verdict({"agreement": agreement(None, 2.1, 1.0, None, None)}, "Q4_K_M") == ""
    assert "3 of 5" in fidelity.verdict({"agreement": agreement(2.3, 2.1, 1.0, None, None)}, "Q4_K_M")


def test_a_gguf_reply_that_ended_early_is_not_an_agreement() -> None:
    early = [{"prompt": "p", "agreed": 7, "total": 32, "margin": None}]  # nothing to compare after token 7
    assert "token 7 (it ended)" in fidelity.verdict({"agreement": early + agreement(None)}, "F16")


def test_a_tokenizer_that_splits_otherwise_is_refused() -> None:
    report = {"agreement": agreement(None, None), "tokenizer_mismatch": ["List three fruits."]}
    assert "tokenizer splits 1 prompt(s) differently" in fidelity.verdict(report, "Q8_0")


def test_the_fp32_copy_is_planned_against_the_free_ram(tmp_path: Path) -> None:
    header = json.dumps({"w": {"dtype": "BF16", "shape": [1000, 1000], "data_offsets": [0, 2_000_000]}}).encode()
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + bytes(2_000_000))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(bytes(1000))
    assert fidelity.hf_fits(tmp_path, gguf, available=10**9) == ""
    why = fidelity.hf_fits(tmp_path, gguf, available=3_000_000)  # 4 MB of fp32 weights do not fit in 2.55 MB
    assert "fp32 copy" in why and "free" in why
