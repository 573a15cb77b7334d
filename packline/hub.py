"""Fetching the Hugging Face Hub repos a config names, when it lets packline (prepare and
connect call :func:`fetch_missing` first): a ``data.source`` dataset, the ``model.path`` and
``processor.path`` repos the local cache (``$HF_HOME``) lacks are downloaded into it with
``huggingface_hub``, which honours
``HF_HUB_OFFLINE`` and its own progress bars. Where a repo lives is read by
:mod:`schemas.hub`, never downloaded there."""

from __future__ import annotations

from schemas.config import PipelineConfig
from schemas.errors import UserError
from schemas.hub import cached, fetch_command, repo_id


def fetch_missing(cfg: PipelineConfig, stage: str = "connect") -> list[str]:
    """Download each repo ``stage`` reads that the cache lacks, when the config allows it:
    for prepare the Hub dataset of ``data.source`` (``data.download``), for connect the
    repos of ``model.path`` / ``processor.path`` (``model.download``); the repos fetched. A
    download that fails (offline, no such repo, no access) is a UserError naming the repo
    and the command."""
    if stage == "prepare":
        wanted = [("data.source", cfg.data.source, "dataset")] if cfg.data.download else []
    else:
        refs = (("model.path", cfg.model.path), ("processor.path", cfg.processor.path))
        wanted = [(key, ref, "model") for key, ref in refs] if cfg.model.download else []
    fetched = []
    for key, ref, repo_type in wanted:
        repo = repo_id(ref)
        if repo is None or repo in fetched or cached(repo, repo_type) is not None:
            continue
        from huggingface_hub import snapshot_download

        try:
            snapshot_download(repo, repo_type=repo_type)
        except Exception as exc:  # noqa: BLE001 - offline, missing, gated: all the user's to fix
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise UserError(
                [f"{key} {repo} could not be downloaded ({first}); fix: run "
                 f"`{fetch_command(repo, repo_type)}` where the Hub can be reached, or check "
                 "the repo id"],
                f"{stage}: a {repo_type} repo could not be fetched",
            ) from None  # fmt: skip
        fetched.append(repo)
    return fetched
