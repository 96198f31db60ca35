"""Memory in use: this process, the machine, and CUDA devices when torch has them."""

from __future__ import annotations

import os
import sys

import psutil


def memory_text() -> str:
    """One line: process RSS, system RAM in use, and VRAM per CUDA device (when torch is loaded with CUDA)."""
    process = psutil.Process(os.getpid()).memory_info().rss
    system = psutil.virtual_memory()
    parts = [
        f"RAM: this process {process / 2**30:.2f} GiB",
        f"system {system.used / 2**30:.1f} / {system.total / 2**30:.1f} GiB",
    ]
    torch = sys.modules.get("torch")
    if torch is not None:
        try:
            if torch.cuda.is_available():
                for i in range(torch.cuda.device_count()):
                    used = torch.cuda.memory_allocated(i)
                    total = torch.cuda.get_device_properties(i).total_memory
                    parts.append(f"GPU {i}: {used / 2**30:.2f} / {total / 2**30:.1f} GiB")
        except RuntimeError:
            pass
    return " | ".join(parts)
