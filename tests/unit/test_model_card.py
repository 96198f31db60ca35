"""The model card names exactly the files a push uploads, and says what a Hub page needs; push refuses early."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import yaml

from modules.errors import InvalidRequest
from modules.lifecycle import model_card
from modules.lifecycle.merge import MERGE_INFO
from modules.lifecycle.publish import PushArgs, PushError, prepare, push


@pytest.fixture
def export_folder(tmp_path: Path) -> Path:
    folder = tmp_path / "SmolLM2-secret-gguf"
    folder.mkdir()
    (folder / "SmolLM2-secret.Q4_K_M.gguf").write_bytes(b"GGUF" + b"\0" * 2000)
    (folder / "SmolLM2-secret.Q4_K_M.gguf.fidelity.json").write_text(
        json.dumps({"bits_per_weight": 6.17, "perplexity": 26.5, "kld": 0.0504,
                    "agreement": [{"agreed": 32, "total": 32}, {"agreed": 10, "total": 32}]})
    )  # fmt: skip
    (folder / "SmolLM2-secret.Q8_0.gguf.partial").write_bytes(b"half")  # an export still running
    (folder / ".hidden").write_text("x")
    (folder / MERGE_INFO).write_text(
        json.dumps({"base_model": "HuggingFaceTB/SmolLM2-135M-Instruct", "adapter": "secret", "dtype": "float16",
                    "base_was_quantized": True, "lora": {"r": 8, "lora_alpha": 16},
                    "training": {"dataset": "secret.jsonl", "learning_rate": 0.0003, "epochs": 3}})
    )  # fmt: skip
    return folder


def header(card: str) -> dict:
    match = re.match(r"---\n(.*?)\n---\n", card, re.S)
    assert match, card[:200]
    return yaml.safe_load(match[1])


def test_card_names_only_the_uploaded_files(export_folder: Path) -> None:
    folder, files, card = prepare(PushArgs(export_folder, "me/SmolLM2-secret-GGUF", license="apache-2.0"))
    assert folder == export_folder
    assert files == ["README.md", "SmolLM2-secret.Q4_K_M.gguf", "textgen_merge.json"]
    assert not (export_folder / "README.md").exists()  # the card is sent from memory: the folder is not written
    meta = header(card)
    assert meta["base_model"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert meta["license"] == "apache-2.0"
    assert meta["quantization"] == "Q4_K_M"
    assert meta["pipeline_tag"] == "text-generation" and meta["library_name"] == "gguf"
    assert {"gguf", "llama.cpp", "merge"} <= set(meta["tags"])
    named = set(re.findall(r"[\w.-]+\.gguf\b", card))
    assert named == {"SmolLM2-secret.Q4_K_M.gguf"}  # no file the repo will not have
    assert "FROM ./SmolLM2-secret.Q4_K_M.gguf" in card  # the Ollama Modelfile
    assert "--hf-file SmolLM2-secret.Q4_K_M.gguf" in card and "LM Studio" in card
    assert "KL divergence vs F16 0.05040" in card and "1/2 prompts" in card
    assert "secret.jsonl" in card and "learning_rate: 0.0003" in card and "4-bit" in card


def test_hf_folder_card_has_transformers_usage(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"_name_or_path": "org/base"}))
    (tmp_path / "model.safetensors").write_bytes(b"x")
    card = model_card.render(model_card.CardArgs(tmp_path, "me/merged"))
    meta = header(card)
    assert meta["library_name"] == "transformers" and "quantization" not in meta
    assert 'from_pretrained("me/merged")' in card and meta["base_model"] == "org/base"
    (tmp_path / "config.json").write_text(json.dumps({"_name_or_path": str(tmp_path)}))  # a local folder
    assert "base_model" not in header(model_card.render(model_card.CardArgs(tmp_path, "me/merged")))


def test_push_without_a_token_is_refused_before_any_request(
    export_folder: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))  # no saved login
    monkeypatch.setattr("huggingface_hub.constants.HF_TOKEN_PATH", str(tmp_path / "hf-home" / "token"))
    args = PushArgs(export_folder, "me/x", endpoint="http://127.0.0.1:9")  # nothing listens there
    with pytest.raises(PushError, match="token"):
        push(args, lambda *a, **k: None, threading.Event())
    with pytest.raises(InvalidRequest, match="ORG/NAME"):
        prepare(PushArgs(export_folder, "no-slash"))


@pytest.fixture
def push_hub(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):  # type: ignore[no-untyped-def]
    from tests.fixtures.fake_hub import FakeHub

    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", False)
    hub = FakeHub(users={"hf_me": "me", "hf_other": "other"}).start()  # the download tests' Hub
    yield hub
    hub.stop()


def test_push_creates_private_repos_and_reuses_existing_ones(export_folder: Path, push_hub) -> None:  # type: ignore[no-untyped-def]
    report = lambda *a, **k: None  # noqa: E731
    args = PushArgs(export_folder, "me/secret-GGUF", private=True, token="hf_me", endpoint=push_hub.url)
    result = push(args, report, threading.Event())
    repo = push_hub.repos["me/secret-GGUF"]
    assert result["private"] is True and repo.private is True
    assert sorted(repo.files) == result["files"] == ["README.md", "SmolLM2-secret.Q4_K_M.gguf", "textgen_merge.json"]
    assert repo.files["SmolLM2-secret.Q4_K_M.gguf"] == (export_folder / "SmolLM2-secret.Q4_K_M.gguf").read_bytes()
    assert b"--hf-file SmolLM2-secret.Q4_K_M.gguf" in repo.files["README.md"]
    # again, to the existing repo: a second commit, visibility unchanged when not asked
    again = push(PushArgs(export_folder, "me/secret-GGUF", token="hf_me", endpoint=push_hub.url), report,
                 threading.Event())  # fmt: skip
    assert again["private"] is True and len(repo.pushes) == 2
    # asked public: it becomes public
    public = push(PushArgs(export_folder, "me/secret-GGUF", private=False, token="hf_me", endpoint=push_hub.url),
                  report, threading.Event())  # fmt: skip
    assert public["private"] is False and repo.private is False
    # what was pushed downloads from the same Hub, checksums and all
    from modules.lifecycle import hub

    spec = hub.DownloadArgs("me/secret-GGUF", endpoint=push_hub.url, output=export_folder.parent / "pulled")
    pulled = hub.download(spec)
    assert pulled.path.read_bytes() == (export_folder / "SmolLM2-secret.Q4_K_M.gguf").read_bytes()
    # someone else's namespace: the Hub's refusal, as a clear error
    with pytest.raises(PushError, match="refused"):
        push(PushArgs(export_folder, "me/secret-GGUF", token="hf_other", endpoint=push_hub.url), report,
             threading.Event())  # fmt: skip


def test_optional_targets_say_what_is_missing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    from modules.errors import BackendUnavailable
    from modules.lifecycle.export import ExportArgs, export

    (tmp_path / "config.json").write_text("{}")
    monkeypatch.setitem(sys.modules, "onnx", None)  # an environment without requirements-onnx.txt
    with pytest.raises(BackendUnavailable, match="missing: onnx"):
        export(ExportArgs(tmp_path, format="onnx"), lambda *a, **k: None, threading.Event())
    with pytest.raises(BackendUnavailable, match="Apple silicon"):
        export(ExportArgs(tmp_path, format="mlx"), lambda *a, **k: None, threading.Event())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json"]


def test_a_staged_folder_gets_the_final_name_only_when_complete(tmp_path: Path) -> None:
    import threading

    from modules import jobs
    from modules.lifecycle.convert import staged_folder

    output, cancel = tmp_path / "merged", threading.Event()
    (output / "old.txt").parent.mkdir()
    (output / "old.txt").write_text("old")
    with pytest.raises(InvalidRequest, match="exists"), staged_folder(output, cancel):
        pass  # an existing folder is refused unless asked to replace it
    with pytest.raises(RuntimeError), staged_folder(output, cancel, overwrite=True) as tmp:
        tmp.mkdir()  # the writer makes it (save_pretrained does)
        (tmp / "half.bin").write_text("half")
        raise RuntimeError("disk full")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["merged"] and (output / "old.txt").is_file()
    cancel.set()
    with pytest.raises(jobs.Cancelled), staged_folder(output, cancel, overwrite=True) as tmp:
        tmp.mkdir()
        (tmp / "half.bin").write_text("half")
    assert (output / "old.txt").is_file() and not (output / "half.bin").exists()
    with staged_folder(output, threading.Event(), overwrite=True) as tmp:
        tmp.mkdir()
        (tmp / "new.bin").write_text("new")
    assert sorted(p.name for p in output.iterdir()) == ["new.bin"] and len(list(tmp_path.iterdir())) == 1


def test_an_export_named_like_an_existing_model_is_refused_and_the_model_kept(tmp_path: Path) -> None:
    from modules.lifecycle.export import ExportArgs, export

    source = tmp_path / "source"
    source.mkdir()
    (source / "config.json").write_text("{}")
    model = tmp_path / "models" / "My-Model"  # someone's model, where the export was told to go
    model.mkdir(parents=True)
    (model / "model.safetensors").write_bytes(b"weights")
    gguf = tmp_path / "models" / "My-Model.Q4_K_M.gguf"
    gguf.write_bytes(b"GGUF old")
    noop = lambda *a, **k: None  # noqa: E731
    for args in (ExportArgs(source, "safetensors", output=model), ExportArgs(source, "onnx", output=model),
                 ExportArgs(source, "gguf", "Q4_K_M", output=gguf), ExportArgs(source, "gguf", "F16", output=gguf)):  # fmt: skip
        with pytest.raises(InvalidRequest, match=r"exists.*--overwrite"):
            export(args, noop, threading.Event())
    with pytest.raises(InvalidRequest, match="inside it"):
        export(ExportArgs(source, "safetensors", output=source / "out", overwrite=True), noop, threading.Event())
    with pytest.raises(InvalidRequest, match="is a folder and a GGUF is one file"):  # told before converting
        export(ExportArgs(source, "gguf", "F16", output=model, overwrite=True), noop, threading.Event())
    with pytest.raises(InvalidRequest, match="holds it"):  # replacing models/ would delete the source in it
        export(ExportArgs(source, "safetensors", output=source.parent, overwrite=True), noop, threading.Event())
    assert (model / "model.safetensors").read_bytes() == b"weights" and gguf.read_bytes() == b"GGUF old"
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == ["My-Model", "My-Model.Q4_K_M.gguf"]


def test_the_push_cli_takes_its_token_from_the_environment_never_argv(
    export_folder: Path, push_hub, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    """`python -m modules.lifecycle push` as a user runs it: HF_TOKEN (or the saved login) is the token, no flag takes
    one (`ps` would show it), none is printed, and without one nothing is sent."""
    from tests.conftest import ROOT

    command = [sys.executable, "-m", "modules.lifecycle", "push", str(export_folder), "me/cli-push", "--private",
               "--endpoint", push_hub.url, "--json"]  # fmt: skip
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf-home"), "HF_HUB_OFFLINE": "0"}
    env.pop("HF_TOKEN", None)
    run = lambda argv, extra: subprocess.run(argv, cwd=ROOT, env={**env, **extra}, capture_output=True, text=True,  # noqa: E731
                                             stdin=subprocess.DEVNULL, timeout=120)  # fmt: skip
    refused = run(command, {})  # no token anywhere, and no terminal to ask on
    assert refused.returncode == 1 and "needs a Hugging Face token" in refused.stderr, refused.stderr[-2000:]
    assert "me/cli-push" not in push_hub.repos
    flag = run([*command, "--token", "hf_me"], {})
    assert flag.returncode == 2 and "unrecognized arguments: --token" in flag.stderr
    done = run(command, {"HF_TOKEN": "hf_me"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout)["private"] is True and push_hub.repos["me/cli-push"].private is True
    assert "hf_me" not in done.stdout + done.stderr


def test_a_pushed_gguf_goes_alone_and_no_path_or_token_leaves(tmp_path: Path, push_hub) -> None:  # type: ignore[no-untyped-def]
    from modules.lifecycle.merge import merge_info

    models = tmp_path / "models"  # an export written beside its source, among other models
    (models / "Other-Model").mkdir(parents=True)
    (models / "Other-Model" / "model.safetensors").write_bytes(b"not yours to push")
    (models / "README.md").write_text("my notes")
    gguf = models / "Mine.Q4_K_M.gguf"
    gguf.write_bytes(b"GGUF" + b"\0" * 100)
    args = PushArgs(gguf, "me/Mine-GGUF", token="hf_me", endpoint=push_hub.url)
    assert "hf_me" not in repr(args)
    result = push(args, lambda *a, **k: None, threading.Event())
    repo = push_hub.repos["me/Mine-GGUF"]
    assert sorted(repo.files) == result["files"] == ["Mine.Q4_K_M.gguf", "README.md"]
    assert (models / "README.md").read_text() == "my notes"  # nothing written into the user's folder
    # a merged model records its base, adapter and training by name: no path of this machine reaches the Hub
    lora = tmp_path / "loras" / "secret"
    lora.mkdir(parents=True)
    (lora / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": str(models / "Base"), "r": 8}))
    training = {"model_name": str(models / "Base"), "dataset": str(tmp_path / "data" / "secret.jsonl"), "epochs": 3}
    (lora / "training_parameters.json").write_text(json.dumps(training))
    merged = tmp_path / "merged"
    merged.mkdir()
    (merged / "model.safetensors").write_bytes(b"x")
    (merged / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (merged / MERGE_INFO).write_text(json.dumps(merge_info(models / "Base", lora, "float16", False)))
    push(PushArgs(merged, "me/merged", token="hf_me", endpoint=push_hub.url), lambda *a, **k: None, threading.Event())
    pushed = push_hub.repos["me/merged"].files
    assert sorted(pushed) == ["README.md", "config.json", "model.safetensors", MERGE_INFO]
    for name, data in pushed.items():
        assert str(tmp_path).encode() not in data and b"hf_me" not in data, name
    assert b"secret.jsonl" in pushed["README.md"] and b"Base" in pushed[MERGE_INFO]
    # a README.md the folder has is the user's card: sent as it is, never replaced
    (merged / "README.md").write_text("# my own card")
    push(PushArgs(merged, "me/merged", token="hf_me", endpoint=push_hub.url), lambda *a, **k: None, threading.Event())
    assert pushed["README.md"] == b"# my own card" and (merged / "README.md").read_text() == "# my own card"
    # a trained adapter goes without its run's records and checkpoints, its base named, not a path of this machine
    (lora / "adapter_model.safetensors").write_bytes(b"lora weights")
    (lora / "training_log.json").write_text(json.dumps({"log": [], "dataset": str(tmp_path / "data")}))
    (lora / "checkpoints" / "checkpoint-2").mkdir(parents=True)
    (lora / "checkpoints" / "checkpoint-2" / "optimizer.pt").write_bytes(b"optimizer state")
    push(PushArgs(lora, "me/adapter", token="hf_me", endpoint=push_hub.url), lambda *a, **k: None, threading.Event())
    pushed = push_hub.repos["me/adapter"].files
    assert sorted(pushed) == ["README.md", "adapter_config.json", "adapter_model.safetensors"]
    for name, data in pushed.items():
        assert str(tmp_path).encode() not in data and b"hf_me" not in data, name
    assert json.loads(pushed["adapter_config.json"]) == {"base_model_name_or_path": "Base", "r": 8}
    assert str(models / "Base") in (lora / "adapter_config.json").read_text()  # the local file is unchanged


def test_the_hub_reads_base_relation_license_and_tags_and_no_path(tmp_path: Path) -> None:
    """huggingface_hub parses each card as the Hub will: what the files are to their base, and no local path."""
    import gguf
    import numpy as np
    from huggingface_hub import ModelCard

    from modules.lifecycle.merge import merge_info

    def hub_data(target: Path, **kw: str) -> dict:
        card = prepare(PushArgs(target, "me/out", **kw))[2]
        assert str(tmp_path) not in card and tmp_path.name not in card, card
        return ModelCard(card).data.to_dict()

    quant = tmp_path / "models" / "Base.Q4_K_M.gguf"  # a GGUF quant of a Hub base
    quant.parent.mkdir()
    quant.write_bytes(b"GGUF" + b"\0" * 100)
    data = hub_data(quant, base_model="org/base", license="mit")
    assert (data["base_model"], data["base_model_relation"], data["license"]) == ("org/base", "quantized", "mit")
    assert {"gguf", "llama.cpp"} <= set(data["tags"]) and data["library_name"] == "gguf"
    assert "base_model" not in hub_data(quant, base_model=str(tmp_path / "models" / "Base"))  # a path is no base

    lora = tmp_path / "loras" / "secret"  # a PEFT adapter on a Hub base, trained on a Hub dataset and a local file
    lora.mkdir(parents=True)
    (lora / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "org/base", "r": 8}))
    (lora / "adapter_model.safetensors").write_bytes(b"x")
    (tmp_path / "eval.jsonl").write_text("{}")
    training = {"dataset": "HuggingFaceH4/no_robots", "eval_dataset": str(tmp_path / "eval.jsonl")}
    (lora / "training_parameters.json").write_text(json.dumps(training))
    data = hub_data(lora, license="apache-2.0")
    assert (data["base_model"], data["base_model_relation"], data["library_name"]) == ("org/base", "adapter", "peft")
    assert "lora" in data["tags"]

    merged = tmp_path / "merged"  # that LoRA merged into its base: a fine-tune (the Hub's "merge" is of several models)
    merged.mkdir()
    (merged / "model.safetensors").write_bytes(b"x")
    (merged / "config.json").write_text(json.dumps({"_name_or_path": str(tmp_path / "models" / "Base")}))
    (merged / MERGE_INFO).write_text(json.dumps(merge_info(tmp_path / "models" / "Base", lora, "float16", False)))
    data = hub_data(merged, license="apache-2.0")
    assert (data["base_model"], data["base_model_relation"], data["license"]) == ("org/base", "finetune", "apache-2.0")
    assert data["datasets"] == ["HuggingFaceH4/no_robots"] and {"merge", "lora"} <= set(data["tags"])

    adapter = tmp_path / "loras" / "secret.F16.gguf"  # the LoRA as a GGUF adapter (what llama.cpp's converter writes)
    writer = gguf.GGUFWriter(str(adapter), "llama")
    writer.add_type("adapter")
    writer.add_string("adapter.type", "lora")
    writer.add_tensor("blk.0.attn_q.weight.lora_a", np.zeros((8, 16), dtype=np.float32))
    for write in (writer.write_header_to_file, writer.write_kv_data_to_file, writer.write_tensors_to_file):
        write()
    writer.close()
    card = prepare(PushArgs(adapter, "me/out", base_model="org/base"))[2]
    assert str(tmp_path) not in card
    data = ModelCard(card).data.to_dict()
    assert (data["base_model"], data["base_model_relation"]) == ("org/base", "adapter") and "lora" in data["tags"]
    assert "--lora secret.F16.gguf" in card and "-hf " not in card  # llama.cpp loads it over its base
