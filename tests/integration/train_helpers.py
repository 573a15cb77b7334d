"""Small-set settings and a trainer factory shared by the train tests (and by the
torchrun script they launch)."""

from __future__ import annotations

from pathlib import Path

from packline.qwen.processor import load_processor
from packline.train.setup import build_trainer
from packline.train.trainer import Trainer
from packline.workdir import dataset_path, processor_dir

SMALL = (
    "data.num_train=120",
    "data.num_val=8",
    "train.global_batch_size=2",
    "train.eval_samples=0",
)


def trainer_for(cfg, packed: bool, run_dir: Path) -> Trainer:
    """The stage's trainer for ``cfg``: the seeded tiny model with LoRA, packing on or off."""
    processor = load_processor(processor_dir(cfg))
    return build_trainer(
        cfg,
        processor,
        packed=packed,
        dataset_path=dataset_path(cfg),
        processor_dir=processor_dir(cfg),
        run_dir=run_dir,
    )
