"""Two processes that want the default model's HF copy at once: one makes it, the other waits and uses it."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO

from filelock import FileLock

from modules.lifecycle.default_model import HF_FOLDER

ROOT = Path(__file__).resolve().parents[2]


def test_a_second_process_waits_for_the_copy_the_first_is_making(tmp_path: Path) -> None:
    models = tmp_path / "models"
    models.mkdir()
    lock_path = models / ".default-model.lock"
    code = "import logging, sys; from pathlib import Path; from modules.lifecycle.default_model import make_hf_folder; "
    code += "logging.basicConfig(level=logging.DEBUG); print(make_hf_folder(Path(sys.argv[1])))"
    waiting = threading.Event()  # filelock says so in its debug log while it retries
    ended = threading.Event()
    err: list[str] = []

    def read(stream: IO[str]) -> None:
        for line in stream:
            err.append(line)
            if "not acquired" in line and str(lock_path) in line:
                waiting.set()
        ended.set()  # the child ended (or closed stderr) without waiting: no need to wait the whole minute

    with FileLock(str(lock_path)):  # this test is the first process, making the copy
        child = subprocess.Popen(
            [sys.executable, "-c", code, str(models)],
            cwd=ROOT,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        assert child.stderr is not None
        reader = threading.Thread(target=read, args=(child.stderr,), daemon=True)
        reader.start()
        deadline = time.monotonic() + 60
        while not waiting.is_set() and not ended.is_set() and time.monotonic() < deadline:
            waiting.wait(0.1)
        waited = waiting.is_set()
        folder = models / HF_FOLDER  # what the first process writes while the second waits
        folder.mkdir(exist_ok=True)
        (folder / "config.json").write_text('{"made_by": "the first process"}')
        (folder / "model.safetensors").write_bytes(b"")
    try:
        child.wait(60)
    finally:
        child.kill()  # a no-op once it has ended
    assert child.stdout is not None
    out = child.stdout.read()
    reader.join(10)
    assert waited, f"the second process did not wait for the first: {''.join(err)[-2000:]}"
    assert child.returncode == 0, "".join(err)[-2000:]
    assert out.strip() == str(folder)
    assert "the first process" in (folder / "config.json").read_text()  # used, not made again over it
    assert sorted(p.name for p in models.iterdir()) == [".default-model.lock", HF_FOLDER]
