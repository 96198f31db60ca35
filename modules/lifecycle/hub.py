"""Download models from the Hugging Face Hub into models/ (an adapter into loras/): resumable, verified, atomic.

Built on ``huggingface_hub``: ``HfApi.model_info`` lists the files with their checksums, ``get_hf_file_metadata``
and ``http_get`` fetch each one with the library's auth headers, redirects, retries and HTTP ``Range`` resume.
``HF_TOKEN`` (or ``hf auth login``) and ``HF_ENDPOINT`` are honoured; ``HF_HUB_OFFLINE=1`` turns downloads off.

Why not ``hf_hub_download``/``snapshot_download`` with ``local_dir``: in the pinned huggingface_hub (2.4.0) they write
each file to a per-process temporary name and delete it when the download fails, so an interrupted multi-GB GGUF
starts again from zero (``test_the_librarys_hf_hub_download_starts_over_after_a_failed_run`` keeps this checked).
Here every file grows in ``models/.downloads/NAME/PATH.part`` (next to a note of the file's ETag) and a later run,
or the library's own retry within a run, asks only for the missing bytes. A file is checked against its sha256
(LFS) or git blob id before it is kept; the model appears under its final name only when every file is complete:
a folder ``models/ORG_NAME[_BRANCH]/``, a single GGUF straight in ``models/``, a PEFT adapter in ``loras/ORG_NAME/``.

Every download in the server runs as a job (:func:`start_job`): two callers asking for the same files share one job,
and fetches into the same staging folder take turns, so a repo is never fetched twice at once nor half-overwritten.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from modules import jobs, shared
from modules.errors import InvalidRequest, ModelNotFound, TextgenError
from modules.fileio import atomic_write_text
from modules.lifecycle.hub_files import RepoFile, Selection, folder_name, select, single_file
from modules.paths import UnsafePath, safe_child

log = logging.getLogger(__name__)

STAGING = ".downloads"  # under the models (or loras) folder; list_models skips dot-folders
INDEX = "index.json"  # STAGING/index.json: repo spec -> local model name, for "download on first use"
_REPO = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_HASH_CHUNK = 8 << 20
JOB_KIND = "download"  # the jobs.start kind of every download (the API's, the Model tab's, first use)
_staging_guard = threading.Lock()
_staging_locks: dict[str, threading.Lock] = {}  # one fetch at a time per staging folder (per repo and branch)


class HubError(TextgenError):
    """A download could not be done (network, disk, the Hub's answer); the message says what to do."""


class HubRepoNotFound(ModelNotFound):
    """The repo (or the branch, or the file) is not on the Hub, or it is private to others."""


class HubGatedRepo(HubError):
    """The repo is gated: its conditions must be accepted on the Hub, and a token with access given."""

    def __init__(self, message: str, status: int = 401) -> None:
        super().__init__(message)
        self.status = status


class ChecksumMismatch(HubError):
    """A downloaded file does not match the checksum the Hub lists for it; it was deleted."""


@dataclass
class DownloadArgs:
    """What to download (the CLI flags, the Model tab's box and the API's body all become this)."""

    repo: str
    """``ORG/NAME`` or ``ORG/NAME:BRANCH``."""
    branch: str | None = None
    """Branch, tag or commit (default: main, or the one after ``:``)."""
    include: list[str] = field(default_factory=list)
    """Only files matching one of these globs (replaces the default choice)."""
    exclude: list[str] = field(default_factory=list)
    """Leave out files matching these globs."""
    specific_file: str | None = None
    """Only this file of the repo."""
    quant: str | None = None
    """For a GGUF repo: the quantization to take (default Q4_K_M, else the nearest)."""
    output: Path | None = None
    """Folder to put the model in instead of the models folder (or the LoRA folder)."""
    token: str | None = field(default=None, repr=False)
    """Hub token; default: HF_TOKEN or the stored login. Never printed."""
    endpoint: str | None = None
    """Hub address; default: HF_ENDPOINT or https://huggingface.co."""


@dataclass
class DownloadPlan:
    """A download resolved against the Hub: the commit, the files, where they go. Nothing fetched yet."""

    repo_id: str
    branch: str
    commit: str
    endpoint: str
    selection: Selection
    base: Path  # the models (or loras) folder, or --output
    target: Path  # the final file or folder
    gated: bool = False
    token: str | None = field(default=None, repr=False)

    @property
    def name(self) -> str:
        """The name to load it by: the target relative to its base folder."""
        return self.target.relative_to(self.base).as_posix()

    @property
    def staging(self) -> Path:
        """Where the files grow until every one is complete."""
        return self.base / STAGING / folder_name(self.repo_id, self.branch)

    def to_dict(self) -> dict[str, Any]:
        """What the API, the UI and ``--list`` show."""
        return {
            "repo": self.repo_id,
            "branch": self.branch,
            "commit": self.commit,
            "kind": self.selection.kind,
            "quant": self.selection.quant,
            "quants": list(self.selection.quants),
            "files": [{"path": f.path, "size": f.size} for f in self.selection.files],
            "total_bytes": self.selection.total_bytes,
            "target": str(self.target),
            "name": self.name,
            "notes": list(self.selection.notes),
            "gated": self.gated,
        }


@dataclass
class DownloadResult:
    """What a finished download left on disk."""

    path: Path
    name: str  # as the Model tab lists it (or the LoRA's folder name)
    kind: str  # "gguf" | "hf" | "lora"
    files: list[str]
    bytes_fetched: int  # over the network in this run
    bytes_total: int
    reused: list[str] = field(default_factory=list)  # files already complete (from an earlier run)

    def to_dict(self) -> dict[str, Any]:
        """JSON for the API and the job's result."""
        return {
            "path": str(self.path),
            "name": self.name,
            "kind": self.kind,
            "files": self.files,
            "bytes_fetched": self.bytes_fetched,
            "bytes_total": self.bytes_total,
            "reused": self.reused,
        }


def parse_repo(spec: str, branch: str | None = None) -> tuple[str, str]:
    """``ORG/NAME[:BRANCH]`` -> (repo id, branch); an explicit ``branch`` wins over the one after ``:``."""
    repo, _, tail = spec.strip().partition(":")
    repo = repo.strip().strip("/")
    if repo.startswith(("https://", "http://")):
        raise InvalidRequest(f"{spec!r}: give the repo as ORG/NAME, not a URL", param="repo")
    if not _REPO.match(repo) or ".." in repo:
        raise InvalidRequest(f"{spec!r} is not a Hub repo name (expected ORG/NAME or ORG/NAME:BRANCH)", param="repo")
    return repo, (branch or tail.strip() or "main")


def looks_like_repo(name: str) -> bool:
    """True for ``ORG/NAME[:BRANCH]`` (and not a local ``folder/file.gguf``)."""
    repo = name.partition(":")[0]
    return bool(_REPO.match(repo)) and not repo.lower().endswith(".gguf") and ".." not in repo


def _endpoint(args: DownloadArgs) -> str:
    from huggingface_hub import constants

    return (args.endpoint or os.environ.get("HF_ENDPOINT") or constants.ENDPOINT).rstrip("/")


def _hub_error(exc: Exception, repo_id: str, branch: str, endpoint: str, token: str | None) -> TextgenError:
    """A huggingface_hub (or network) error as the typed error a user can act on."""
    from huggingface_hub import errors as hf_errors

    page = f"{endpoint}/{repo_id}"
    if isinstance(exc, hf_errors.GatedRepoError):
        status = exc.response.status_code if exc.response is not None else 401
        if token and status == 403:
            return HubGatedRepo(
                f"{repo_id} is gated and this token has no access yet: request access on {page}, then retry", 403
            )
        return HubGatedRepo(
            f"{repo_id} is gated: accept its conditions on {page}, then give a token with access "
            "(HF_TOKEN=hf_..., `hf auth login`, or the token field)",
            401 if not token else status,
        )
    if isinstance(exc, hf_errors.RevisionNotFoundError):
        return HubRepoNotFound(f"{repo_id} has no branch, tag or commit {branch!r}")
    if isinstance(exc, hf_errors.RemoteEntryNotFoundError):
        return HubRepoNotFound(f"a file is missing from {repo_id}@{branch}: {exc}")
    if isinstance(exc, hf_errors.RepositoryNotFoundError):
        hint = "" if token else ", or it is private (give a token with access: HF_TOKEN)"
        return HubRepoNotFound(f"{repo_id} is not on the Hub at {endpoint}{hint}; check the name")
    if isinstance(exc, hf_errors.OfflineModeIsEnabled):
        return HubError("downloads are off (HF_HUB_OFFLINE=1); unset it to download from the Hub")
    if isinstance(exc, hf_errors.HfHubHTTPError):
        status = exc.response.status_code if exc.response is not None else "?"
        return HubError(f"the Hub at {endpoint} answered {status} for {repo_id}: {str(exc).splitlines()[0]}")
    return HubError(
        f"cannot reach the Hub at {endpoint} ({type(exc).__name__}: {exc}); check the network or HF_ENDPOINT"
    )


def _check_online() -> None:
    from huggingface_hub import constants

    if constants.is_offline_mode():
        raise HubError("downloads are off (HF_HUB_OFFLINE=1); unset it to download from the Hub")


def list_files(repo_id: str, branch: str, endpoint: str, token: str | None) -> tuple[str, list[RepoFile], bool]:
    """(commit, files with sizes and checksums, gated) of a repo at a branch, from ``HfApi.model_info``."""
    import httpx2
    from huggingface_hub import HfApi
    from huggingface_hub import errors as hf_errors

    _check_online()
    api = HfApi(endpoint=endpoint, token=token, library_name="textgen")
    try:
        info = api.model_info(repo_id, revision=branch, files_metadata=True)
    except (hf_errors.HfHubHTTPError, httpx2.HTTPError, OSError) as exc:
        raise _hub_error(exc, repo_id, branch, endpoint, token) from exc
    files = [
        RepoFile(
            path=s.rfilename,
            size=int(s.lfs.size if s.lfs else s.size or 0),
            sha256=s.lfs.sha256 if s.lfs else None,
            blob_id=None if s.lfs else s.blob_id,
        )
        for s in info.siblings or []
    ]
    return str(info.sha or branch), files, bool(info.gated)


def prepare(args: DownloadArgs) -> DownloadPlan:
    """Resolve a download against the Hub (files, checksums, destination) without fetching anything.

    Raises InvalidRequest for a bad name or pattern, HubRepoNotFound, HubGatedRepo (checked with a request for
    the first file, so a missing or unaccepted token is told before anything is written), or HubError.
    """
    repo_id, branch = parse_repo(args.repo, args.branch)
    endpoint = _endpoint(args)
    token = args.token or None
    commit, files, gated = list_files(repo_id, branch, endpoint, token)
    selection = select(files, args.quant, args.include, args.exclude, args.specific_file)
    base = args.output or (shared.loras_dir() if selection.kind == "lora" else shared.models_dir())
    try:
        if single_file(selection):
            target = safe_child(base, selection.files[0].path.rsplit("/", 1)[-1])
        else:
            target = safe_child(base, folder_name(repo_id, branch))
    except UnsafePath as exc:
        raise InvalidRequest(f"cannot place {repo_id} in {base}: {exc}", param="repo") from exc
    plan = DownloadPlan(repo_id, branch, commit, endpoint, selection, base, target, gated, token)
    if gated:
        _file_metadata(plan, selection.files[0])  # raises HubGatedRepo now rather than mid-download
    return plan


def _file_metadata(plan: DownloadPlan, repo_file: RepoFile) -> Any:
    import httpx2
    from huggingface_hub import errors as hf_errors
    from huggingface_hub import get_hf_file_metadata, hf_hub_url

    url = hf_hub_url(plan.repo_id, repo_file.path, revision=plan.commit, endpoint=plan.endpoint)
    try:
        return get_hf_file_metadata(url, token=plan.token, endpoint=plan.endpoint, library_name="textgen")
    except (hf_errors.HfHubHTTPError, httpx2.HTTPError, OSError) as exc:
        raise _hub_error(exc, plan.repo_id, plan.branch, plan.endpoint, plan.token) from exc


class _Progress:
    """The file ``http_get`` writes into: counts bytes for the reporter and stops between chunks on Cancel.

    The check runs after a chunk is written, so a cancelled download keeps every byte it received.
    """

    def __init__(self, handle: Any, on_bytes: Callable[[int, bool], None], cancel: threading.Event) -> None:
        self._handle, self._on_bytes, self._cancel = handle, on_bytes, cancel

    def write(self, data: bytes) -> int:
        written = int(self._handle.write(data))
        self._on_bytes(len(data), True)
        jobs.check(self._cancel)
        return written

    def __getattr__(self, name: str) -> Any:  # seek, tell, truncate, flush
        return getattr(self._handle, name)


class _QuietBar:
    """A progress bar that draws nothing (the job's reporter shows progress); what ``http_get`` expects."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __enter__(self) -> _QuietBar:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def update(self, n: float | None = 1) -> None:
        pass


def file_checksum_ok(path: Path, repo_file: RepoFile) -> bool:
    """True when ``path`` has the size and the sha256 (LFS) or git blob id the Hub lists; True if none is listed."""
    if not path.is_file() or path.stat().st_size != repo_file.size:
        return False
    if repo_file.sha256:
        digest = hashlib.sha256()
    elif repo_file.blob_id:
        digest = hashlib.sha1(f"blob {repo_file.size}\0".encode())
    else:
        return True
    with open(path, "rb") as handle:
        while chunk := handle.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest() == (repo_file.sha256 or repo_file.blob_id)


def _fetch_file(
    plan: DownloadPlan,
    repo_file: RepoFile,
    dest: Path,
    on_bytes: Callable[[int, bool], None],
    cancel: threading.Event,
) -> None:
    """Grow ``dest``.part from where an earlier try stopped, check it, then rename it to ``dest``.

    ``on_bytes(n, fetched)`` is told of the bytes kept from an earlier try (``fetched`` False) and of each chunk.
    """
    import httpx2
    from huggingface_hub import errors as hf_errors
    from huggingface_hub.file_download import http_get
    from huggingface_hub.utils import build_hf_headers

    meta = _file_metadata(plan, repo_file)
    if repo_file.sha256 is None and repo_file.blob_id is None and meta.etag:
        if re.fullmatch(r"[0-9a-f]{64}", meta.etag):
            repo_file.sha256 = meta.etag
        elif re.fullmatch(r"[0-9a-f]{40}", meta.etag):
            repo_file.blob_id = meta.etag
    part, note = dest.with_name(dest.name + ".part"), dest.with_name(dest.name + ".part.json")
    dest.parent.mkdir(parents=True, exist_ok=True)
    stamp = {"etag": meta.etag, "size": repo_file.size, "commit": plan.commit}
    resume = 0
    if part.is_file():
        try:
            same = json.loads(note.read_text(encoding="utf-8")) == stamp
        except (OSError, ValueError):
            same = False
        resume = part.stat().st_size if same and part.stat().st_size <= repo_file.size else 0
    if resume == 0:
        part.write_bytes(b"")
        atomic_write_text(note, json.dumps(stamp))
    else:
        on_bytes(resume, False)
    headers = build_hf_headers(token=plan.token, library_name="textgen")
    location = str(meta.location)
    if urlparse(location).netloc != urlparse(plan.endpoint).netloc:
        headers.pop("authorization", None)  # a signed CDN address: the token stays with the Hub
    try:
        with open(part, "r+b") as handle:
            handle.seek(resume)
            http_get(
                location,
                _Progress(handle, on_bytes, cancel),  # type: ignore[arg-type]
                resume_size=resume,
                headers=headers,
                expected_size=repo_file.size or None,
                tqdm_class=_QuietBar,  # type: ignore[arg-type]
            )
    except jobs.Cancelled:
        raise
    except (hf_errors.HfHubHTTPError, httpx2.HTTPError) as exc:
        raise _hub_error(exc, plan.repo_id, plan.branch, plan.endpoint, plan.token) from exc
    except OSError as exc:
        raise HubError(f"{repo_file.path}: {exc}") from exc
    if not file_checksum_ok(part, repo_file):
        part.unlink(missing_ok=True)
        note.unlink(missing_ok=True)
        expected = repo_file.sha256 or repo_file.blob_id
        raise ChecksumMismatch(
            f"{repo_file.path} from {plan.repo_id} does not match its checksum ({expected}); the damaged copy was "
            "deleted: download it again"
        )
    os.replace(part, dest)
    note.unlink(missing_ok=True)


@contextlib.contextmanager
def _staging_turn(plan: DownloadPlan, report: jobs.Reporter | None, cancel: threading.Event) -> Iterator[None]:
    """Hold the staging folder of ``plan`` (waiting, cancellably, while another fetch in this process uses it)."""
    with _staging_guard:
        lock = _staging_locks.setdefault(str(plan.staging.resolve()), threading.Lock())
    told = False
    while not lock.acquire(timeout=0.2):
        jobs.check(cancel)
        if report and not told:
            told = True
            report(message=f"waiting for another download of {plan.repo_id} to finish")
    try:
        yield
    finally:
        lock.release()


def fetch(
    plan: DownloadPlan,
    report: jobs.Reporter | None = None,
    cancel: threading.Event | None = None,
) -> DownloadResult:
    """Download what ``plan`` lists; files already complete (in the target or staged) are kept, not fetched.

    Another fetch of the same repo and branch in this process is waited for first (then its files count as
    complete here)."""
    _check_online()
    cancel = cancel or threading.Event()
    with _staging_turn(plan, report, cancel):
        return _fetch(plan, report, cancel)


def _fetch(plan: DownloadPlan, report: jobs.Reporter | None, cancel: threading.Event) -> DownloadResult:
    files = plan.selection.files
    total = plan.selection.total_bytes
    done = 0
    fetched = 0
    reused: list[str] = []
    staging = plan.staging
    single = single_file(plan.selection)

    def final_path(repo_file: RepoFile) -> Path:
        return plan.target if single else safe_child(plan.target, repo_file.path)

    free = shutil.disk_usage(plan.base if plan.base.exists() else plan.base.parent).free
    if free < total:
        raise HubError(f"{plan.repo_id} needs {total / 2**30:.2f} GiB; {plan.base} has {free / 2**30:.2f} GiB free")
    staging.mkdir(parents=True, exist_ok=True)
    for index, repo_file in enumerate(files, 1):
        jobs.check(cancel)
        label = f"{repo_file.path} ({index}/{len(files)})"
        staged = safe_child(staging, repo_file.path)
        if file_checksum_ok(final_path(repo_file), repo_file) or file_checksum_ok(staged, repo_file):
            reused.append(repo_file.path)
            done += repo_file.size
            if report:
                report(done=done, total=total, message=f"{label}: already complete")
            continue

        def on_bytes(n: int, network: bool, label: str = label) -> None:
            nonlocal done, fetched
            done += n
            fetched += n if network else 0
            if report:
                report(done=done, total=total, message=label)

        before = done
        _fetch_file(plan, repo_file, staged, on_bytes, cancel)
        done = before + repo_file.size
    _place(plan, staging, single, reused)
    if plan.selection.kind != "lora" and plan.base == shared.models_dir():
        _remember(plan)
    if report:
        report(done=total, total=total, message=f"saved to {plan.target}")
    log.info("Downloaded %s@%s to %s (%d bytes fetched)", plan.repo_id, plan.branch, plan.target, fetched)
    return DownloadResult(plan.target, plan.name, plan.selection.kind, [f.path for f in files], fetched, total, reused)


def _place(plan: DownloadPlan, staging: Path, single: bool, reused: list[str]) -> None:
    """Move the staged files to their final names: one rename for a new folder, one per file otherwise."""
    for note in staging.rglob("*.part.json"):
        note.unlink()
    staged = [f for f in plan.selection.files if safe_child(staging, f.path).is_file()]
    if single:
        if staged:
            os.replace(safe_child(staging, staged[0].path), plan.target)
    elif not plan.target.exists() and len(staged) == len(plan.selection.files):
        os.replace(staging, plan.target)
    else:
        for repo_file in staged:
            dest = safe_child(plan.target, repo_file.path)
            dest.parent.mkdir(parents=True, exist_ok=True)
            os.replace(safe_child(staging, repo_file.path), dest)
    shutil.rmtree(staging, ignore_errors=True)
    root = plan.base / STAGING
    if root.is_dir() and not any(p for p in root.iterdir() if p.name != INDEX) and not (root / INDEX).exists():
        root.rmdir()


def download(
    args: DownloadArgs, report: jobs.Reporter | None = None, cancel: threading.Event | None = None
) -> DownloadResult:
    """Resolve and fetch in one call (the job function of the Model tab, the API and the CLI)."""
    return fetch(prepare(args), report, cancel)


def job_key(plan: DownloadPlan) -> str:
    """What a download job fetches: the same key means the same files to the same place (one job serves both)."""
    files = sorted(f.path for f in plan.selection.files)
    return json.dumps([plan.endpoint, plan.repo_id, plan.commit, str(plan.target), files])


def start_job(plan: DownloadPlan, *, exclusive: bool = False, owner: str | None = None) -> jobs.Job:
    """Fetch ``plan`` in a background job (result: :meth:`DownloadResult.to_dict`); while a job fetching the same
    files runs, that one is returned instead, so a second caller joins it. ``exclusive``: :class:`jobs.Busy` when
    any other download runs (the API's rule)."""
    return jobs.start(
        JOB_KIND,
        plan.repo_id,
        lambda report, cancel: fetch(plan, report, cancel).to_dict(),
        exclusive=exclusive,
        owner=owner,
        key=job_key(plan),
    )


# ---------------------------------------------------------------- what earlier downloads were saved as (first use: load_hooks)
def _index_path() -> Path:
    return shared.models_dir() / STAGING / INDEX


def _read_index() -> dict[str, str]:
    try:
        data = json.loads(_index_path().read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return {str(k): str(v) for k, v in data.items()} if isinstance(data, dict) else {}


def _remember(plan: DownloadPlan) -> None:
    index = _read_index()
    index[f"{plan.repo_id}:{plan.branch}"] = plan.name
    atomic_write_text(_index_path(), json.dumps(index, indent=1, sort_keys=True))


def local_name(spec: str) -> str | None:
    """The models-folder name a repo was downloaded as (by an earlier download), if it is still there."""
    try:
        repo_id, branch = parse_repo(spec)
    except InvalidRequest:
        return None
    root = shared.models_dir()
    candidates = [_read_index().get(f"{repo_id}:{branch}"), folder_name(repo_id, branch)]
    for name in candidates:
        if name and safe_child(root, name).exists():
            return name
    return None
