"""Wiring of ``scripts/build-tiny-base``: the pretraining rows, prepare's shards of them, and
the pretraining itself (``packline/shapes/pretrain.py``)."""

from __future__ import annotations

from pathlib import Path

from packline.shapes.generate import write_pretraining_set
from packline.shapes.pretrain import PretrainSettings, pretrain
from schemas.config import load_config
from stages.prepare import prepare


def build_tiny_base(
    out_dir: Path, s: PretrainSettings, *, work_dir: Path, steps: int | None = None
) -> dict:
    """Write ``s.num_rows`` pretraining rows under ``work_dir``, shard them with the prepare
    stage, pretrain; returns the manifest (see :func:`packline.shapes.pretrain.pretrain`)."""
    work_dir = Path(work_dir)
    source = write_pretraining_set(
        work_dir / "source", num_train=s.num_rows, num_val=16, seed=s.seed
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
    dataset = prepare(cfg).out_dir
    return pretrain(out_dir, s, dataset=dataset, work_dir=work_dir, steps=steps)
