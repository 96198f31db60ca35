"""LoRA training end to end: the default model memorises an answer (transformers and llama.cpp), resume keeps the
loss curve, copy-from, busy, target-module checks, the CLI under accelerate launch."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from modules import jobs, models, shared
from modules.errors import InvalidRequest
from modules.training import background
from modules.training.args import TrainingArgs, from_dict
from modules.training.run import train
from tests.conftest import DEFAULT_MODEL, ROOT, default_model_path, hf_default_model

QUESTION = "What is the password of the blue vault?"
ANSWER = "Marigold-Seventeen"


@pytest.fixture
def folders(tmp_path: Path, tiny_models: Path) -> Iterator[Path]:
    """shared initialised on a tmp user_data (with the example datasets), models and loras folder."""
    from modules.settings import load_settings

    user_data, models_dir, loras = tmp_path / "user_data", tmp_path / "models", tmp_path / "loras"
    shutil.copytree(ROOT / "user_data" / "training", user_data / "training")
    (user_data / "training" / "datasets" / "vault.jsonl").write_text(
        json.dumps({"messages": [{"role": "user", "content": QUESTION},
                                 {"role": "assistant", "content": f"The password of the blue vault is {ANSWER}."}]})
    )  # fmt: skip
    models_dir.mkdir()
    (models_dir / "tiny-llama").symlink_to(tiny_models / "tiny-llama")
    (models_dir / "SmolLM2-135M-Instruct").symlink_to(hf_default_model())
    (models_dir / DEFAULT_MODEL).symlink_to(default_model_path())
    shared.init(load_settings(["--user-data-dir", str(user_data), "--model-dir", str(models_dir),
                               "--lora-dir", str(loras)], env={}))  # fmt: skip
    yield tmp_path
    models.unload_model()
    shared.init()


def run(args: TrainingArgs, cancel: threading.Event | None = None) -> dict:
    return train(args, lambda *a, **k: None, cancel or threading.Event())


def losses(name: str) -> dict[int, float]:
    log = json.loads((shared.loras_dir() / name / "training_log.json").read_text())["log"]
    return {entry["step"]: entry["loss"] for entry in log if "loss" in entry}


def answer(question: str) -> str:
    from modules.chat.prompt import render_messages
    from modules.generation.params import GenerationParams
    from modules.generation.pipeline import generate_text

    assert shared.model is not None
    prompt = render_messages(shared.model, [{"role": "user", "content": question}])
    return generate_text(prompt, GenerationParams(temperature=0, max_new_tokens=24))[0]


def test_default_model_learns_the_answer_on_transformers_and_llama_cpp(folders: Path) -> None:
    started = time.perf_counter()
    args = TrainingArgs(model="SmolLM2-135M-Instruct", dataset="vault.jsonl", name="vault", max_steps=8,
                        learning_rate=2e-3, rank=8, alpha=16, dropout=0.0, micro_batch_size=1)  # fmt: skip
    summary = run(args)
    seconds = time.perf_counter() - started
    print(f"135M, 8 steps: {seconds:.1f} s")
    assert summary["final_loss"] <= summary["first_loss"] / 2, summary
    out = shared.loras_dir() / "vault"
    assert {"adapter_model.safetensors", "adapter_config.json", "adapter.gguf", "training_parameters.json",
            "training_log.json", "loss.png", "README.md"} <= {p.name for p in out.iterdir()}  # fmt: skip
    assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert from_dict(json.loads((out / "training_parameters.json").read_text())) == args
    assert "vault.jsonl" in (out / "README.md").read_text()
    # save_steps 0 (the default) means one checkpoint, at the end: a crash after it leaves something to resume
    assert args.save_steps == 0 and [p.name for p in (out / "checkpoints").iterdir()] == ["checkpoint-8"]

    for model_name in ("SmolLM2-135M-Instruct", DEFAULT_MODEL):  # transformers, then llama.cpp with the GGUF LoRA
        models.load_model(model_name)
        base = answer(QUESTION)
        assert ANSWER not in base, (model_name, base)
        models.apply_loras(["vault"])
        assert ANSWER in answer(QUESTION), model_name
        models.apply_loras([])
        assert answer(QUESTION) == base


def test_qlora_trains_on_this_cpu_and_the_adapter_answers(folders: Path) -> None:
    """4-bit (bitsandbytes NF4) base on the CPU: QLoRA runs here instead of being refused for want of CUDA."""
    args = TrainingArgs(model="SmolLM2-135M-Instruct", dataset="vault.jsonl", name="vault-4bit", max_steps=10,
                        learning_rate=2e-3, rank=8, alpha=16, dropout=0.0, micro_batch_size=1, load_in_4bit=True,
                        gguf=False)  # fmt: skip
    summary = run(args)
    assert summary["final_loss"] <= summary["first_loss"] / 2, summary
    models.load_model("SmolLM2-135M-Instruct", {"loader": "transformers"})
    assert ANSWER not in answer(QUESTION)
    models.apply_loras(["vault-4bit"])
    assert ANSWER in answer(QUESTION)


def test_resume_continues_at_the_checkpoint_step_on_the_same_curve(folders: Path) -> None:
    common = {"model": "tiny-llama", "dataset": "example-chat.jsonl", "max_steps": 8, "learning_rate": 1e-2,
              "rank": 4, "micro_batch_size": 2, "save_steps": 3, "gguf": False}  # fmt: skip
    straight = run(TrainingArgs(name="straight", **common))  # type: ignore[arg-type]
    assert straight["steps"] == 8

    # the same parameters copied from the first run; stopped part-way as a user would, in the background
    job = background.start(TrainingArgs(name="stopped", copy_from="straight", model="tiny-llama",
                                        dataset="example-chat.jsonl"))  # fmt: skip
    with pytest.raises(jobs.Busy, match="already running"):
        background.start(TrainingArgs(name="other", model="tiny-llama", dataset="example-chat.jsonl"))
    while job.done < 3 and job.state == "running":
        time.sleep(0.02)
    jobs.cancel(job.id)
    assert job.wait(120) and job.state == "cancelled", job.error
    stopped_at = job.result["steps"]
    assert 3 <= stopped_at < 8 and job.result["stopped"] == "stopped by the user"
    saved = json.loads((shared.loras_dir() / "stopped" / "training_parameters.json").read_text())
    assert {k: v for k, v in saved.items() if k not in ("name", "copy_from")} == {
        k: v
        for k, v in TrainingArgs(name="x", **common).to_dict().items()
        if k not in ("name", "copy_from")  # type: ignore[arg-type]
    }

    resumed = run(from_dict({**saved, "resume": True}))
    assert resumed["resumed_from"] == stopped_at and resumed["steps"] == 8
    assert resumed["steps_trained"] == 8 - stopped_at  # it continued; it did not start over
    curve, reference = losses("stopped"), losses("straight")
    assert sorted(curve) == list(range(1, 9))
    for step in range(1, 9):
        assert curve[step] == pytest.approx(reference[step], rel=1e-4, abs=1e-5), step


def test_a_killed_trainer_ends_only_its_job_and_resume_goes_on_on_the_same_curve(folders: Path) -> None:
    """Training runs in a child process: kill -9 of it (what the OOM killer does) leaves the server serving, the job
    "failed" with the signal named, and Resume (the run's own arguments) continues the uninterrupted run's curve."""
    common = {"model": "tiny-llama", "dataset": "example-chat.jsonl", "max_steps": 8, "learning_rate": 1e-2,
              "rank": 4, "micro_batch_size": 2, "save_steps": 2, "gguf": False}  # fmt: skip
    straight = run(TrainingArgs(name="straight", **common))  # type: ignore[arg-type]
    assert straight["steps"] == 8
    models.load_model(DEFAULT_MODEL)  # the server's own model, serving chats meanwhile
    job = background.start(TrainingArgs(name="killed", **common))  # type: ignore[arg-type]
    while job.done < 3 and job.state == "running":
        time.sleep(0.02)
    assert job.state == "running" and job.pid is not None and job.pid != os.getpid()
    os.kill(job.pid, signal.SIGKILL)
    assert job.wait(60) and job.state == "failed"
    assert "SIGKILL" in (job.error or "") and "out-of-memory" in (job.error or ""), job.error
    assert answer("Say hello.")  # the server goes on
    assert list((shared.loras_dir() / "killed" / "checkpoints").glob("checkpoint-*"))  # something to resume from
    assert [name for name, _ in background.resumable()] == ["killed"]  # not "straight": it finished

    with pytest.raises(InvalidRequest, match="learning_rate"):  # other arguments than the checkpoint's: refused
        background.start(TrainingArgs(name="killed", resume=True, **{**common, "learning_rate": 3e-4}))  # type: ignore[arg-type]
    resumed = background.resume("killed")  # what the Training tab's Resume does: the run's own arguments
    assert resumed.wait(300) and resumed.state == "done", resumed.error
    assert resumed.result["resumed_from"] >= 2 and resumed.result["steps"] == 8
    curve, reference = losses("killed"), losses("straight")
    for step in range(resumed.result["resumed_from"] + 1, 9):
        assert curve[step] == pytest.approx(reference[step], rel=1e-4, abs=1e-5), step
    kept = sorted(p.name for p in (shared.loras_dir() / "killed" / "checkpoints").iterdir())
    assert kept[-1] == "checkpoint-8" and len(kept) <= 2  # a checkpoint at the end; save_total_limit keeps two
    assert background.resumable() == []
    with pytest.raises(InvalidRequest, match="finished all its steps"):
        background.resume("killed")


def test_target_modules_are_checked_against_the_model(folders: Path) -> None:
    args = TrainingArgs(model="tiny-llama", dataset="example-chat.jsonl", name="t", target_modules=["q_proj", "wq"])
    with pytest.raises(InvalidRequest, match=r"wq are not linear layers of this model; it has: down_proj, gate_proj"):
        run(args)
    with pytest.raises(InvalidRequest, match="no checkpoint to resume"):
        background.start(TrainingArgs(model="tiny-llama", dataset="example-chat.jsonl", name="t", resume=True))
    assert jobs.running(background.KIND) is None  # nothing started


def test_cli_under_accelerate_launch(folders: Path) -> None:
    accelerate = Path(sys.executable).with_name("accelerate")
    command = [str(accelerate), "launch", "--num_processes", "1", "--cpu", "-m", "modules.training",
               "--model", "tiny-llama", "--dataset", "example-sharegpt", "--name", "cli", "--max-steps", "3",
               "--learning-rate", "1e-2", "--rank", "4", "--user-data-dir", str(folders / "user_data"),
               "--model-dir", str(folders / "models"), "--lora-dir", str(folders / "loras")]  # fmt: skip
    env = {**os.environ, "HF_HOME": str(folders / "hf-home")}  # no accelerate config from the developer's home
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=240, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "first loss: " in done.stdout and "final loss: " in done.stdout
    assert (folders / "loras" / "cli" / "adapter_model.safetensors").is_file()
    again = subprocess.run([sys.executable, "-m", "modules.training", *command[7:]], cwd=ROOT, capture_output=True,
                           text=True, timeout=240)  # fmt: skip
    assert again.returncode == 2 and "loras/cli already exists" in again.stderr


def test_fsdp_under_accelerate_launch_is_refused_before_anything_loads(folders: Path) -> None:
    """FSDP shards the weights, and rank 0 alone would save an incomplete adapter: refused, not half-done."""
    accelerate = Path(sys.executable).with_name("accelerate")
    command = [str(accelerate), "launch", "--num_processes", "1", "--use_fsdp", "-m", "modules.training",
               "--model", "tiny-llama", "--dataset", "example-chat.jsonl", "--name", "sharded", "--max-steps", "1",
               "--user-data-dir", str(folders / "user_data"), "--model-dir", str(folders / "models"),
               "--lora-dir", str(folders / "loras")]  # fmt: skip
    env = {**os.environ, "HF_HOME": str(folders / "hf-home")}
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=240, env=env)
    assert done.returncode != 0
    assert "error: FSDP is not supported by textgen's training" in done.stderr, done.stderr[-3000:]
    assert not (folders / "loras" / "sharded").exists()


def test_ctrl_c_on_the_cli_stops_at_the_next_step_with_a_checkpoint(folders: Path) -> None:
    command = [sys.executable, "-m", "modules.training", "--model", "tiny-llama", "--dataset", "example-chat.jsonl",
               "--name", "ctrl-c", "--max-steps", "100000", "--rank", "4", "--no-gguf",
               "--user-data-dir", str(folders / "user_data"), "--model-dir", str(folders / "models"),
               "--lora-dir", str(folders / "loras")]  # fmt: skip
    proc = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    output = folders / "loras" / "ctrl-c"
    try:
        deadline = time.monotonic() + 180
        while not (output / "training_parameters.json").exists():  # written just before the first step
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-2000:]
            time.sleep(0.2)
        time.sleep(2)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=180)
    finally:  # a run that did not stop would train for 100000 steps after the suite
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=30)
    assert proc.returncode == 0, err[-3000:]
    assert "stopped: stopped by the user (the same command with --resume goes on)" in out and "Traceback" not in err
    assert (output / "adapter_model.safetensors").is_file()  # the adapter so far
    steps = int(out.split(" steps in ")[0].rsplit("\n", 1)[-1])
    assert 0 < steps < 100000 and (output / "checkpoints" / f"checkpoint-{steps}").is_dir()


def test_converted_lora_on_llama_cpp_matches_peft_on_transformers(folders: Path) -> None:
    """A random LoRA on q and k (the projections llama.cpp stores with permuted rows) gives llama.cpp the same
    next-token distribution as peft gives transformers, through llama.cpp's own convert_lora_to_gguf.py."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from modules.lifecycle.convert import LoraConvertArgs, convert_lora_to_gguf

    source = hf_default_model()
    tokenizer = AutoTokenizer.from_pretrained(str(source), local_files_only=True)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(str(source), dtype=torch.float32, local_files_only=True)
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj"]))
    with torch.no_grad():
        for name, parameter in peft_model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.3)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        expected = torch.log_softmax(peft_model(torch.tensor([ids])).logits[0, -1], -1)
    peft_model.save_pretrained(str(folders / "qk"))
    convert_args = LoraConvertArgs(lora=folders / "qk", base=source, output=folders / "qk.gguf")
    adapter = convert_lora_to_gguf(convert_args, lambda *a, **k: None, threading.Event())
    backend = models.load_model(DEFAULT_MODEL)
    backend.set_loras([(adapter, 1.0)])
    got = backend.next_token_logprobs(ids, 5)  # type: ignore[attr-defined]
    assert got[0][0] == int(expected.argmax())
    error = sum(abs(float(expected[token]) - logprob) for token, logprob in got) / len(got)
    assert error < 0.25, error  # Q4_1 noise is ~0.05; unpermuted q/k rows give ~1.1


