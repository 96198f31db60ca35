"""The lifecycle's three hooks in the load path (``modules/models.py`` calls them; none of them runs at import):

- :func:`first_use_download`: a model named ``ORG/NAME[:BRANCH]`` that is not in models/ is downloaded first;
- :func:`auto_plan`: with ``--auto``, the smart plan fills the settings the user left at their defaults;
- :func:`snapshot` / :func:`record_load`: the memory a load takes, measured beside its estimate.

A failure of the plan or of the measurement is logged and never stops a load; a failed download does.
"""

from __future__ import annotations

import gc
import logging
from pathlib import Path
from typing import Any

from modules import shared
from modules.lifecycle import memory

log = logging.getLogger(__name__)


def first_use_download(name: str, overrides: dict[str, Any] | None = None) -> str:
    """The local name to load: ``name`` itself, or the download of the Hub repo it names (never for a loader
    that serves a name rather than a file, such as ``remote``)."""
    from modules import loaders
    from modules.lifecycle import hub

    asked = (overrides or {}).get("loader") or shared.settings.loader
    if asked and loaders.normalize(str(asked)) in loaders.NO_FILE:
        return name
    return hub.ensure_local(name)


def _analysis(path: Path) -> Any:
    from modules.lifecycle import analyzer

    return analyzer.analyze_gguf(path) if path.is_file() else analyzer.analyze_folder(path)


def auto_plan(path: Path, resolved: Any) -> None:
    """With ``--auto``: apply this machine's plan for the model at ``path`` to its resolved settings."""
    if not shared.settings.auto or not path.exists():
        return
    from modules.lifecycle import hardware, smart_config
    from modules.lifecycle.analyzer import Analysis

    try:
        analysis: Analysis = _analysis(path)
        plan = smart_config.make_plan(
            analysis,
            hardware.detect(),
            allow_remote_code=bool(resolved.options.get("trust_remote_code")),
            parallel=int(resolved.options.get("parallel") or 4),
        )
    except Exception as exc:  # a plan is advice: the load goes on without it
        log.warning("--auto: no plan for %s: %s", path.name, exc)
        return
    changed = smart_config.apply(plan, resolved)
    log.info(
        "--auto plan for %s: %s", path.name, ", ".join(f"{k}={resolved.options.get(k)}" for k in changed) or "no change"
    )


def snapshot() -> tuple[int, int]:
    """(RSS, GPU bytes) of this process now, after a garbage collection."""
    gc.collect()
    return memory.process_rss(), memory.gpu_allocated()


def record_load(name: str, path: Path, loader: str, options: dict[str, Any], before: tuple[int, int]) -> None:
    """Measure what the load took and keep it with its estimate in ``memory.last_load`` (and the log)."""
    try:
        rss, gpu = snapshot()
        estimate = None
        try:
            from modules.lifecycle import smart_config

            estimate = smart_config.estimate(_analysis(path), loader, options)
        except Exception as exc:  # no estimate for this model; the measurement is still worth showing
            log.debug("no memory estimate for %s: %s", name, exc)
        memory.last_load = memory.LoadMeasurement(name, loader, estimate, rss - before[0], max(0, gpu - before[1]))
        log.info("Memory: %s", memory.last_load.text())
    except Exception as exc:
        log.debug("could not measure the load of %s: %s", name, exc)
