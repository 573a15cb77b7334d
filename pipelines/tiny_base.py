"""Wiring of ``scripts/build-tiny-base``: the pretraining rows of each phase, prepare's
shards of them, and the pretraining itself (``packline/shapes/pretrain.py``)."""

from __future__ import annotations

from pathlib import Path

from packline.shapes.generate import FIRST_MIX, SEEING_MIX, PretrainMix, write_pretraining_set
from packline.shapes.pretrain import PretrainSettings, check_first_phase, pretrain
from schemas.config import load_config
from stages.prepare import prepare


def _dataset(work_dir: Path, *, rows: int, seed: int, mix: PretrainMix) -> Path:
    """``rows`` pretraining rows of ``mix`` under ``work_dir``, sharded by the prepare stage."""
    source = write_pretraining_set(
        work_dir / "source", num_train=rows, num_val=16, seed=seed, mix=mix
    )
    cfg = load_config(
        None,
        [
            f"work_dir={work_dir / 'work'}",
            f"data.source={source}",
            "prepare.num_workers=1",
            "mlflow.enabled=false",
        ],
    )
    return prepare(cfg).out_dir


def build_tiny_base(
    out_dir: Path,
    s: PretrainSettings,
    *,
    work_dir: Path,
    steps: int | None = None,
    first_phase: Path | None = None,
    checkpoint_every: int = 0,
) -> dict:
    """Write each phase's pretraining rows under ``work_dir`` (``s.num_rows`` of the first
    mix, ``s.seeing_rows`` of the seeing mix with seed ``s.seed + 1``), shard them with the
    prepare stage, pretrain; returns the manifest (see
    :func:`packline.shapes.pretrain.pretrain`, which says what ``first_phase`` and
    ``checkpoint_every`` do)."""
    work_dir = Path(work_dir)
    steps = s.total_steps if steps is None else steps
    first = None
    if first_phase is not None:
        check_first_phase(first_phase, s)  # before any rows are written
    else:
        first = _dataset(work_dir / "first", rows=s.num_rows, seed=s.seed, mix=FIRST_MIX)
    seeing = None
    if steps > s.steps:
        seeing = _dataset(work_dir / "seeing", rows=s.seeing_rows, seed=s.seed + 1, mix=SEEING_MIX)
    return pretrain(
        out_dir,
        s,
        datasets=(first, seeing),
        work_dir=work_dir,
        steps=steps,
        first_phase=first_phase,
        checkpoint_every=checkpoint_every,
    )
