"""Fetching the Hugging Face Hub repos a config names, when it lets packline (connect calls
:func:`fetch_missing` first): ``model.path`` and ``processor.path`` repos the local cache
(``$HF_HOME``) lacks are downloaded into it with ``huggingface_hub``, which honours
``HF_HUB_OFFLINE`` and its own progress bars. Where a repo lives is read by
:mod:`schemas.hub`, never downloaded there."""

from __future__ import annotations

from schemas.config import PipelineConfig
from schemas.errors import UserError
from schemas.hub import cached, fetch_command, repo_id


def fetch_missing(cfg: PipelineConfig) -> list[str]:
    """Download each repo of ``model.path`` / ``processor.path`` the cache lacks, when
    ``model.download`` allows it; the repos fetched. A download that fails (offline, no such
    repo, no access) is a UserError naming the repo and the command."""
    if not cfg.model.download:
        return []
    from huggingface_hub import snapshot_download

    fetched = []
    for key, ref in (("model.path", cfg.model.path), ("processor.path", cfg.processor.path)):
        repo = repo_id(ref)
        if repo is None or repo in fetched or cached(repo) is not None:
            continue
        try:
            snapshot_download(repo)
        except Exception as exc:  # noqa: BLE001 - offline, missing, gated: all the user's to fix
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise UserError(
                [f"{key} {repo} could not be downloaded ({first}); fix: run "
                 f"`{fetch_command(repo)}` where the Hub can be reached, or check the repo id"],
                "connect: a model repo could not be fetched",
            ) from None  # fmt: skip
        fetched.append(repo)
    return fetched
