"""Logging with levels: INFO by default, DEBUG with --verbose; third-party chatter kept at WARNING."""

from __future__ import annotations

import logging
import sys


def setup_logging(verbose: bool = False) -> None:
    """Configure the root logger once for the server process."""
    level = logging.DEBUG if verbose else logging.INFO
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)-7s %(name)s: %(message)s", "%H:%M:%S"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    for noisy in (
        "httpx",
        "httpcore",
        "urllib3",
        "uvicorn.access",
        "gradio",
        "matplotlib",
        "PIL",
        "asyncio",
        "multipart",
    ):
        logging.getLogger(noisy).setLevel(logging.DEBUG if verbose and noisy.startswith("uvicorn") else logging.WARNING)