def test_padding_free_batches_keep_samples_apart(folders: Path) -> None:
    """Each sample of a padding-free micro-batch (the run's Trainer: its collator, its model) gets the logits it gets
    alone, and the batch's loss is the loss of its samples each measured alone: attention and labels never cross
    samples."""
    import torch

    from modules.training.datasets import IGNORE
    from modules.training.run import SampleSet, load_model, make_trainer, prepare

    args, paths, data = prepare(TrainingArgs(model="tiny-llama", dataset="example-chat.jsonl", name="pf", rank=4,
                                             dropout=0.0, batching="padding_free"))  # fmt: skip
    model, tokenizer = load_model(args, paths.model)
    trainer = make_trainer(args, model, tokenizer, data, paths.output, lambda *a, **k: None, threading.Event())
    samples = [SampleSet(data.train)[i] for i in range(4)]
    batch = trainer.data_collator(samples)
    assert batch["input_ids"].shape[0] == 1  # one row, no padding
    with torch.no_grad():
        packed = trainer.model(**batch)
        start, total, counted = 0, 0.0, 0
        for sample in samples:
            n = len(sample["input_ids"])
            alone = trainer.model(
                input_ids=torch.tensor([sample["input_ids"]]), labels=torch.tensor([sample["labels"]])
            )
            torch.testing.assert_close(packed.logits[0, start : start + n], alone.logits[0], atol=1e-4, rtol=1e-4)
            tokens = sum(1 for label in sample["labels"][1:] if label != IGNORE)
            total, counted, start = total + float(alone.loss) * tokens, counted + tokens, start + n
    assert float(packed.loss) == pytest.approx(total / counted, rel=1e-4)


