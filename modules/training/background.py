"""Training and evaluation as background jobs (the UI and the API use these; the CLI calls ``train`` directly).

One training run at a time: a second start raises :class:`modules.jobs.Busy`. Each run (and each evaluation) is a
child process (:func:`modules.jobs.start_process`): a failure inside it (bad data found late, a native crash, the
OOM killer, ``kill -9``) ends that job with its reason, and the server keeps serving. :func:`resume` continues a
run from its last checkpoint with the run's own arguments (``training_parameters.json``), also after a restart.
"""

from __future__ import annotations

from pathlib import Path

from modules import jobs, shared
from modules.training.args import PARAMETERS_FILE, TrainingArgs
from modules.training.evaluate import EvalArgs, evaluate
from modules.training.run import finished, latest_checkpoint, prepare, train

KIND = "training"
EVAL_KIND = "training-eval"


def start(args: TrainingArgs, owner: str | None = None) -> jobs.Job:
    """Check the arguments, the paths and the data now (errors reach the caller and nothing starts), then train in
    the background; raises :class:`modules.jobs.Busy` while another run trains."""
    busy = jobs.running(KIND)
    if busy is not None:
        raise jobs.Busy(busy)
    effective, _, _ = prepare(args)  # every refusal now, in the caller's thread; the child checks again
    return jobs.start_process(KIND, effective.name, train, effective, exclusive=True, owner=owner)


def resume(name: str, owner: str | None = None) -> jobs.Job:
    """Continue the run ``loras/NAME`` from its last checkpoint with the arguments it was started with."""
    return start(saved_args(name, resume=True), owner=owner)


def saved_args(name: str, resume: bool = False) -> TrainingArgs:
    """The arguments a run was started with (its ``training_parameters.json``)."""
    from modules.errors import InvalidRequest
    from modules.paths import UnsafePath, safe_child
    from modules.training.args import from_dict, saved_parameters

    try:
        folder = safe_child(shared.loras_dir(), name.strip())
    except UnsafePath as exc:
        raise InvalidRequest(f"invalid adapter name: {exc}", param="name") from exc
    saved = saved_parameters(folder, "name", "there is no run to resume")
    return from_dict({**saved, "resume": resume, "copy_from": "", "overwrite": False})


def resumable() -> list[tuple[str, int]]:
    """(adapter, step) of the runs in loras/ that have a checkpoint to resume from and did not finish, newest
    first: what the Training tab offers after a restart."""
    folder = shared.loras_dir()
    found = []
    for run in folder.iterdir() if folder.is_dir() else []:
        checkpoint = latest_checkpoint(run)
        if checkpoint is not None and (run / PARAMETERS_FILE).is_file() and not finished(run):
            found.append((checkpoint.stat().st_mtime, run.name, int(checkpoint.name.split("-")[-1])))
    return [(name, step) for _, name, step in sorted(found, reverse=True)]


def start_evaluation(args: EvalArgs, owner: str | None = None) -> jobs.Job:
    """Perplexity of base and base + LoRA in the background (one at a time, in a child process)."""
    return jobs.start_process(EVAL_KIND, args.lora, evaluate, args, exclusive=True, owner=owner)


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
