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
from schemas.facts import TINY_CONTEXT_LENGTH

TINY_TEXT = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=TINY_CONTEXT_LENGTH,
    use_cache=False,  # an enabled cache disables packed-sequence detection (see forward.py)
    rope_parameters={
        "rope_type": "default",
        "rope_theta": 5e6,
        "mrope_section": [6, 5, 5],  # sums to head_dim / 2
        "mrope_interleaved": True,
    },
)
TINY_MOE = dict(
    num_experts=8,
    num_experts_per_tok=2,
    # Neither 2 * 48 nor 48 equals hidden_size 128, so each expert weight's shape differs
    # from its transpose: a checkpoint in the other expert layout fails to load, or is
    # transposed right by HF's shape check, instead of loading transposed in silence
    # (transformers #47031; 64 made gate_up_proj square).
    moe_intermediate_size=48,
    decoder_sparse_step=1,
    mlp_only_layers=[],
)
TINY_VISION = dict(
    depth=2,
    hidden_size=64,
    intermediate_size=128,
    num_heads=4,
    out_hidden_size=128,  # = text hidden size
    num_position_embeddings=256,
    deepstack_visual_indexes=[0, 1],
)


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