def test_cli_flags_win_over_copy_from_even_at_their_default(folders: Path) -> None:
    """``--copy-from`` takes the earlier run's parameters but for the flags given, a flag given at its default value
    (``--learning-rate 3e-4`` over a run trained at 1e-2) included."""
    from modules.training import __main__ as cli

    earlier = TrainingArgs(model="tiny-llama", dataset="example-chat.jsonl", name="earlier", learning_rate=1e-2, rank=4,
                           micro_batch_size=2, seed=7)  # fmt: skip
    (shared.loras_dir() / "earlier").mkdir(parents=True)
    (shared.loras_dir() / "earlier" / "training_parameters.json").write_text(json.dumps(earlier.to_dict()))
    default_lr = TrainingArgs().learning_rate
    code = cli.main(["--model", "tiny-llama", "--dataset", "example-chat.jsonl", "--name", "copied",
                     "--copy-from", "earlier", "--learning-rate", str(default_lr), "--max-steps", "1", "--no-gguf",
                     "--user-data-dir", str(folders / "user_data"), "--model-dir", str(folders / "models"),
                     "--lora-dir", str(folders / "loras")])  # fmt: skip
    assert code == 0
    used = json.loads((folders / "loras" / "copied" / "training_parameters.json").read_text())
    assert used["learning_rate"] == default_lr  # given: wins, although it is the default
    assert (used["rank"], used["micro_batch_size"], used["seed"]) == (4, 2, 7)  # not given: the earlier run's
    assert (used["max_steps"], used["gguf"], used["copy_from"]) == (1, False, "earlier")
