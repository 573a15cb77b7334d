"""What every stage shares: its output dir, atomic publish, and the completion record.

A stage builds its outputs in ``<work>/.tmp-<stage>-*``, renames that dir to
``<work>/<stage>`` (replacing an older one only when packline made it:
:func:`packline.workdir.publish`), then writes ``<work>/<stage>/_COMPLETE.json`` holding the
fingerprint of its inputs and config. A rerun whose fingerprint matches the record is
skipped; a dir without a record is stale and is rebuilt.

This bookkeeping needs the work dir only: its functions take ``work`` (``cfg.work_path``),
not the config; :func:`require_current` alone reads the settings, for their fingerprint.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import packline
from packline.catalog import (  # noqa: F401 - the artefacts, re-exported for the stages
    PROCESSOR,
    dataset_dir,
    dataset_path,
    processor_dir,
    read_record,
    record_path,
    stage_dir,
    stage_path,
)
from packline.faults import discard_partial
from packline.workdir import is_owned, new_temp_dir, not_ours, publish
from schemas.config import STAGES, PipelineConfig
from schemas.errors import UserError


@dataclass
class StageResult:
    """What a stage reports back: where its outputs are and the figures it logged."""

    stage: str
    out_dir: Path
    fingerprint: str
    skipped: bool
    metrics: dict[str, float] = field(default_factory=dict)
    summary: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0
    partial: bool = False
    """One task's share of a stage spread over several tasks (connect): its part is on disk
    for the task that merges; no record, nothing to log."""


def require_record(work: Path, stage: str, by: str) -> dict[str, Any]:
    """``stage``'s completion record in the work dir ``work``; a UserError naming the stage
    to run when it has not completed."""
    rec = read_record(work, stage)
    if rec is None:
        raise UserError(
            [f"{stage} has not completed in {work} (run `packline stage {stage}` first)"],
            f"{by} cannot start",
        )
    return rec


def require_current(cfg: PipelineConfig, stage: str, by: str) -> dict[str, Any]:
    """``stage``'s record, which must be of these settings (its fingerprint current): a
    stage that checks what another reads (validate, for train) must have checked these."""
    from packline.fingerprints import stage_fingerprint

    rec = require_record(cfg.work_path, stage, by)
    if rec.get("fingerprint") != stage_fingerprint(cfg, stage):
        raise UserError(
            [
                f"{stage}'s record in {cfg.work_path} is for other settings "
                f"(run `packline stage {stage}` with these settings first)"
            ],
            f"{by} cannot start",
        )
    return rec


def is_up_to_date(work: Path, stage: str, fp: str) -> bool:
    """Whether ``stage`` completed in ``work`` under the fingerprint ``fp``."""
    rec = read_record(work, stage)
    return rec is not None and rec.get("fingerprint") == fp


@contextmanager
def building(work: Path, stage: str) -> Iterator[Path]:
    """Yield a fresh temp dir in ``work``; on success rename it to ``<work>/<stage>``
    atomically (an older one is replaced only when packline made it: checked first, so a
    stage refused there does no work)."""
    final = stage_path(work, stage)
    if (final.exists() or final.is_symlink()) and not is_owned(final):
        raise not_ours(final)
    tmp = new_temp_dir(Path(work), f".tmp-{stage}-")
    try:
        yield tmp
    except BaseException as exc:
        discard_partial(tmp, exc)  # nothing half-published (its size noted if the disk filled)
        raise
    publish(tmp, final)


def stage_result(
    work: Path,
    stage: str,
    fp: str,
    *,
    metrics: dict[str, Any] | None = None,
    summary: dict[str, Any] | None = None,
    t0: float | None = None,
    seconds: float | None = None,
    partial: bool = False,
) -> StageResult:
    """The result of ``stage`` run now in the work dir ``work`` under fingerprint ``fp``: its
    metrics as floats, its seconds since ``t0`` (a ``time.perf_counter()``) or as given."""
    if seconds is None:
        seconds = time.perf_counter() - t0 if t0 is not None else 0.0
    return StageResult(
        stage=stage,
        out_dir=stage_path(work, stage),
        fingerprint=fp,
        skipped=False,
        metrics={k: float(v) for k, v in (metrics or {}).items()},
        summary=dict(summary or {}),
        seconds=seconds,
        partial=partial,
    )


def write_record(result: StageResult) -> None:
    """Write the completion record into ``result.out_dir`` last: its presence means the
    stage's outputs are whole."""
    record = {
        "stage": result.stage,
        "fingerprint": result.fingerprint,
        "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "seconds": round(result.seconds, 3),
        "metrics": result.metrics,
        "summary": result.summary,
        "packline_version": packline.__version__,
    }
    path = record_path(result.out_dir.parent, result.stage)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=2, sort_keys=True))
    os.replace(tmp, path)


def result_from_record(work: Path, stage: str) -> StageResult:
    """The result of ``stage`` as its record in ``work`` holds it (a skipped stage)."""
    rec = read_record(work, stage)
    assert rec is not None
    return StageResult(
        stage=stage,
        out_dir=stage_path(work, stage),
        fingerprint=rec["fingerprint"],
        skipped=True,
        metrics=rec.get("metrics", {}),
        summary=rec.get("summary", {}),
        seconds=0.0,
    )


def invalidate_from(work: Path, stage: str) -> None:
    """Remove the completion records of ``stage`` and every stage after it in ``work``."""
    for name in STAGES[STAGES.index(stage) :]:
        record_path(work, name).unlink(missing_ok=True)
