"""Small-set settings and a trainer factory shared by the train tests (and by the
torchrun script they launch)."""

from __future__ import annotations

from pathlib import Path

import torch

from packline.counters import flops_model_for
from packline.qwen.processor import load_processor
from packline.train.loop import Trainer
from packline.train.setup import apply_lora, build_model, loop_settings, run_paths

SMALL = (
    "data.num_train=120",
    "data.num_val=8",
    "train.global_batch_size=2",
    "train.eval_samples=0",
)


def trainer_for(cfg, packed: bool, run_dir: Path) -> Trainer:
    """The stage's trainer for ``cfg``: the seeded tiny model with LoRA, packing on or off."""
    dataset_dir, processor_dir = run_paths(cfg)
    processor = load_processor(processor_dir)
    torch.manual_seed(cfg.train.seed)
    model = apply_lora(build_model(cfg, processor), cfg.lora)
    return Trainer(
        model,
        settings=loop_settings(cfg, packed=packed),
        dataset_dir=dataset_dir,
        processor_dir=processor_dir,
        run_dir=run_dir,
        flops_model=flops_model_for(cfg, processor),
        image_token_id=int(processor.image_token_id),
        pad_token_id=int(processor.tokenizer.pad_token_id),
    )
