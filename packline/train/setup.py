"""Model, LoRA adapters and loop settings from the pipeline config."""

from __future__ import annotations

from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model

from packline.energon.packing import PackingSettings
from packline.qwen.model import build_tiny_model
from packline.train.loop import LoopSettings


def build_model(cfg, processor):
    """The configured Qwen3-VL: the tiny one (seeded), or a local checkpoint dir."""
    if cfg.model.path:
        from transformers import AutoConfig, AutoModelForImageTextToText

        config = AutoConfig.from_pretrained(cfg.model.path, local_files_only=True)
        config.text_config.use_cache = False  # an enabled cache breaks packed isolation
        model = AutoModelForImageTextToText.from_pretrained(
            cfg.model.path, config=config, local_files_only=True, torch_dtype=torch.float32
        )
    else:
        model = build_tiny_model(processor, moe=cfg.model.moe, seed=cfg.train.seed)
    return model


def apply_lora(model, lora_cfg):
    """PEFT LoRA on the language model; MoE experts need ``target_parameters``."""
    config = LoraConfig(
        r=lora_cfg.rank,
        lora_alpha=lora_cfg.alpha,
        lora_dropout=lora_cfg.dropout,
        target_modules=list(lora_cfg.target_modules),
        target_parameters=list(lora_cfg.target_parameters) or None,
    )
    model = get_peft_model(model, config)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    if trainable == 0:
        raise ValueError(
            f"LoRA targets {list(lora_cfg.target_modules)} / {list(lora_cfg.target_parameters)} "
            "match nothing in the model"
        )
    return model


def loop_settings(cfg, *, packed: bool) -> LoopSettings:
    t = cfg.train
    return LoopSettings(
        packed=packed,
        max_steps=t.max_steps,
        global_batch_size=t.global_batch_size,
        unpacked_micro_batch_size=t.unpacked_micro_batch_size,
        lr=t.lr,
        warmup_steps=t.warmup_steps,
        weight_decay=t.weight_decay,
        grad_clip=t.grad_clip,
        seed=t.seed,
        save_every=t.save_every,
        keep_last=t.keep_last,
        num_workers=t.num_workers,
        packing_buffer_size=cfg.packing.packing_buffer_size,
        encoder_mode=cfg.packing.encoder.value,
        packing=PackingSettings.from_config(cfg.packing, seed=t.seed),
    )


def run_paths(cfg) -> tuple[Path, Path]:
    """(prepared dataset dir, connected processor dir)."""
    return cfg.work_path / "prepare", cfg.work_path / "connect" / "processor"
