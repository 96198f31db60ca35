"""The download command line: ``download_model.py`` and ``python -m modules.lifecycle download`` (a tqdm bar
over :func:`modules.lifecycle.hub.fetch`; Ctrl+C keeps what arrived for the next run)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from modules import jobs, shared
from modules.errors import TextgenError
from modules.lifecycle.hub import DownloadArgs, fetch, prepare


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The download flags (``download_model.py`` and ``python -m modules.lifecycle download``)."""
    parser.add_argument("repo", metavar="ORG/NAME[:BRANCH]", help="the Hub repo")
    parser.add_argument("--branch", help="branch, tag or commit (default: main)")
    parser.add_argument("--include", nargs="+", default=[], metavar="GLOB", help="only files matching these")
    parser.add_argument("--exclude", nargs="+", default=[], metavar="GLOB", help="leave out files matching these")
    parser.add_argument("--specific-file", metavar="F", help="only this file of the repo")
    parser.add_argument("--quant", metavar="Q", help="GGUF quantization (default Q4_K_M, else the nearest)")
    parser.add_argument("--output", type=Path, metavar="DIR", help="folder instead of models/ (or loras/)")
    parser.add_argument("--token", help=argparse.SUPPRESS)  # refused: `ps` would show it (HF_TOKEN or a login)
    parser.add_argument("--list", action="store_true", help="show the files, quantizations and target; fetch nothing")
    parser.add_argument("--model-dir", type=Path, help="the models folder (default: models)")
    parser.add_argument("--lora-dir", type=Path, help="the LoRA folder (default: loras)")


def run_cli(args: argparse.Namespace) -> int:
    """Run a download in the foreground with a tqdm bar; Ctrl+C keeps what arrived for the next run."""
    from modules.settings import Settings

    if getattr(args, "token", None):
        print("error: a token is not taken on the command line, where `ps` shows it to every user of the machine: "
              "set HF_TOKEN or run `hf auth login`", file=sys.stderr)  # fmt: skip
        return 2
    overrides = {k: getattr(args, k) for k in ("model_dir", "lora_dir") if getattr(args, k, None)}
    if overrides:
        shared.settings = Settings(**{**shared.settings.model_dump(), **overrides})
    request = DownloadArgs(
        repo=args.repo,
        branch=args.branch,
        include=list(args.include),
        exclude=list(args.exclude),
        specific_file=args.specific_file,
        quant=args.quant,
        output=args.output,
    )
    plan = prepare(request)
    for note in plan.selection.notes:
        print(f"note: {note}", file=sys.stderr)
    if args.list:
        print(json.dumps(plan.to_dict(), indent=2))
        return 0
    print(f"{plan.repo_id}@{plan.branch}: {len(plan.selection.files)} file(s), "
          f"{plan.selection.total_bytes / 2**20:,.1f} MiB -> {plan.target}")  # fmt: skip
    try:
        result = jobs.run_foreground(plan.repo_id, lambda report, cancel: fetch(plan, report, cancel), unit="B")
    except KeyboardInterrupt:
        print(f"\ninterrupted: the files so far are kept in {plan.staging}; run the same command to resume")
        return 130
    print(f"saved: {result.path}" + (f" ({len(result.reused)} file(s) were already complete)" if result.reused else ""))
    return 0


def main(argv: list[str] | None = None) -> int:
    """``download_model.py``: one line of error (exit 1) for anything a user can fix."""
    parser = argparse.ArgumentParser(
        prog="download_model.py", description="Download a model from the Hugging Face Hub."
    )
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run_cli(args)
    except TextgenError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
