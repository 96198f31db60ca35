"""The AMX guard's decisions and the setup smoke test's report when the engine dies (no model needed)."""

from __future__ import annotations

import sys

from modules.loaders import llama_cpp_check as check

# What llama_print_system_info() says for a native build on a Sapphire Rapids machine (llama-cpp-python 0.3.36).
AMX_BUILD = (
    "CPU : SSE3 = 1 | SSSE3 = 1 | AVX = 1 | AVX_VNNI = 1 | AVX2 = 1 | F16C = 1 | FMA = 1 | BMI2 = 1 | AVX512 = 1 | "
    "AVX512_VBMI = 1 | AVX512_VNNI = 1 | AVX512_BF16 = 1 | AMX_INT8 = 1 | LLAMAFILE = 1 | OPENMP = 1 | REPACK = 1 | "
)
PLAIN_BUILD = AMX_BUILD.replace("AMX_INT8 = 1 | ", "")


def test_system_info_is_parsed_into_features() -> None:
    features = check.parse_system_info(AMX_BUILD)
    assert features["AVX512_VNNI"] == "1" and features["AMX_INT8"] == "1" and features["REPACK"] == "1"
    assert "CPU" not in features and len(features) == 16
    assert check.build_has_amx(features) and not check.build_has_amx(check.parse_system_info(PLAIN_BUILD))


def test_extra_buffers_are_off_only_for_an_amx_build_without_the_flag() -> None:
    amx, plain = check.parse_system_info(AMX_BUILD), check.parse_system_info(PLAIN_BUILD)
    assert check.extra_buffers_allowed(False, amx) is False  # the AMX buffer would crash: no extra buffers
    assert check.extra_buffers_allowed(True, amx) is True  # --amx: the user says AMX works here
    assert check.extra_buffers_allowed(False, plain) is True  # no AMX path: the repack buffers stay (no slowdown)


def test_the_real_build_reports_its_features() -> None:
    features = check.build_features()
    assert features, "llama_print_system_info() gave nothing"
    assert all(value in ("0", "1") or value.isdigit() for value in features.values())
    # the Makefile builds without llamafile's tinyBLAS, so a token's logits do not depend on its batch
    assert check.batch_invariant(features) and "LLAMAFILE" not in features


def test_a_build_with_tinyblas_is_not_batch_invariant() -> None:
    assert not check.batch_invariant(check.parse_system_info(PLAIN_BUILD))
    assert check.batch_invariant(check.parse_system_info(PLAIN_BUILD.replace("LLAMAFILE = 1 | ", "")))


def test_a_child_that_segfaults_is_reported_with_its_stack_and_what_to_try() -> None:
    crash = [
        sys.executable,
        "-X",
        "faulthandler",
        "-c",
        "print('loading m.gguf', flush=True); import ctypes; ctypes.string_at(0)",
    ]
    passed, report = check.smoke(crash)
    assert not passed
    assert "was killed by SIGSEGV" in report
    assert "Fatal Python error: Segmentation fault" in report  # faulthandler's stack reached the user
    assert "loading m.gguf" in report
    assert "What to try:" in report and check.DOCS in report and "make llama-cpp" in report


def test_a_child_that_hangs_is_stopped_and_reported() -> None:
    passed, report = check.smoke([sys.executable, "-c", "import time; time.sleep(30)"], timeout=1)
    assert not passed and "did not answer within 1 s" in report


def test_advice_names_the_amx_rebuild_only_for_an_amx_build() -> None:
    amx = check.advice(check.parse_system_info(AMX_BUILD), {"amx_tile", "amx_int8"})
    plain = check.advice(check.parse_system_info(PLAIN_BUILD), {"avx2"})
    assert "AMX path and this CPU reports AMX" in amx[0]
    assert not any("AMX path" in tip for tip in plain)


def test_how_it_died() -> None:
    assert check.how_it_died(-11) == "was killed by SIGSEGV (Segmentation fault)"
    assert check.how_it_died(-4).startswith("was killed by SIGILL")
    assert check.how_it_died(3) == "exited with status 3"
