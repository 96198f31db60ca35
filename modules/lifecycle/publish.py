"""Push a folder (an export or a merge) to the Hugging Face Hub with its model card, honouring private/public.

``huggingface_hub`` does the work: ``create_repo(private=...)`` when the repo does not exist, then ``upload_folder``
with exactly the files the card names. No token is an error before anything is sent (the Hub would answer 401 anyway). An
existing repo keeps its visibility unless ``private`` is given, and then it is set to what was asked.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from modules import jobs
from modules.errors import InvalidRequest, TextgenError
from modules.fileio import atomic_write_text
from modules.lifecycle import model_card


class PushError(TextgenError):
    """The Hub refused the push (auth, permissions, name); the message is the Hub's."""


@dataclass
class PushArgs:
    """A folder and where it goes."""

    folder: Path
    repo: str  # ORG/NAME
    private: bool | None = None  # None: a new repo is public, an existing one keeps its visibility
    token: str | None = None  # default: HF_TOKEN or the saved login
    endpoint: str | None = None  # default: HF_ENDPOINT or huggingface.co
    license: str = ""
    base_model: str = ""
    message: str = "Upload from textgen"
    card: bool = True  # write README.md (the model card) into the folder first


def prepare(args: PushArgs) -> tuple[list[str], str]:
    """The files that will be uploaded (README.md included) and the card's text; writes README.md."""
    folder = Path(args.folder)
    if not folder.is_dir():
        raise InvalidRequest(f"{folder} is not a folder", "folder")
    if args.repo.count("/") != 1 or not all(args.repo.split("/")):
        raise InvalidRequest(f"the repo must be ORG/NAME, not {args.repo!r}", "repo")
    files = [f for f in model_card.upload_files(folder) if f != "README.md"]
    if not files:
        raise InvalidRequest(f"{folder} holds nothing to upload", "folder")
    text = ""
    if args.card:
        card_args = model_card.CardArgs(folder, args.repo, files=[*files, "README.md"], base_model=args.base_model,
                                        license=args.license)  # fmt: skip
        text = model_card.render(card_args)
        atomic_write_text(folder / "README.md", text)
    elif (folder / "README.md").is_file():
        text = (folder / "README.md").read_text(encoding="utf-8")
    return sorted({*files, *(["README.md"] if text else [])}), text


def push(args: PushArgs, report: jobs.Reporter, cancel: threading.Event) -> dict[str, Any]:
    """Create (or reuse) the repo and upload; returns the repo URL, its visibility and the files sent."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError, RepositoryNotFoundError

    api = HfApi(endpoint=args.endpoint, token=args.token)
    token = args.token or api.token
    if not token:
        from huggingface_hub import get_token

        token = get_token()
    if not token:
        raise PushError("pushing needs a Hugging Face token with write access: set HF_TOKEN or run `hf auth login`")
    files, _ = prepare(args)
    jobs.check(cancel)
    report(done=0, total=2, message=f"creating {args.repo}")
    try:
        try:
            info = api.model_info(args.repo, token=token)  # an existing repo gets a new commit
        except RepositoryNotFoundError:
            api.create_repo(args.repo, token=token, private=bool(args.private))
            info = api.model_info(args.repo, token=token)
        if args.private is not None and bool(info.private) != args.private:
            api.update_repo_settings(args.repo, private=args.private, token=token)
            info = api.model_info(args.repo, token=token)
        jobs.check(cancel)
        report(done=1, total=2, message=f"uploading {len(files)} files")
        api.upload_folder(repo_id=args.repo, folder_path=str(args.folder), allow_patterns=files, token=token,
                          commit_message=args.message)  # fmt: skip
    except HfHubHTTPError as exc:
        raise PushError(f"the Hub refused the push to {args.repo}: {exc}") from exc
    report(done=2, total=2, message="pushed")
    return {"url": f"{api.endpoint}/{args.repo}", "repo": args.repo, "private": bool(info.private), "files": files}
