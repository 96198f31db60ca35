"""libgomp's wait policy: set by the package before torch or llama.cpp load it, and never over the user's own."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROBE = "import modules, llama_cpp, torch; torch.ones(100000).sum()"  # libgomp reads its settings when it loads


def openmp_settings(**env: str) -> str:
    clean = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    done = subprocess.run(
        [sys.executable, "-c", PROBE],
        cwd=ROOT,
        env={**clean, "OMP_DISPLAY_ENV": "VERBOSE", **env},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return done.stderr


def test_importing_the_package_keeps_libgomp_spinning_when_threads_outnumber_cores() -> None:
    # a second thread with an OpenMP team (an embeddings request) otherwise slowed llama.cpp ~3x for good
    shown = openmp_settings()
    assert "OMP_WAIT_POLICY = 'ACTIVE'" in shown and "GOMP_SPINCOUNT = '300000'" in shown


def test_the_user_s_own_setting_wins() -> None:
    shown = openmp_settings(OMP_WAIT_POLICY="PASSIVE")
    assert "OMP_WAIT_POLICY = 'PASSIVE'" in shown and "GOMP_SPINCOUNT = '300000'" not in shown
