"""The script in docs/python-api.md runs as written, and Workbench.report() tells what was loaded and made."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT, hf_default_model

pytestmark = pytest.mark.slow


def test_the_documented_script_runs(tmp_path: Path) -> None:
    hf_default_model()  # the HF copy the script loads
    page = (ROOT / "docs" / "python-api.md").read_text(encoding="utf-8")
    script = re.search(r"## A complete script.*?```python\n(.*?)```", page, re.S)
    assert script, "docs/python-api.md has no script"
    path = tmp_path / "script.py"
    path.write_text(script[1])
    env = {
        "PATH": "/usr/bin:/bin",
        "HF_HUB_OFFLINE": "1",
        "PYTHONPATH": str(ROOT),
        "HOME": str(tmp_path),
        "TMPDIR": str(tmp_path),
    }
    done = subprocess.run([sys.executable, str(path)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    assert "Paris" in out
    ppl = float(re.search(r"perplexity: ([\d.]+)", out)[1])  # type: ignore[index]
    assert 3 < ppl < 200
    assert "'loader': 'transformers'" in out and "hello.Q8_0.gguf" in out and "merged" in out
