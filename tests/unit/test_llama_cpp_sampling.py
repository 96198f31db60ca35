"""llama.cpp's samplers on hand-made candidates: what the chain leaves is read from where llama.cpp left it."""

from __future__ import annotations

import ctypes
import math

import llama_cpp
import numpy as np

from modules.loaders.llama_cpp_sampling import _TOKEN_DATA, _surviving


def candidates(probs: list[float]) -> tuple[np.ndarray, llama_cpp.llama_token_data_array]:
    cand = np.empty(len(probs), dtype=_TOKEN_DATA)
    cand["id"] = np.arange(len(probs), dtype=np.intc)
    cand["logit"] = np.log(np.asarray(probs, dtype=np.float64))
    cand["p"] = 0.0
    array = llama_cpp.llama_token_data_array(
        data=cand.ctypes.data_as(llama_cpp.llama_token_data_p), size=len(probs), selected=-1, sorted=False
    )
    return cand, array


def test_xtc_survivors_are_read_past_the_moved_start() -> None:
    # XTC drops every token above the threshold but the least likely of them by moving the array's start
    probs = [0.05, 0.4, 0.1, 0.3, 0.15]
    cand, array = candidates(probs)
    xtc = llama_cpp.llama_sampler_init_xtc(1.0, 0.12, 1, 7)
    try:
        llama_cpp.llama_sampler_apply(xtc, ctypes.byref(array))
    finally:
        llama_cpp.llama_sampler_free(xtc)
    kept = _surviving(cand, array.data, int(array.size))
    assert sorted(kept["id"].tolist()) == [0, 2, 4]  # 0.4 and 0.3 dropped; 0.15 (the last above 0.12) kept
    assert math.isclose(float(kept["p"][kept["id"] == 4][0]), 0.15, rel_tol=1e-5)


def test_survivors_from_the_array_start_when_nothing_moved() -> None:
    cand, array = candidates([0.5, 0.2, 0.3])
    top_k = llama_cpp.llama_sampler_init_top_k(2)
    try:
        llama_cpp.llama_sampler_apply(top_k, ctypes.byref(array))
    finally:
        llama_cpp.llama_sampler_free(top_k)
    assert sorted(_surviving(cand, array.data, int(array.size))["id"].tolist()) == [0, 2]
