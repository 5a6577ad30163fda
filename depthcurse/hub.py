"""Sharing a checkpoint: a folder `drop` or `heal` saved, uploaded to the Hugging Face hub with
`huggingface_hub` (the user's token as it finds it: `HF_TOKEN` or `hf auth login`). Where the hub
cannot be reached, or refuses, one line says why and the local folder stays as it is."""

from __future__ import annotations

from pathlib import Path

from depthcurse import assets
from depthcurse.errors import DepthcurseError, first_line


def check_repo(repo: str) -> str:
    """`repo` if the hub would take it as a repository name (`name` or `namespace/name`)."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id  # lazy: only a push needs huggingface_hub's checks

    try:
        validate_repo_id(repo)
    except HFValidationError as exc:
        raise DepthcurseError(f"--push-to-hub {repo!r} is not a hub repository name: use name or namespace/name, of letters, digits, '-', '_' "
                              "and '.', at most 96 characters") from exc
    return repo


def push_folder(folder: Path, repo: str, *, private: bool = False, message: str = "depthcurse") -> str:
    """Upload `folder` to the hub repository `repo` (made if it does not exist, `private` if asked);
    its address on the hub."""
    folder = Path(folder)
    check_repo(repo)
    if not assets.hub_reachable():
        raise DepthcurseError(f"cannot push to the hub repository {repo}: the hub is not reachable from here (no network, or HF_HUB_OFFLINE is set); "
                              f"the checkpoint is kept in {folder}")
    from huggingface_hub import HfApi  # lazy: only a push needs it
    from huggingface_hub.errors import HfHubHTTPError, LocalTokenNotFoundError

    api = HfApi()
    try:
        api.create_repo(repo, private=private, exist_ok=True)
        api.upload_folder(folder_path=str(folder), repo_id=repo, commit_message=message)
    except LocalTokenNotFoundError:
        raise DepthcurseError(f"cannot push to the hub repository {repo}: no token (set HF_TOKEN or run `hf auth login`); the checkpoint is kept in {folder}") from None
    except (HfHubHTTPError, OSError, ValueError) as exc:
        raise DepthcurseError(f"cannot push to the hub repository {repo}: {first_line(exc)}; the checkpoint is kept in {folder}") from exc
    return f"https://huggingface.co/{repo}"
