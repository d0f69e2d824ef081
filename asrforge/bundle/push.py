"""A written bundle uploaded to the Hugging Face Hub (``asrforge export --push-to-hub``): verified
first, then sent whole with ``HfApi.upload_folder``; ``dry_run`` lists what would be sent."""

from __future__ import annotations

from pathlib import Path

from asrforge.bundle.load import verify_bundle
from asrforge.checkpoint.manifest import MANIFEST_NAME
from asrforge.errors import UploadError, UserError
from asrforge.hub import endpoint, repo_id_problem


def push_bundle(
    bundle: Path, repo_id: str, *, private: bool = False, dry_run: bool = False
) -> tuple[str, list[str]]:
    """Upload the bundle at ``bundle`` to the model repository ``repo_id`` (created when it does
    not exist; ``private`` then).

    Returns:
        The repository's URL and the files sent (or that would be, with ``dry_run``).

    Raises:
        UserError: ``repo_id`` is not ``org/name``, the bundle does not verify, or the Hub
            refuses the request (no token: naming ``HF_TOKEN``).
        UploadError: the Hub could not be reached or failed on its side; nothing was uploaded.
        CheckpointCorruptError: a file of the bundle changed since it was written.
    """
    if (problem := repo_id_problem(repo_id)) is not None:
        raise UserError(f"--push-to-hub {problem}")
    manifest = verify_bundle(bundle)
    files = sorted([*manifest["files"], MANIFEST_NAME])
    url = f"{endpoint()}/{repo_id}"
    if dry_run:
        return url, files
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError

    api = HfApi(endpoint=endpoint())
    again = (f"the bundle {bundle} is complete: upload it again with `asrforge export {bundle} "
             f"--push-to-hub {repo_id}`")  # fmt: skip
    try:
        api.create_repo(repo_id, private=private, exist_ok=True)
        api.upload_folder(
            folder_path=str(bundle),
            repo_id=repo_id,
            allow_patterns=files,
            commit_message=f"asrforge export: {bundle.name}",
        )
    except HfHubHTTPError as e:
        status = getattr(e.response, "status_code", None)
        if status is not None and status < 500:
            hint = " (set HF_TOKEN to a token with write access, or run `hf auth login`)"
            raise UserError(
                f"--push-to-hub {repo_id}: the Hub refused: {_first_line(e)}"
                + (hint if status in (401, 403) else "")
            ) from None
        raise UploadError(
            f"--push-to-hub {repo_id}: nothing was uploaded: the Hub failed ({_first_line(e)}); "
            + again
        ) from None
    except Exception as e:  # noqa: BLE001 - the HTTP client's and the token lookup's errors vary
        raise UploadError(
            f"--push-to-hub {repo_id}: nothing was uploaded: {type(e).__name__}: "
            f"{_first_line(e)}; {again}"
        ) from None
    return url, files


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
