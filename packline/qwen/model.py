"""Tiny Qwen3-VL models (dense and MoE) built deterministically from the real HF code.

The tiny configs keep every structural feature of the real models — GQA, gated MLP,
interleaved M-RoPE, DeepStack, the 2x2 patch merger, MoE experts as 3-D parameters — at a
size that trains on a laptop CPU. Token ids come from the processor (the tiny vocab has
4,096 ids, so the HF config defaults would be wrong).
"""

from __future__ import annotations

import torch
from transformers import (
    AutoModelForImageTextToText,
    PretrainedConfig,
    Qwen3VLConfig,
    Qwen3VLForConditionalGeneration,
    Qwen3VLMoeConfig,
    Qwen3VLMoeForConditionalGeneration,
)

from packline.qwen.processor import processor_geometry, special_token_ids
from packline.qwen.real_configs import TINY_MOE, TINY_TEXT, TINY_VISION


def tiny_config(processor, *, moe: bool = False, attn: str = "sdpa") -> Qwen3VLConfig:
    """The tiny Qwen3-VL (or Qwen3-VL-MoE) config matching ``processor``."""
    geometry = processor_geometry(processor)
    text = {**TINY_TEXT, "vocab_size": len(processor.tokenizer)}
    if moe:
        text.update(TINY_MOE)
    vision = {
        **TINY_VISION,
        "patch_size": geometry.patch_size,
        "temporal_patch_size": geometry.temporal_patch_size,
        "spatial_merge_size": geometry.merge_size,
    }
    cls = Qwen3VLMoeConfig if moe else Qwen3VLConfig
    cfg = cls(
        text_config=text,
        vision_config=vision,
        tie_word_embeddings=False,
        **{k: v for k, v in special_token_ids(processor).items() if k.endswith("token_id")},
    )
    cfg._attn_implementation = attn  # reaches both sub-configs before construction
    return cfg


def build_tiny_model(
    processor, *, moe: bool = False, attn: str = "sdpa", seed: int = 0
) -> Qwen3VLForConditionalGeneration:
    """A randomly initialised tiny model; the same seed gives the same weights."""
    cfg = tiny_config(processor, moe=moe, attn=attn)
    cls = Qwen3VLMoeForConditionalGeneration if moe else Qwen3VLForConditionalGeneration
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = cls(cfg)
    return model.float().eval()


def build_meta_model(config: PretrainedConfig) -> torch.nn.Module:
    """The model of ``config`` on the meta device: every module and parameter shape, no
    memory and no weights read (builds a 30B config in well under a second)."""
    with torch.device("meta"):
        return AutoModelForImageTextToText.from_config(config)
