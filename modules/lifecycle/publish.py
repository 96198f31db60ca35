"""Push an export or a merge to the Hugging Face Hub with its model card, honouring private/public.

``huggingface_hub`` does the work: ``create_repo(private=...)`` when the repo does not exist, then one
``create_commit`` with exactly the files a push sends: a file given (a GGUF) alone, or a folder's own files (an
export or a merge: weights, config, tokenizer; an adapter without its run's records and checkpoints, its base
named in adapter_config.json rather than a local path), never the folder around a file, and the model card. The card is
sent from memory: nothing is written into the user's folder, and a README.md the folder already has is the card
(it is never replaced). No token is an error before anything is sent. An existing repo keeps its visibility unless
``private`` is given, and then it is set to what was asked. The token is never printed (not in ``repr``).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from modules import jobs
from modules.errors import InvalidRequest, TextgenError
from modules.lifecycle import model_card


class PushError(TextgenError):
    """The Hub refused the push (auth, permissions, name); the message is the Hub's."""


@dataclass
class PushArgs:
    """A folder and where it goes."""

    folder: Path  # an export's or a merge's folder, or one file (a GGUF): only that file is sent
    repo: str  # ORG/NAME
    private: bool | None = None  # None: a new repo is public, an existing one keeps its visibility
    token: str | None = field(default=None, repr=False)  # default: HF_TOKEN or the saved login
    endpoint: str | None = None  # default: HF_ENDPOINT or huggingface.co
    license: str = ""
    base_model: str = ""
    message: str = "Upload from textgen"
    card: bool = True  # send a model card (README.md): the folder's own, else one made for these files


def prepare(args: PushArgs) -> tuple[Path, list[str], str]:
    """The folder the files are read from, the files a push sends (README.md included when there is a card, and
    relative to that folder) and the card's text. Writes nothing."""
    target = Path(args.folder)
    if args.repo.count("/") != 1 or not all(args.repo.split("/")):
        raise InvalidRequest(f"the repo must be ORG/NAME, not {args.repo!r}", "repo")
    if target.is_file():
        folder, files = target.parent, [target.name]
    elif target.is_dir():
        folder, files = target, [f for f in model_card.upload_files(target) if f != "README.md"]
    else:
        raise InvalidRequest(f"{target} is neither a file nor a folder", "folder")
    if not files:
        raise InvalidRequest(f"{target} holds nothing to upload", "folder")
    text = ""
    own = target / "README.md" if target.is_dir() else None
    if own is not None and own.is_file():
        text = own.read_text(encoding="utf-8")  # the user's own card, sent as it is
    elif args.card:
        card_args = model_card.CardArgs(folder, args.repo, files=[*files, "README.md"], base_model=args.base_model,
                                        license=args.license)  # fmt: skip
        text = model_card.render(card_args)
    return folder, sorted({*files, *(["README.md"] if text else [])}), text


def find_token(args: PushArgs) -> str:
    """The token a push uses: the one given, else HF_TOKEN or the saved login; a PushError when there is none."""
    from huggingface_hub import get_token

    token = args.token or get_token()
    if not token:
        raise PushError("pushing needs a Hugging Face token with write access: set HF_TOKEN or run `hf auth login`")
    return token


def push(args: PushArgs, report: jobs.Reporter, cancel: threading.Event) -> dict[str, Any]:
    """Create (or reuse) the repo and upload; returns the repo URL, its visibility and the files sent."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError, RepositoryNotFoundError

    token = find_token(args)
    api = HfApi(endpoint=args.endpoint, token=token)
    folder, files, card = prepare(args)
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
        from huggingface_hub import CommitOperationAdd

        operations = [
            CommitOperationAdd(path_in_repo=name, path_or_fileobj=card.encode() if name == "README.md" and card
                               else model_card.public_bytes(folder / name) if name == "adapter_config.json"
                               else str(folder / name))
            for name in files
        ]  # fmt: skip
        api.create_commit(repo_id=args.repo, operations=operations, commit_message=args.message, token=token)
    except HfHubHTTPError as exc:
        raise PushError(f"the Hub refused the push to {args.repo}: {exc}") from exc
    report(done=2, total=2, message="pushed")
    return {"url": f"{api.endpoint}/{args.repo}", "repo": args.repo, "private": bool(info.private), "files": files}
