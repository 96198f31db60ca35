"""Downloads from a Hub on 127.0.0.1 (tests/fixtures/fake_hub.py) through HF_ENDPOINT, with tiny files only."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from modules import shared
from modules.errors import InvalidRequest
from modules.lifecycle import hub, load_hooks, memory
from modules.lifecycle.hub_files import quant_of
from modules.settings import load_settings
from tests.conftest import DEFAULT_MODEL, ROOT, default_model_path, hf_default_model
from tests.fixtures.fake_hub import FakeHub
from tests.fixtures.tiny_hf import build_tiny_llama

GOOD, OTHER = "hf_good_token", "hf_other_token"
MiB = 1 << 20


def folder_files(folder: Path) -> dict[str, bytes | Path]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def fake_hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FakeHub]:
    root = tmp_path_factory.mktemp("hub-src")
    llama = build_tiny_llama(root / "tiny-llama", hf_default_model())
    lora = root / "lora"  # a PEFT adapter's files (the bytes need not be a trained adapter to be downloaded)
    lora.mkdir()
    (lora / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "target_modules": ["q_proj"]}))
    (lora / "adapter_model.safetensors").write_bytes(os.urandom(3000))
    server = FakeHub(tokens={GOOD: {"org/gated-llama"}, OTHER: set()}).start()
    files = folder_files(llama)
    server.add_repo("org/tiny-llama", files)
    server.add_repo("org/tiny-llama", {**files, "README.md": b"dev branch"}, branch="dev")
    server.add_repo("org/both-formats", {**files, "pytorch_model.bin": os.urandom(4096)})
    server.add_repo("org/gated-llama", {"config.json": files["config.json"], "model.safetensors": os.urandom(8192)},
                    gated=True)  # fmt: skip
    server.add_repo("org/lora-a", folder_files(lora))
    quants = {f"tiny-{q}.gguf": os.urandom(2048 + i) for i, q in enumerate(("Q2_K", "Q4_K_M", "Q8_0"))}
    quants |= {f"Q6_K/tiny-Q6_K-0000{i}-of-00002.gguf": os.urandom(3000) for i in (1, 2)}
    server.add_repo("org/tiny-GGUF", {**quants, "mmproj-tiny-f16.gguf": os.urandom(1500), "README.md": b"# tiny"})
    server.add_repo("org/smol-GGUF", {DEFAULT_MODEL: default_model_path()})  # streamed from the file
    server.add_repo("org/no-q4km-GGUF", {"m.Q4_K_S.gguf": os.urandom(2000), "m.Q8_0.gguf": os.urandom(2000)})
    yield server
    server.stop()


@pytest.fixture
def lifecycle(fake_hub: FakeHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """shared with isolated models/ and loras/, HF_ENDPOINT at the fake Hub, downloads allowed."""
    from huggingface_hub import constants

    monkeypatch.setenv("HF_ENDPOINT", fake_hub.url)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    args = ["--model-dir", str(tmp_path / "models"), "--lora-dir", str(tmp_path / "loras")]
    shared.init(load_settings([*args, "--user-data-dir", str(tmp_path / "ud")], env={}))
    fake_hub.reset_counts()
    fake_hub.drop_after.clear()
    fake_hub.unavailable.clear()
    fake_hub.corrupt.clear()
    fake_hub.slow.clear()
    yield tmp_path
    from modules import models

    models.unload_model()
    shared.init()


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_full_download_lands_in_org_name_and_loads(lifecycle: Path, fake_hub: FakeHub) -> None:
    from modules import models

    result = hub.download(hub.DownloadArgs("org/tiny-llama"))
    target = lifecycle / "models" / "org_tiny-llama"
    assert result.path == target and result.name == "org_tiny-llama" and result.kind == "hf"
    source = fake_hub.repos["org/tiny-llama"].branches["main"]
    assert {p.name for p in target.iterdir()} == set(source)
    assert all((target / name).read_bytes() == content for name, content in source.items())
    assert result.bytes_fetched == sum(len(c) for c in source.values())  # type: ignore[arg-type]
    assert not (lifecycle / "models" / ".downloads" / "org_tiny-llama").exists()  # nothing half-written left
    assert "org_tiny-llama" in models.model_names()
    backend = models.load_model("org_tiny-llama")
    assert backend.loader_name == "transformers" and backend.encode("Hello")
    dev = hub.download(hub.DownloadArgs("org/tiny-llama:dev"))
    assert dev.name == "org_tiny-llama_dev" and (dev.path / "README.md").read_bytes() == b"dev branch"
    again = hub.download(hub.DownloadArgs("org/tiny-llama"))
    assert again.bytes_fetched == 0 and len(again.reused) == len(source)  # checked, not fetched again


def test_safetensors_are_preferred_over_bin(lifecycle: Path) -> None:
    plan = hub.prepare(hub.DownloadArgs("org/both-formats"))
    paths = {f.path for f in plan.selection.files}
    assert "model.safetensors" in paths and "pytorch_model.bin" not in paths
    assert any("safetensors preferred" in n for n in plan.selection.notes)
    forced = hub.prepare(hub.DownloadArgs("org/both-formats", include=["*.bin", "config.json"]))
    assert {f.path for f in forced.selection.files} == {"pytorch_model.bin", "config.json"}


def test_interrupted_download_resumes_without_fetching_bytes_twice(lifecycle: Path, fake_hub: FakeHub) -> None:
    key = ("org/tiny-llama", "model.safetensors")
    size = len(fake_hub.repos["org/tiny-llama"].branches["main"]["model.safetensors"])  # type: ignore[arg-type]
    assert size > 10 * MiB  # huggingface_hub writes in 10 MiB chunks: the cut falls on a chunk's end
    fake_hub.drop_after[key] = 10 * MiB  # the connection dies after 10 MiB ...
    fake_hub.unavailable[key] = 1  # ... and the Hub is down for the library's retry: this run fails
    with pytest.raises(hub.HubError, match="503"):
        hub.download(hub.DownloadArgs("org/tiny-llama"))
    assert not (lifecycle / "models" / "org_tiny-llama").exists()
    part = lifecycle / "models" / ".downloads" / "org_tiny-llama" / "model.safetensors.part"
    assert part.stat().st_size == 10 * MiB
    result = hub.download(hub.DownloadArgs("org/tiny-llama"))  # a later run
    gets = [g for g in fake_hub.file_gets(*key) if g["status"] != 503]
    assert [g["range_start"] for g in gets] == [0, 10 * MiB]
    assert fake_hub.served[key] == size  # every byte crossed the network once
    assert (
        sha(result.path / "model.safetensors")
        == hashlib.sha256(
            fake_hub.repos["org/tiny-llama"].branches["main"]["model.safetensors"]  # type: ignore[arg-type]
        ).hexdigest()
    )


def test_the_librarys_hf_hub_download_starts_over_after_a_failed_run(
    lifecycle: Path, fake_hub: FakeHub, tmp_path: Path
) -> None:
    """Why hub.py grows its own .part files with http_get instead of calling hf_hub_download(local_dir=...): in the
    pinned huggingface_hub the library deletes its partial file when a run fails, so the next run fetches every byte
    again. If a release keeps it (this test then fails), hub._fetch_file should become an hf_hub_download call."""
    from huggingface_hub import hf_hub_download

    key = ("org/tiny-llama", "model.safetensors")
    fake_hub.drop_after[key] = 10 * MiB
    fake_hub.unavailable[key] = 1
    folder = tmp_path / "library"
    with pytest.raises(Exception, match="503"):
        hf_hub_download(*key, local_dir=folder, endpoint=fake_hub.url)
    assert fake_hub.served[key] >= 10 * MiB
    kept = [p for p in folder.rglob("*") if p.is_file() and p.stat().st_size >= MiB]
    assert kept == []  # the 10 MiB that arrived are gone
    hf_hub_download(*key, local_dir=folder, endpoint=fake_hub.url)
    assert [g["range_start"] for g in fake_hub.file_gets(*key) if g["status"] != 503] == [0, 0]


def test_a_dropped_connection_is_resumed_within_the_run(lifecycle: Path, fake_hub: FakeHub) -> None:
    key = ("org/tiny-llama", "model.safetensors")
    fake_hub.drop_after[key] = 10 * MiB
    result = hub.download(hub.DownloadArgs("org/tiny-llama"))
    assert [g["range_start"] for g in fake_hub.file_gets(*key)] == [0, 10 * MiB]
    assert fake_hub.served[key] == (result.path / "model.safetensors").stat().st_size


def test_cancel_keeps_what_arrived_and_the_next_run_resumes(lifecycle: Path, fake_hub: FakeHub) -> None:
    cancel = threading.Event()

    def report(done: float | None = None, total: float | None = None, message: str = "", **_: object) -> None:
        if done and done >= 10 * MiB:
            cancel.set()

    from modules import jobs

    with pytest.raises(jobs.Cancelled):
        hub.download(hub.DownloadArgs("org/tiny-llama"), report, cancel)
    part = lifecycle / "models" / ".downloads" / "org_tiny-llama" / "model.safetensors.part"
    kept = part.stat().st_size
    assert kept >= 10 * MiB and not (lifecycle / "models" / "org_tiny-llama").exists()
    hub.download(hub.DownloadArgs("org/tiny-llama"))
    gets = fake_hub.file_gets("org/tiny-llama", "model.safetensors")
    assert gets[-1]["range_start"] == kept and gets[-1]["status"] == 206


def test_gated_repo_needs_a_token_with_access(
    lifecycle: Path, fake_hub: FakeHub, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(hub.HubGatedRepo, match="accept its conditions") as without:
        hub.download(hub.DownloadArgs("org/gated-llama"))
    assert without.value.status == 401
    with pytest.raises(hub.HubGatedRepo, match="no access yet") as other:
        hub.download(hub.DownloadArgs("org/gated-llama", token=OTHER))
    assert other.value.status == 403
    models = lifecycle / "models"
    assert not models.exists() or not any(p.name != ".downloads" for p in models.iterdir())  # nothing written
    monkeypatch.setenv("HF_TOKEN", GOOD)  # the usual way to give it
    result = hub.download(hub.DownloadArgs("org/gated-llama"))
    assert (result.path / "model.safetensors").stat().st_size == 8192


def test_a_corrupted_file_is_caught_by_its_checksum(lifecycle: Path, fake_hub: FakeHub) -> None:
    fake_hub.corrupt.add(("org/tiny-llama", "model.safetensors"))
    with pytest.raises(hub.ChecksumMismatch, match=r"model\.safetensors .*does not match its checksum"):
        hub.download(hub.DownloadArgs("org/tiny-llama"))
    assert not (lifecycle / "models" / "org_tiny-llama").exists()
    assert not list((lifecycle / "models").rglob("*.part"))  # the damaged copy is gone
    fake_hub.corrupt.clear()
    assert hub.download(hub.DownloadArgs("org/tiny-llama")).path.is_dir()


def test_a_small_corrupted_file_is_caught_by_its_git_blob_id(lifecycle: Path, fake_hub: FakeHub) -> None:
    fake_hub.corrupt.add(("org/tiny-llama", "config.json"))
    with pytest.raises(hub.ChecksumMismatch, match=r"config\.json"):
        hub.download(hub.DownloadArgs("org/tiny-llama"))


def test_gguf_repo_takes_q4_k_m_unless_asked(lifecycle: Path) -> None:
    from modules import models

    plan = hub.prepare(hub.DownloadArgs("org/tiny-GGUF"))
    assert set(plan.selection.quants) == {"Q2_K", "Q4_K_M", "Q8_0", "Q6_K"}  # the mmproj is not a quantization
    assert [f.path for f in plan.selection.files] == ["tiny-Q4_K_M.gguf"]
    result = hub.fetch(plan)
    assert result.path == lifecycle / "models" / "tiny-Q4_K_M.gguf" and result.path.is_file()  # straight in models/
    q8 = hub.download(hub.DownloadArgs("org/tiny-GGUF", quant="q8_0"))
    assert q8.path.name == "tiny-Q8_0.gguf"
    split = hub.download(hub.DownloadArgs("org/tiny-GGUF", quant="Q6_K"))
    assert split.path == lifecycle / "models" / "org_tiny-GGUF"
    assert sorted(p.name for p in split.path.rglob("*.gguf")) == ["tiny-Q6_K-00001-of-00002.gguf",
                                                                   "tiny-Q6_K-00002-of-00002.gguf"]  # fmt: skip
    assert "org_tiny-GGUF/Q6_K/tiny-Q6_K-00001-of-00002.gguf" not in models.model_names()  # two deep: by folder
    with pytest.raises(InvalidRequest, match="no Q5_K_M quantization; it has Q6_K, Q2_K, Q4_K_M, Q8_0"):
        hub.prepare(hub.DownloadArgs("org/tiny-GGUF", quant="Q5_K_M"))
    nearest = hub.prepare(hub.DownloadArgs("org/no-q4km-GGUF"))
    assert nearest.selection.quant == "Q4_K_S" and "no Q4_K_M" in nearest.selection.notes[0]


def test_quant_names_are_read_from_file_names() -> None:
    assert quant_of("Qwen2.5-0.5B-Instruct-Q4_K_M.gguf") == "Q4_K_M"
    assert quant_of("SmolLM2-135M-Instruct.Q4_1.gguf") == "Q4_1"
    assert quant_of("model-iq4_xs.gguf") == "IQ4_XS"
    assert quant_of("Llama-3-8B-Instruct-Q4_K_M-00001-of-00002.gguf") == "Q4_K_M"
    assert quant_of("BF16/model-00001-of-00003.gguf") == "BF16"
    assert quant_of("gemma-2-2b-it-f16.gguf") == "F16"
    assert quant_of("weights.gguf") is None


def test_peft_adapter_lands_in_loras(lifecycle: Path) -> None:
    from modules import models

    result = hub.download(hub.DownloadArgs("org/lora-a"))
    assert result.kind == "lora" and result.path == lifecycle / "loras" / "org_lora-a"
    assert (result.path / "adapter_config.json").is_file() and "org_lora-a" in models.list_loras()
    with pytest.raises(InvalidRequest, match="is a LoRA adapter"):
        load_hooks.ensure_local("org/lora-a")  # loading it as a model


def test_missing_repo_branch_and_bad_names_are_told(lifecycle: Path) -> None:
    with pytest.raises(hub.HubRepoNotFound, match="org/nope is not on the Hub"):
        hub.prepare(hub.DownloadArgs("org/nope"))
    with pytest.raises(hub.HubRepoNotFound, match="no branch, tag or commit 'v9'"):
        hub.prepare(hub.DownloadArgs("org/tiny-llama", branch="v9"))
    with pytest.raises(InvalidRequest, match="not a Hub repo name"):
        hub.prepare(hub.DownloadArgs("../../etc"))
    with pytest.raises(InvalidRequest, match="not in the repo"):
        hub.prepare(hub.DownloadArgs("org/tiny-llama", specific_file="nope.bin"))


def test_load_by_repo_name_downloads_on_first_use(lifecycle: Path, fake_hub: FakeHub) -> None:
    from huggingface_hub import constants

    from modules import models
    from modules.errors import ModelNotFound

    backend = models.load_model("org/tiny-llama")  # not in models/: downloaded, then loaded
    assert shared.model_name == "org_tiny-llama" and backend.loader_name == "transformers"
    served = dict(fake_hub.served)
    assert served and load_hooks.ensure_local("org/tiny-llama") == "org_tiny-llama"  # second time: the local copy
    assert fake_hub.served == served
    assert load_hooks.ensure_local("org/tiny-GGUF") == "tiny-Q4_K_M.gguf"  # remembered by repo, though named by file
    assert hub.local_name("org/tiny-GGUF") == "tiny-Q4_K_M.gguf"

    seen = len(fake_hub.requests)
    assert load_hooks.first_use_download("org/tiny-llama:dev", {"loader": "remote"}) == "org/tiny-llama:dev"
    assert len(fake_hub.requests) == seen  # a remote engine's model name is never looked up on the Hub
    constants.HF_HUB_OFFLINE = True  # (restored by the fixture's monkeypatch)
    seen = len(fake_hub.requests)
    with pytest.raises(ModelNotFound, match="org/tiny-llama:dev"):
        models.load_model("org/tiny-llama:dev")
    assert len(fake_hub.requests) == seen  # offline: not even asked


def test_concurrent_first_use_downloads_of_a_repo_share_one_job(lifecycle: Path, fake_hub: FakeHub) -> None:
    import time

    from modules import jobs

    source = fake_hub.repos["org/tiny-llama"].branches["main"]
    fake_hub.slow[("org/tiny-llama", "model.safetensors")] = 0.05  # ~0.6 s: the callers overlap
    since = time.time()
    gate = threading.Barrier(2)
    outcome: dict[str, object] = {}

    def load(label: str) -> None:  # a model load naming the repo
        gate.wait()
        try:
            outcome[label] = load_hooks.ensure_local("org/tiny-llama")
        except Exception as exc:  # shown by the assert below
            outcome[label] = exc

    callers = [threading.Thread(target=load, args=(f"load {i}",)) for i in (1, 2)]
    for thread in callers:
        thread.start()
    deadline = time.monotonic() + 30
    while not (job := jobs.running(hub.JOB_KIND)) or job.done == 0:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    # meanwhile another download into the same folder (the API's, with other files): it waits its turn
    config_only = hub.download(hub.DownloadArgs("org/tiny-llama", include=["config.json"]))
    for thread in callers:
        thread.join(60)
    assert outcome["load 1"] == outcome["load 2"] == "org_tiny-llama", outcome
    assert config_only.bytes_fetched == 0 and config_only.reused == ["config.json"]
    for path, content in source.items():
        gets = [g for g in fake_hub.file_gets("org/tiny-llama", path) if g["status"] in (200, 206)]
        assert len(gets) == 1, (path, gets)  # each file crossed the network once
        assert fake_hub.served[("org/tiny-llama", path)] == len(content)  # type: ignore[arg-type]
    assert folder_files(lifecycle / "models" / "org_tiny-llama") == source  # whole and uncorrupted
    started = [j for j in jobs.all_jobs(hub.JOB_KIND) if j.title == "org/tiny-llama" and j.started >= since]
    assert len(started) == 1 and started[0].state == "done"  # the loads joined one job, outside their threads
    assert not (lifecycle / "models" / ".downloads" / "org_tiny-llama").exists()


def test_a_first_use_download_that_fails_in_its_job_tells_the_load_why(lifecycle: Path, fake_hub: FakeHub) -> None:
    fake_hub.corrupt.add(("org/tiny-llama", "model.safetensors"))
    with pytest.raises(hub.ChecksumMismatch, match="does not match its checksum"):
        load_hooks.ensure_local("org/tiny-llama")
    assert not (lifecycle / "models" / "org_tiny-llama").exists()


def test_cli_lists_downloads_and_fails_in_one_line(lifecycle: Path, fake_hub: FakeHub) -> None:
    env = {**os.environ, "HF_ENDPOINT": fake_hub.url, "HF_HUB_OFFLINE": "0", "PYTHONPATH": str(ROOT)}
    out = lifecycle / "elsewhere"
    listed = subprocess.run(
        [sys.executable, "download_model.py", "org/tiny-GGUF", "--list"], cwd=ROOT, env=env, capture_output=True,
        text=True, timeout=60,
    )  # fmt: skip
    assert listed.returncode == 0, listed.stderr
    assert set(json.loads(listed.stdout)["quants"]) == {"Q2_K", "Q4_K_M", "Q8_0", "Q6_K"}
    done = subprocess.run(
        [sys.executable, "download_model.py", "org/tiny-GGUF", "--quant", "Q8_0", "--output", str(out)], cwd=ROOT,
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert (out / "tiny-Q8_0.gguf").stat().st_size == 2050
    missing = subprocess.run(
        [sys.executable, "download_model.py", "org/nope"], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=60,
    )  # fmt: skip
    assert missing.returncode == 1 and missing.stderr.startswith("error: org/nope is not on the Hub")
    assert "Traceback" not in missing.stderr
    flagged = subprocess.run(
        [sys.executable, "download_model.py", "org/tiny-GGUF", "--list", "--token", "hf_secret"], cwd=ROOT, env=env,
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert flagged.returncode == 2 and "HF_TOKEN" in flagged.stderr and "hf_secret" not in flagged.stderr
    assert "hf_secret" not in repr(hub.DownloadArgs("org/x", token="hf_secret"))


def test_inspect_a_repo_reads_headers_not_weights(lifecycle: Path, fake_hub: FakeHub) -> None:
    from modules.lifecycle import analyzer

    local = analyzer.analyze_gguf(default_model_path())
    remote = analyzer.analyze("org/smol-GGUF")
    assert remote.repo == "org/smol-GGUF" and remote.path is None and remote.quantization == "Q4_1"
    assert (remote.parameters, remote.weight_bytes, remote.kv_bytes_per_token) == (
        local.parameters, local.weight_bytes, local.kv_bytes_per_token,
    )  # fmt: skip
    assert fake_hub.served[("org/smol-GGUF", DEFAULT_MODEL)] < default_model_path().stat().st_size / 8
    hf = analyzer.analyze("org/tiny-llama")
    model_file = fake_hub.repos["org/tiny-llama"].branches["main"]["model.safetensors"]
    assert hf.parameters_source == "safetensors headers (Hub)" and hf.weight_bytes == len(model_file)  # type: ignore[arg-type]
    assert fake_hub.served.get(("org/tiny-llama", "model.safetensors"), 0) < 1 * MiB  # its header only
    (lifecycle / "model.safetensors").write_bytes(model_file)  # type: ignore[arg-type]
    on_disk = memory.count_from_safetensors([lifecycle / "model.safetensors"])[0]
    assert hf.parameters == on_disk.total
