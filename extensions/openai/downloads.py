"""Admin API for Hub downloads, as a long job: start one, read its progress while it runs, cancel it.

- ``POST /v1/internal/model/download`` ``{"repo": "ORG/NAME[:BRANCH]", "quant": "Q4_K_M", ...}``: the repo is
  resolved first (404 for a missing repo or branch, 403 for a gated one without access, 400 for a bad name or
  quantization), then the download runs in the background: 202 with ``job_id`` and what it will fetch (the
  same download while it runs answers with the same ``job_id``; another download while one runs is 409);
- ``GET /v1/internal/model/download/{job_id}``: state (running, done, failed, cancelled), bytes done and total,
  fraction, ETA, the current file, and when done the model's name to load;
- ``POST /v1/internal/model/download/{job_id}/cancel``: stop it; what arrived is kept for the next try.
"""

from __future__ import annotations

from typing import Any

import anyio
from fastapi import APIRouter
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from extensions.openai.errors import APIError
from modules import jobs
from modules.errors import InvalidRequest
from modules.lifecycle import hub


class DownloadRequest(BaseModel):
    """The body of ``POST /v1/internal/model/download`` (the fields of ``download_model.py``)."""

    model_config = ConfigDict(extra="forbid")

    repo: str = Field(min_length=1, description="ORG/NAME or ORG/NAME:BRANCH")
    branch: str | None = None
    include: list[str] = Field(default_factory=list)
    exclude: list[str] = Field(default_factory=list)
    specific_file: str | None = None
    quant: str | None = None
    token: str | None = Field(None, description="Hub token for a gated or private repo (default: the server's)")


def _api_error(exc: Exception) -> APIError:
    if isinstance(exc, hub.HubGatedRepo):
        return APIError(403, str(exc), type_="permission_error", param="repo", code="gated_repo")
    if isinstance(exc, hub.HubRepoNotFound):
        return APIError(404, str(exc), type_="not_found_error", param="repo", code="repo_not_found")
    if isinstance(exc, InvalidRequest):
        return APIError(400, str(exc), param=exc.param, code=exc.code)
    if isinstance(exc, jobs.Busy):
        return APIError(409, str(exc), code="download_running")
    return APIError(502, str(exc), type_="server_error", code="hub_unavailable")


async def start_download(req: DownloadRequest) -> JSONResponse:
    """POST /v1/internal/model/download"""
    args = hub.DownloadArgs(
        repo=req.repo,
        branch=req.branch,
        include=list(req.include),
        exclude=list(req.exclude),
        specific_file=req.specific_file,
        quant=req.quant,
        token=req.token,
    )
    try:
        plan = await anyio.to_thread.run_sync(hub.prepare, args)
        job = hub.start_job(plan, exclusive=True)  # the same request while it runs gets the same job
    except (hub.HubError, hub.HubRepoNotFound, InvalidRequest, jobs.Busy) as exc:
        raise _api_error(exc) from exc
    body = {"job_id": job.id, "state": job.state, "progress": f"/v1/internal/model/download/{job.id}", **plan.to_dict()}
    return JSONResponse(body, status_code=202)


def _job(job_id: str) -> jobs.Job:
    job = jobs.get(job_id)
    if job is None or job.kind != hub.JOB_KIND:
        raise APIError(
            404, f"no download job {job_id!r}", type_="not_found_error", param="job_id", code="job_not_found"
        )
    return job


def download_status(job_id: str) -> dict[str, Any]:
    """GET /v1/internal/model/download/{job_id}"""
    return _job(job_id).to_dict()


def cancel_download(job_id: str) -> dict[str, Any]:
    """POST /v1/internal/model/download/{job_id}/cancel"""
    job = _job(job_id)
    jobs.cancel(job_id)
    job.wait(10)
    return job.to_dict()


def register(router: APIRouter, admin: list[Any]) -> None:
    """Add the download routes (admin only) to the API router."""
    router.add_api_route("/internal/model/download", start_download, methods=["POST"], dependencies=admin)
    router.add_api_route("/internal/model/download/{job_id}", download_status, methods=["GET"], dependencies=admin)
    router.add_api_route(
        "/internal/model/download/{job_id}/cancel", cancel_download, methods=["POST"], dependencies=admin
    )
