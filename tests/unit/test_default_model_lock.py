"""Two processes that want the default model's HF copy at once: one makes it, the other waits and uses it."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from filelock import FileLock

from modules.lifecycle.default_model import HF_FOLDER

ROOT = Path(__file__).resolve().parents[2]


def _holds(pid: int, path: Path) -> bool:
    try:
        return any(os.readlink(fd) == str(path) for fd in Path(f"/proc/{pid}/fd").iterdir())
    except OSError:
        return False


def test_a_second_process_waits_for_the_copy_the_first_is_making(tmp_path: Path) -> None:
    models = tmp_path / "models"
    models.mkdir()
    lock_path = models / ".default-model.lock"
    code = "import sys; from pathlib import Path; from modules.lifecycle.default_model import make_hf_folder; "
    code += "print(make_hf_folder(Path(sys.argv[1])))"
    with FileLock(str(lock_path)):  # this test is the first process, making the copy
        child = subprocess.Popen(
            [sys.executable, "-c", code, str(models)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        deadline = time.monotonic() + 60
        while not _holds(child.pid, lock_path) and child.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        waiting = _holds(child.pid, lock_path) and child.poll() is None
        folder = models / HF_FOLDER  # what the first process writes while the second waits
        folder.mkdir(exist_ok=True)
        (folder / "config.json").write_text('{"made_by": "the first process"}')
        (folder / "model.safetensors").write_bytes(b"")
    out, err = child.communicate(timeout=60)
    assert waiting, f"the second process did not wait for the first: {err.decode()[-2000:]}"
    assert child.returncode == 0, err.decode()[-2000:]
    assert out.decode().strip() == str(folder)
    assert "the first process" in (folder / "config.json").read_text()  # used, not made again over it
    assert sorted(p.name for p in models.iterdir()) == [".default-model.lock", HF_FOLDER]
