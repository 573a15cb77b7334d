"""Architecture values of the released Qwen3-VL checkpoints, offline (no download, no weights).

Only what shapes the compute is kept: layer counts and widths of the LLM and the ViT, GQA,
MoE routing, tying, and the patch geometry. :func:`real_config` turns them into the HF config
objects, which :mod:`packline.flops` reads.

Sources (values agree across all of them):

- [TT] torchtitan, ``torchtitan/experiments/qwen3_vl/__init__.py`` (``qwen3_vl_configs``,
  flavors "2B", "8B", "30B-A3B"; commit 0375bb6789fa55559e7bb58d81e8cca47cb418a1), which
  mirrors the HF checkpoints it loads.
- [XT] InternLM/xtuner, ``xtuner/v1/model/compose/qwen3_vl/qwen3_vl_config.py``
  (``Qwen3VLDense4BConfig``: ViT depth 24, width 1024, MLP 4096, DeepStack [5, 11, 17],
  out 2560) and ``xtuner/v1/model/dense/qwen3.py`` (``Qwen3Dense4BConfig``: 36 layers, 2560,
  9728, 32/8 heads, head_dim 128, vocab 151936, tied).
- [OL] GGUF metadata of the Ollama builds, converted from the HF checkpoints:
  https://ollama.com/library/qwen3-vl:8b-instruct-q8_0/blobs/4768dcaebbaf (8B),
  https://ollama.com/library/qwen3-vl:30b/blobs/b1da6f96a2e4 (30B-A3B: 48 layers, 2048,
  32/4 heads, 128 experts, top-8, ViT 27 x 1152, DeepStack [8, 16, 24]),
  https://ollama.com/dhiltgen/qwen3-vl:4b-instruct-q4_K_M/blobs/70ac570fd36b (4B ViT).
- [HF] a ``config.json`` copy of Qwen/Qwen3-VL-8B-Instruct
  (https://huggingface.co/Steinate/Cortex/blame/main/config.json: 8B text, ViT DeepStack
  [8, 16, 24], ``tie_word_embeddings: false``).
- [MB] Megatron-Bridge ``src/megatron/bridge/models/qwen_vl/qwen3_vl_provider.py``
  (``Qwen3VLMoEModelProvider``, reference Qwen/Qwen3-VL-30B-A3B-Instruct:
  ``mlp_only_layers=[]``, ``decoder_sparse_step=1``, patch 16, mrope [24, 20, 20],
  rope_theta 5e6).

Shared by every size: head_dim 128, vocab 151,936, rope_theta 5,000,000 with interleaved
M-RoPE sections [24, 20, 20], ViT 16 heads, patch 16, temporal patch 2, merge 2, a 48 x 48
learned position table (2,304), GELU-tanh; image/video/vision token ids 151655/151656/
151652/151653 (the HF config defaults).
"""

from __future__ import annotations

from transformers import Qwen3VLConfig, Qwen3VLMoeConfig

from schemas.facts import TINY_CONTEXT_LENGTH

_SHARED_TEXT = dict(
    head_dim=128,
    vocab_size=151936,
    max_position_embeddings=262144,
    rms_norm_eps=1e-6,
    attention_bias=False,
    rope_parameters={
        "rope_type": "default",
        "rope_theta": 5_000_000,
        "mrope_section": [24, 20, 20],  # sums to head_dim / 2
        "mrope_interleaved": True,
    },
    # Real checkpoints ship use_cache=True, which silently disables packed-sequence detection
    # in HF (see the reference notes); packline trains packed rows, so it is off here.
    use_cache=False,
)
_SHARED_VISION = dict(
    num_heads=16,
    patch_size=16,
    temporal_patch_size=2,
    spatial_merge_size=2,
    in_channels=3,
    num_position_embeddings=2304,
    hidden_act="gelu_pytorch_tanh",
)
_VIT_SMALL = dict(depth=24, hidden_size=1024, intermediate_size=4096)  # 2B, 4B  [TT, XT, OL]
_VIT_LARGE = dict(depth=27, hidden_size=1152, intermediate_size=4304)  # 8B, 30B-A3B [TT, OL]

