"""The lifecycle's three hooks in the load path (``modules/models.py`` calls them; none of them runs at import):

- :func:`first_use_download`: a model named ``ORG/NAME[:BRANCH]`` that is not in models/ is downloaded first;
- :func:`auto_plan`: with ``--auto``, the smart plan fills the settings the user left at their defaults;
- :func:`snapshot` / :func:`record_load`: the memory a load takes, measured beside its estimate;
- :func:`settle`: the garbage collection between two models.

A failure of the plan or of the measurement is logged and never stops a load; a failed download does.
"""

from __future__ import annotations

import gc
import logging
import time
from pathlib import Path
from typing import Any

from modules import jobs, shared
from modules.lifecycle import memory

log = logging.getLogger(__name__)


def first_use_download(name: str, overrides: dict[str, Any] | None = None) -> str:
    """The local name to load: ``name`` itself, or the download of the Hub repo it names (never for a loader
    that serves a name rather than a file, such as ``remote``)."""
    from modules import loaders

    asked = (overrides or {}).get("loader") or shared.settings.loader
    if asked and loaders.normalize(str(asked)) in loaders.NO_FILE:
        return name
    return ensure_local(name)


def ensure_local(name: str, report: jobs.Reporter | None = None) -> str:
    """The local name for ``name``: itself when it is in the models folder; for ``ORG/NAME[:BRANCH]`` that is
    not, the earlier download or a new one (a GGUF repo gives its Q4_K_M file), run as the shared download job.
    Used by the load path only (and the Workbench)."""
    from modules.errors import InvalidRequest
    from modules.lifecycle import hub
    from modules.paths import UnsafePath, safe_child

    root = shared.models_dir()
    try:
        if safe_child(root, name).exists():
            return name
    except UnsafePath:
        return name  # the loader reports the bad name
    if not hub.looks_like_repo(name):
        return name
    found = hub.local_name(name)
    if found:
        return found
    from huggingface_hub import constants

    if constants.is_offline_mode():
        return name  # "not in models/" as before; nothing is fetched offline
    plan = hub.prepare(hub.DownloadArgs(repo=name))
    job = hub.start_job(plan)  # joins the job already fetching it, if a concurrent load (or the API) started one
    mib = plan.selection.total_bytes / 2**20
    log.info("Downloading %s: not in %s, fetching %.1f MiB from the Hub (job %s)", name, root, mib, job.id)
    last = -1
    while not job.wait(0.5):  # the load waits; the job's progress is readable (GET /v1/internal/model/download/ID)
        if report:
            report(done=job.done, total=job.total, message=job.message)
        if job.total:
            tenth = int(job.done * 10 // job.total)
            if tenth != last:
                last = tenth
                log.info(
                    "Downloading %s: %.1f / %.1f MiB (%d%%)", name, job.done / 2**20, job.total / 2**20, tenth * 10
                )
    if job.state == "failed":
        if isinstance(job.exception, Exception):
            raise job.exception
        raise hub.HubError(f"the download of {name} failed: {job.error}")
    if job.state == "cancelled":
        raise hub.HubError(f"the download of {name} was cancelled; what arrived is kept: load it again to resume")
    result = job.result
    if result["kind"] == "lora":
        raise InvalidRequest(
            f"{name} is a LoRA adapter, not a model: it was saved to {result['path']}; apply it in the LoRA panel"
        )
    return str(result["name"])


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


def settle(unloaded: bool = True) -> None:
    """A garbage collection with no model loaded, after which what is still alive (the process's modules, the
    web UI, settings) is left out of later collections (``gc.freeze``): they walk only what came since (a model,
    requests). ``unloaded``: a model was just unloaded; then what earlier settles froze is taken back and walked
    too, so that what was alive at a settle and became cyclic garbage since is freed, unless that was done less
    than ``FULL_EVERY`` seconds ago (a script or a test that loads model after model). With no model before a
    load, only what came since the last settle is walked.

    Why: a full collection walks every object the process holds, 0.15-0.2 s in a server that has imported gradio,
    torch and transformers and 0.4-0.5 s in a test process (2-core AMD EPYC), and the load path ran three (the
    unload, before the load, after it); Python's own full collections, which come as replies create objects,
    held the GIL as long.
    """
    global _last_full
    full = unloaded and time.monotonic() - _last_full >= FULL_EVERY
    if full:
        gc.unfreeze()
        _last_full = time.monotonic()
    gc.collect()
    gc.freeze()


FULL_EVERY = 60.0
_last_full = -FULL_EVERY  # when an unload last walked everything


def snapshot() -> tuple[int, int]:
    """(RSS, GPU bytes) of this process now, after a garbage collection (cheap after :func:`settle`)."""
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
