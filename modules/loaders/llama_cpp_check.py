"""Can this llama.cpp build run on this CPU: the AMX guard, and the engine smoke test that setup runs.

llama.cpp's AMX matrix path (Intel Sapphire Rapids and newer) crashes with a general protection fault in
``ldtilecfg`` on many such machines and VMs (ggml-org/llama.cpp#20824). Our Makefile builds the engine without it;
for a build that has it anyway (a wheel from elsewhere, an old pip cache), :func:`extra_buffers_allowed` keeps
llama.cpp from placing weights in the AMX buffer unless ``--amx`` asks for it.

``python -m modules.loaders.llama_cpp_check [MODEL]`` loads the model (default: the embedded one) in a child
process and generates a few greedy tokens; if the child dies, it says how and what to try, and exits 1.
"""

from __future__ import annotations

import argparse
import functools
import logging
import platform
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

log = logging.getLogger(__name__)

SMOKE_PROMPT = "The capital of France is"
SMOKE_TOKENS = 8
SMOKE_TIMEOUT_S = 180.0
DOCS = "docs/troubleshooting.md"


@functools.cache
def build_features() -> dict[str, str]:
    """The CPU features the loaded llama.cpp library was compiled with, from ``llama_print_system_info``."""
    import llama_cpp

    return parse_system_info(llama_cpp.llama_print_system_info().decode("utf-8", "replace"))


def parse_system_info(text: str) -> dict[str, str]:
    """``"CPU : SSE3 = 1 | AMX_INT8 = 1 | ..."`` -> ``{"SSE3": "1", "AMX_INT8": "1", ...}``."""
    features: dict[str, str] = {}
    for part in text.replace(":", "|").split("|"):
        name, sep, value = part.partition("=")
        if sep:
            features[name.strip()] = value.strip()
    return features


def cpu_flags() -> set[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.partition(":")[2].split())
    return set()


def cpu_model() -> str:
    """The CPU's model name, as /proc/cpuinfo or the platform module says."""
    try:
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace").splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def build_has_amx(features: dict[str, str] | None = None) -> bool:
    """Whether the llama.cpp library was compiled with its AMX matrix path."""
    features = build_features() if features is None else features
    return features.get("AMX_INT8") == "1"


def batch_invariant(features: dict[str, str] | None = None) -> bool:
    """Whether a token's logits are the same however many tokens share its step: true for builds without
    llamafile's tinyBLAS (the Makefile's), which multiplies batches of two or more tokens another way than one.

    With it, batched and speculative decoding still sample exactly by the model's logits, but those logits differ
    from a lone one-token step's in the last bits, so greedy output may part from plain decoding at a near-tie."""
    features = build_features() if features is None else features
    return features.get("LLAMAFILE") != "1"


def extra_buffers_allowed(amx: bool, features: dict[str, str] | None = None) -> bool:
    """``use_extra_bufts`` for a model load: off where the build has AMX and ``--amx`` was not given.

    Extra buffer types are where llama.cpp repacks weights for faster kernels (AMX, and the CPU repack of Q4_0,
    IQ4_NL, ...). A build without AMX keeps them all; a build with AMX loses the repack too, which is the price of
    not crashing. ``--amx`` turns them back on for machines where AMX works.
    """
    if amx or not build_has_amx(features):
        return True
    log.warning(
        "This llama.cpp build has the AMX matrix path, which crashes on many machines: it is off, and with it the "
        "repacked weight buffers (--amx turns it on; `make llama-cpp` rebuilds without AMX; see %s)",
        DOCS,
    )
    return False


# ---------------------------------------------------------------- the smoke test
def _child(model: Path) -> int:
    """Load ``model`` the way the server does and print a short greedy completion and its speed."""
    import faulthandler
    import threading

    faulthandler.enable(all_threads=True)
    from modules.generation.params import GenerationParams
    from modules.loaders.llama_cpp import LlamaCppBackend

    print(f"loading {model.name}", flush=True)
    backend = LlamaCppBackend.load(model, {"n_ctx": 512, "parallel": 1})
    try:
        print(f"extra buffers: {backend.extra_buffers}", flush=True)
        ids = backend.encode(SMOKE_PROMPT)
        started = time.perf_counter()
        params = GenerationParams(temperature=0, max_new_tokens=SMOKE_TOKENS)
        pieces = [e.piece for e in backend.generate(ids, params, threading.Event()) if e.token_id >= 0]
        seconds = time.perf_counter() - started
        text = b"".join(pieces).decode("utf-8", "replace")
        print(f"answer: {' '.join((SMOKE_PROMPT + text).split())!r}", flush=True)
        print(f"speed: {len(pieces)} tokens in {seconds:.2f} s, prompt included", flush=True)
    finally:
        backend.unload()
    return 0


