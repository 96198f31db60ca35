"""The training CLI: ``python -m modules.training --model PATH --dataset FILE --name NAME ...``.

Every flag is a field of TrainingArgs (its docstring is the help). Runs the same ``train`` function as the Training
tab, in the foreground with a tqdm bar (Ctrl+C stops it at the next step with a checkpoint, ``--resume`` goes on);
works under ``accelerate launch -m modules.training ...`` unchanged.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import typing
from collections.abc import Sequence
from dataclasses import MISSING, fields
from typing import Any

from modules.training.args import TrainingArgs, field_docs


def parser() -> argparse.ArgumentParser:
    """Flags generated from TrainingArgs, plus the folders."""
    p = argparse.ArgumentParser(prog="python -m modules.training", description="Train a LoRA adapter.")
    docs = field_docs()
    hints = typing.get_type_hints(TrainingArgs)
    for f in fields(TrainingArgs):
        flag = "--" + f.name.replace("_", "-")
        hint = hints[f.name]
        default = f.default if f.default is not MISSING else f.default_factory()  # type: ignore[misc,operator]
        help_text = docs.get(f.name, "") + (f" (default: {default})" if default not in ("", [], None) else "")
        help_text = help_text.replace("%", "%%")
        if hint is bool:
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=help_text)
        elif hint == list[str]:
            p.add_argument(flag, nargs="*", default=default, metavar="NAME", help=help_text)
        else:
            p.add_argument(flag, type=hint, default=default, required=f.name in ("model", "dataset", "name"),
                           help=help_text)  # fmt: skip
    p.add_argument("--lr", dest="learning_rate", type=float, help=argparse.SUPPRESS)
    p.add_argument("--user-data-dir", help="The user_data folder (datasets and formats are in its training/).")
    p.add_argument("--model-dir", help="The models folder.")
    p.add_argument("--lora-dir", help="The LoRA folder (the run writes LORA_DIR/NAME/).")
    p.add_argument("--json", action="store_true", help="Print the run's summary as JSON at the end.")
    return p


def given_fields(argv: Sequence[str] | None) -> set[str]:
    """The TrainingArgs fields named on the command line, a flag given at its default value too: what
    ``--copy-from`` leaves as given."""
    p = parser()
    unset = object()
    p.set_defaults(**{f.name: unset for f in fields(TrainingArgs)})
    return {k for k, v in vars(p.parse_args(argv)).items() if v is not unset and k in TrainingArgs.__dataclass_fields__}


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the flags, train, print the first and final loss; 2 on a bad argument or bad data."""
    from modules import jobs, shared
    from modules.errors import TextgenError
    from modules.settings import load_settings
    from modules.training import datasets
    from modules.training.run import train

    options = vars(parser().parse_args(argv))
    folders = []
    for key in ("user_data_dir", "model_dir", "lora_dir"):
        value = options.pop(key)
        if value:
            folders += ["--" + key.replace("_", "-"), value]
    as_json = options.pop("json")
    if options.get("learning_rate") is None:
        options["learning_rate"] = TrainingArgs.learning_rate
    shared.init(load_settings(folders, env=os.environ))
    args = TrainingArgs(**options)
    given = given_fields(argv)  # the flags that win over --copy-from's values
    try:  # Ctrl+C stops the run at its next step with a checkpoint, and the adapter so far is saved
        with datasets.allow_paths():  # the command line may name any file its user can read
            summary: dict[str, Any] = jobs.run_foreground(
                f"training {args.name}", lambda report, cancel: train(args, report, cancel, explicit=given), unit="step"
            )
    except TextgenError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted; resume with --resume", file=sys.stderr)
        return 130
    if int(os.environ.get("RANK", "0")) == 0:
        first, final = summary.get("first_loss"), summary.get("final_loss")
        print(f"first loss: {first:.4f}" if first is not None else "first loss: -")
        print(f"final loss: {final:.4f}" if final is not None else "final loss: -")
        if summary.get("eval_loss") is not None:
            print(f"eval loss: {summary['eval_loss']:.4f}")
        for row in summary.get("perplexity") or []:
            print(f"perplexity {row['model']}: {row['perplexity']}")
        print(
            f"{summary['steps']} steps in {summary['seconds']} s ({summary['tokens_per_s']} tokens/s) -> {summary['output']}"
        )
        if summary.get("stopped"):
            hint = " (the same command with --resume goes on)" if "by the user" in summary["stopped"] else ""
            print(f"stopped: {summary['stopped']}{hint}")
        if as_json:
            print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