QWEN3_VL_CONFIGS: dict[str, dict] = {
    # Qwen/Qwen3-VL-2B-Instruct: Qwen3-1.7B-sized LLM, tied embeddings.  [TT "2B"]
    "qwen3-vl-2b": dict(
        text=dict(
            hidden_size=2048,
            intermediate_size=6144,
            num_hidden_layers=28,
            num_attention_heads=16,
            num_key_value_heads=8,
        ),
        vision=dict(**_VIT_SMALL, out_hidden_size=2048, deepstack_visual_indexes=[5, 11, 17]),
        tie_word_embeddings=True,  # [TT] enable_weight_tying=True
    ),
    # Qwen/Qwen3-VL-4B-Instruct: Qwen3-4B-sized LLM, tied embeddings.  [XT, OL]
    "qwen3-vl-4b": dict(
        text=dict(
            hidden_size=2560,
            intermediate_size=9728,
            num_hidden_layers=36,
            num_attention_heads=32,
            num_key_value_heads=8,
        ),
        vision=dict(**_VIT_SMALL, out_hidden_size=2560, deepstack_visual_indexes=[5, 11, 17]),
        tie_word_embeddings=True,  # [XT] Qwen3Dense4BConfig
    ),
    # Qwen/Qwen3-VL-8B-Instruct: Qwen3-8B-sized LLM, untied.  [TT "8B", OL, HF]
    "qwen3-vl-8b": dict(
        text=dict(
            hidden_size=4096,
            intermediate_size=12288,
            num_hidden_layers=36,
            num_attention_heads=32,
            num_key_value_heads=8,
        ),
        vision=dict(**_VIT_LARGE, out_hidden_size=4096, deepstack_visual_indexes=[8, 16, 24]),
        tie_word_embeddings=False,
    ),
    # Qwen/Qwen3-VL-30B-A3B-Instruct: 48 MoE layers, 128 experts, top-8, no shared expert,
    # untied.  [TT "30B-A3B", OL, MB]
    "qwen3-vl-30b-a3b": dict(
        text=dict(
            hidden_size=2048,
            intermediate_size=6144,  # dense-MLP width; unused, every layer is sparse
            num_hidden_layers=48,
            num_attention_heads=32,
            num_key_value_heads=4,
            num_experts=128,
            num_experts_per_tok=8,
            moe_intermediate_size=768,
            decoder_sparse_step=1,
            mlp_only_layers=[],
        ),
        vision=dict(**_VIT_LARGE, out_hidden_size=2048, deepstack_visual_indexes=[8, 16, 24]),
        tie_word_embeddings=False,
        moe=True,
    ),
}
"""Per model: ``text`` and ``vision`` config values (merged over the shared ones),
``tie_word_embeddings``, and ``moe`` for the Qwen3-VL-MoE architecture."""


def real_config(name: str) -> Qwen3VLConfig | Qwen3VLMoeConfig:
    """The HF config of a released Qwen3-VL model (``"qwen3-vl-2b"``, ``"qwen3-vl-4b"``,
    ``"qwen3-vl-8b"``, ``"qwen3-vl-30b-a3b"``), built offline; no weights."""
    if name not in QWEN3_VL_CONFIGS:
        raise ValueError(f"unknown Qwen3-VL model {name!r}; known: {sorted(QWEN3_VL_CONFIGS)}")
    spec = QWEN3_VL_CONFIGS[name]
    cls = Qwen3VLMoeConfig if spec.get("moe") else Qwen3VLConfig
    return cls(
        text_config={**_SHARED_TEXT, **spec["text"]},
        vision_config={**_SHARED_VISION, **spec["vision"]},
        tie_word_embeddings=spec["tie_word_embeddings"],
    )


# -- the tiny model: the embedded default's sizes (its vocabulary and patch geometry come
# from the processor, packline.qwen.model.tiny_config), and packline bench gpu --smoke's --

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