def child_command(model: Path) -> list[str]:
    """The command that runs the smoke test's child process."""
    return [sys.executable, "-X", "faulthandler", "-m", "modules.loaders.llama_cpp_check", "--child", str(model)]


def how_it_died(returncode: int) -> str:
    """'killed by SIGSEGV (segmentation fault)' for a negative return code, 'exited with 3' otherwise."""
    if returncode < 0:
        try:
            sig = signal.Signals(-returncode)
            return f"was killed by {sig.name} ({signal.strsignal(sig) or 'signal'})"
        except ValueError:
            return f"was killed by signal {-returncode}"
    return f"exited with status {returncode}"


def advice(features: dict[str, str] | None, flags: set[str]) -> list[str]:
    """What to try, for this build on this CPU."""
    tips: list[str] = []
    cpu_amx = "amx_tile" in flags
    if features is not None and build_has_amx(features):
        tips.append(
            "This llama.cpp build has the AMX path"
            + (" and this CPU reports AMX" if cpu_amx else "")
            + ": rebuild without it with `make llama-cpp` (the Makefile adds -mno-amx-* on x86-64)."
        )
    tips += [
        "If you set CMAKE_ARGS yourself (CUDA, Vulkan, ...), try once without them: `CMAKE_ARGS= make llama-cpp`.",
        'A portable build that picks CPU kernels at run time: `CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_BACKEND_DL=ON '
        '-DGGML_CPU_ALL_VARIANTS=ON" make llama-cpp` (slower to compile).',
        f"More in {DOCS}.",
    ]
    return tips


def smoke(command: Sequence[str], timeout: float = SMOKE_TIMEOUT_S) -> tuple[bool, str]:
    """Run the smoke test's child; (passed, a report for the user)."""
    try:
        done = subprocess.run(list(command), capture_output=True, text=True, timeout=timeout, errors="replace")
    except subprocess.TimeoutExpired as exc:
        out = (exc.stdout or "") if isinstance(exc.stdout, str) else ""
        return False, _failure(f"did not answer within {timeout:.0f} s", out, "")
    if done.returncode == 0:
        lines = [line for line in done.stdout.splitlines() if line.startswith(("answer:", "speed:"))]
        return True, "llama.cpp engine OK: " + "; ".join(line.partition(": ")[2] for line in lines)
    return False, _failure(how_it_died(done.returncode), done.stdout, done.stderr)


def _failure(what: str, stdout: str, stderr: str) -> str:
    try:
        features: dict[str, str] | None = build_features()
    except Exception:  # the library itself may be what fails to load
        features = None
    flags = cpu_flags()
    amx_flags = sorted(f for f in flags if f.startswith("amx"))
    built = ", ".join(f"{k}" for k, v in (features or {}).items() if v == "1" and k.isupper()) or "unknown"
    tail = [line for line in (stdout + "\n" + stderr).strip().splitlines() if line.strip()][-25:]
    lines = [
        f"The llama.cpp engine failed its smoke test: the child process {what}.",
        f"CPU: {cpu_model()}" + (f" ({' '.join(amx_flags)})" if amx_flags else ""),
        f"llama.cpp build features: {built}",
        "Last output of the child:",
        *("    " + line for line in tail),
        "What to try:",
        *("  - " + tip for tip in advice(features, flags)),
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """The command line: the smoke test (parent), or its child with ``--child``."""
    parser = argparse.ArgumentParser(prog="python -m modules.loaders.llama_cpp_check", description=__doc__)
    parser.add_argument("model", nargs="?", type=Path, help="GGUF file (default: the embedded default model)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.model is None:
        from modules.paths import packaged_model

        args.model = packaged_model()
    if args.child:
        return _child(args.model)
    passed, report = smoke(child_command(args.model))
    print(report, file=sys.stdout if passed else sys.stderr)
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
