"""Small-set settings and a trainer factory shared by the train tests (and by the
torchrun script they launch)."""

from __future__ import annotations

from pathlib import Path

from packline.qwen.processor import load_processor
from packline.train.loop import Trainer
from packline.train.setup import build_trainer, run_paths

SMALL = (
    "data.num_train=120",
    "data.num_val=8",
    "train.global_batch_size=2",
    "train.eval_samples=0",
)


def trainer_for(cfg, packed: bool, run_dir: Path) -> Trainer:
    """The stage's trainer for ``cfg``: the seeded tiny model with LoRA, packing on or off."""
    processor = load_processor(run_paths(cfg)[1])
    return build_trainer(cfg, processor, packed=packed, run_dir=run_dir)
