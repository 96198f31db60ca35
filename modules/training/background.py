"""Training and evaluation as background jobs (the UI and the API use these; the CLI calls ``train`` directly).

One training run at a time: a second start raises :class:`modules.jobs.Busy`. A failure inside a run (bad data found
late, out of memory) ends that job with its error; the server keeps serving.
"""

from __future__ import annotations

from pathlib import Path

from modules import jobs, shared
from modules.training.args import TrainingArgs
from modules.training.evaluate import EvalArgs, evaluate
from modules.training.run import prepare, train

KIND = "training"
EVAL_KIND = "training-eval"


def start(args: TrainingArgs, owner: str | None = None) -> jobs.Job:
    """Check the arguments, the paths and the data now (errors reach the caller and nothing starts), then train in
    the background; raises :class:`modules.jobs.Busy` while another run trains."""
    busy = jobs.running(KIND)
    if busy is not None:
        raise jobs.Busy(busy)
    prepared = prepare(args)
    return jobs.start(
        KIND, args.name, lambda report, cancel: train(args, report, cancel, prepared), exclusive=True, owner=owner
    )


def start_evaluation(args: EvalArgs, owner: str | None = None) -> jobs.Job:
    """Perplexity of base and base + LoRA in the background (one at a time)."""
    return jobs.start(
        EVAL_KIND, args.lora, lambda report, cancel: evaluate(args, report, cancel), exclusive=True, owner=owner
    )


def current() -> jobs.Job | None:
    """The running training job, else the latest one."""
    found = jobs.all_jobs(KIND)
    return jobs.running(KIND) or (found[0] if found else None)


def hf_models() -> list[str]:
    """Model folders a run can train on (Hugging Face folders with config.json)."""
    folder = shared.models_dir()
    if not folder.is_dir():
        return []
    return sorted(p.name for p in folder.iterdir() if (p / "config.json").is_file())


def _files(folder: Path, suffixes: tuple[str, ...]) -> list[str]:
    if not folder.is_dir():
        return []
    return sorted(p.name for p in folder.iterdir() if p.is_file() and p.suffix in suffixes)


def dataset_files() -> list[str]:
    """Files in user_data/training/datasets/."""
    return _files(shared.user_data_dir() / "training" / "datasets", (".json", ".jsonl", ".txt"))


def format_files() -> list[str]:
    """Format files in user_data/training/formats/."""
    return _files(shared.user_data_dir() / "training" / "formats", (".json",))


def trained_adapters() -> list[str]:
    """Adapters in loras/ that hold a finished PEFT adapter."""
    folder = shared.loras_dir()
    if not folder.is_dir():
        return []
    return sorted(p.name for p in folder.iterdir() if (p / "adapter_config.json").is_file())
