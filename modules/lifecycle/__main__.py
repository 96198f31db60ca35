"""The model lifecycle CLI: ``python -m modules.lifecycle COMMAND ...`` (inspect, recommend, download, ...).

Each command is one :class:`Command` in :data:`COMMANDS`: a name, a one-line help, a function that adds its
arguments to its own sub-parser, and a function that runs it and returns the exit code. A new command (merge,
export, quantize, card, push) is one more entry; its work lives in its own module, imported only when it runs.
A command that fails with a :class:`~modules.errors.TextgenError` prints ``error: MESSAGE`` and exits 1.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from modules.errors import TextgenError
from modules.lifecycle.cli_export import EXPORT_COMMANDS


@dataclass(frozen=True)
class Command:
    """One subcommand of the lifecycle CLI."""

    name: str
    help: str
    configure: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


def print_json(data: Any) -> None:
    """Print one JSON object (the ``--json`` output of every command)."""
    print(json.dumps(data, indent=2, default=str))


def _target_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("target", metavar="PATH_OR_REPO", help="a GGUF file, a model folder, or ORG/NAME[:BRANCH]")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--quant", help="for a GGUF repo: the quantization to inspect (default Q4_K_M)")


def _recommend_args(parser: argparse.ArgumentParser) -> None:
    _target_args(parser)
    parser.add_argument("--trust-remote-code", action="store_true", help="allow models that ship Python code")
    parser.add_argument("--parallel", type=int, default=None, help="generation slots to plan for (default 4)")


def _inspect(args: argparse.Namespace) -> int:
    from modules.lifecycle import analyzer

    analysis = analyzer.analyze(args.target, quant=args.quant)
    if args.json:
        print_json(analysis.to_dict())
    else:
        print(analysis.summary())
    return 0


def _recommend(args: argparse.Namespace) -> int:
    from modules.lifecycle import analyzer, hardware, smart_config

    analysis = analyzer.analyze(args.target, quant=args.quant)
    plan = smart_config.make_plan(
        analysis,
        hardware.detect(),
        allow_remote_code=args.trust_remote_code,
        parallel=args.parallel,
    )
    if args.json:
        print_json(plan.to_dict())
    else:
        print(plan.summary())
    return 0


def _download_args(parser: argparse.ArgumentParser) -> None:
    from modules.lifecycle import hub_cli

    hub_cli.add_arguments(parser)


def _download(args: argparse.Namespace) -> int:
    from modules.lifecycle import hub_cli

    return hub_cli.run_cli(args)


def _hardware(args: argparse.Namespace) -> int:
    from modules.lifecycle import hardware

    info = hardware.detect()
    if args.json:
        print_json(info.to_dict())
    else:
        print(info.summary())
    return 0


def _json_only(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON object")


COMMANDS: list[Command] = [
    Command("inspect", "what a model is: architecture, parameters, bytes, context, KV bytes/token", _target_args, _inspect),
    Command("recommend", "a plan for this machine: loader, quantization, context, GPU layers, ...", _recommend_args,
            _recommend),
    Command("download", "download a model from the Hugging Face Hub into models/ (or loras/)", _download_args,
            _download),
    Command("hardware", "this machine: CPU, vector extensions, RAM, GPUs", _json_only, _hardware),
]  # fmt: skip
"""Add a command here: ``Command(name, help, configure, run)``."""
COMMANDS += [Command(*entry) for entry in EXPORT_COMMANDS]


def build_parser() -> argparse.ArgumentParser:
    """The parser with one sub-parser per command."""
    parser = argparse.ArgumentParser(prog="python -m modules.lifecycle", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        child = sub.add_parser(command.name, help=command.help, description=command.help)
        command.configure(child)
        child.set_defaults(_run=command.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one command; a typed error is one line on stderr and exit code 1."""
    args = build_parser().parse_args(argv)
    try:
        return int(args._run(args))
    except TextgenError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `... | head`
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    sys.exit(main())
