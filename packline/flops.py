"""Exact training FLOPs of one packed Qwen3-VL row, and MFU.

The count is the **useful** work of a step, read off an HF ``Qwen3VLConfig`` or
``Qwen3VLMoeConfig`` (no weights, no torch):

- linear layers run over the real tokens of the row (``Σ seq_lens``), never over alignment
  gaps or tail padding;
- attention is per conversation, ``Σ len²`` — what varlen / THD attention executes — never
  the ``T²`` of the physical row;
- a causal score matrix is counted whole (``QKᵀ`` and ``AV`` over the full square), which is
  what ``torch.utils.flop_counter.FlopCounterMode`` counts for eager and SDPA attention;
- embedding lookups, norms, activations, RoPE, softmax and the loss are 0 FLOPs (elementwise
  or gathers; ``FlopCounterMode`` does not count them either);
- the ViT runs per grid ``(t, h, w)`` in patches. An image is ``t = 1`` (the processor
  repeats it into the Conv3d's 2-frame depth). A video is ``t`` temporal groups of
  ``temporal_patch_size = 2`` sampled frames, an odd count padded by repeating the last
  frame, so that frame costs a whole group. The patch embedding, the blocks' linears and the
  mergers (final and DeepStack) run on every patch; attention runs within each group
  (``cu_seqlens`` of ``h·w``, ``t`` times: no attention across frames). A video grid
  therefore costs exactly ``t`` image grids ``(1, h, w)``. HF encodes a row's images and its
  videos in two passes of the same ViT; FLOPs add, so the ``vision_*`` parts cover both and
  :attr:`FlopsBreakdown.video_vision` says how much of them the videos cost;
- a multiply-accumulate is 2 FLOPs, and a bias add is free (``addmm`` counts as ``mm``).

Backward follows what autograd executes. For ``y = x·W`` it computes ``dx = dy·Wᵀ`` only when
``x`` requires grad and ``dW = xᵀ·dy`` only when ``W`` does, each as many FLOPs as the
forward. Hence:

- ``mode="full"`` (every weight trainable): 2× forward for every matmul, except the ViT patch
  embedding, which needs no ``dx`` (``pixel_values`` never requires grad): 1×.
- ``mode="lora"`` (frozen base): a frozen matmul costs 1× forward (``dx`` only) once something
  upstream is trainable, and nothing at all before that. With LoRA on the attention
  projections, layer 0's ``q/k/v`` base matmuls see the frozen embedding and run no backward;
  their LoRA ``A`` matrices compute ``dA`` but no ``dx``. The frozen ViT builds no graph:
  forward only.
- MoE experts adapted through PEFT ``target_parameters`` are not cheap: PEFT folds
  ``W + s·B·A`` into one ``baddbmm`` per forward (every expert, independent of the tokens)
  and the experts then multiply by that *trainable* weight, so autograd computes the full
  ``dW`` of every routed matmul — 2× forward, as in full fine-tuning — plus the ``baddbmm``
  backward.

Attention backward is 2× forward (``dQ, dK`` from ``dS``; ``dP, dV`` from ``dO``). The
flash/efficient SDPA kernels also recompute ``QKᵀ`` in backward (``FlopCounterMode`` counts
2.5× for them); that recompute is not useful work and is not counted here.

:func:`nominal_flops` is the ``6·N·tokens`` figure commonly reported, for contrast.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, fields
from typing import Literal

from schemas.choices import ATTENTION_PROJECTIONS, EXPERT_PARAMETERS, MLP_PROJECTIONS

Mode = Literal["full", "lora"]

LORA_TARGETS_ALL: tuple[str, ...] = (
    *ATTENTION_PROJECTIONS,
    *MLP_PROJECTIONS,
    *(name.removeprefix("mlp.") for name in EXPERT_PARAMETERS),
)
"""Every LM weight LoRA can adapt: the Linear layers (PEFT ``target_modules``) and, for MoE,
the 3-D expert parameters (PEFT ``target_parameters``, ``mlp.experts.*``). The ViT is never
adapted."""

LM_HEAD_TARGET = "lm_head"
"""The LM head may be adapted too (PEFT ``target_modules``); not part of the default
:data:`LORA_TARGETS_ALL`."""

_LINEAR_TARGETS = frozenset((*ATTENTION_PROJECTIONS, *MLP_PROJECTIONS, LM_HEAD_TARGET))
_EXPERT_TARGETS = frozenset(LORA_TARGETS_ALL) - _LINEAR_TARGETS

# Datasheet peak dense (no 2:4 sparsity) BF16 tensor-core throughput, SXM parts.
# H100 SXM: 989.4 TFLOPS — NVIDIA's datasheet lists 1,979 "with sparsity", "one-half lower
#   without" (https://www.nvidia.com/en-us/data-center/h100/); exact figure from
#   https://glennklockwood.com/garden/processors/h100 (BF16 matrix 989.4, sparse 1978.9).
# H200 SXM: the same GH100 compute as H100 with more HBM3e, 989.4 TFLOPS
#   (https://www.nvidia.com/en-us/data-center/h200/; https://glennklockwood.com/garden/processors/h100).
# B200 (HGX, 1,000 W): 2,250 TFLOPS dense BF16, 4,500 sparse
#   (https://glennklockwood.com/garden/processors/B200; NVIDIA Blackwell datasheet
#   https://nvdam.widen.net/s/wwnsxrhm2w/blackwell-datasheet-3384703, as cited by torchtitan's
#   torchtitan/tools/utils.py::get_peak_flops, which uses 989e12 / 989e12 / 2.25e15).
PEAK_BF16_DENSE_TFLOPS: dict[str, float] = {
    "H100": 989.4,
    "H200": 989.4,
    "B200": 2250.0,
}


@dataclass(frozen=True, kw_only=True)
class PackShape:
    """What one packed row holds, as far as FLOPs are concerned."""

    seq_lens: tuple[int, ...]
    """Real tokens of each conversation in the row, image and video tokens included."""
    image_grids: tuple[tuple[int, int, int], ...] = ()
    """``image_grid_thw`` rows ``(t, h, w)`` in patches, for every image of the row."""
    video_grids: tuple[tuple[int, int, int], ...] = ()
    """``video_grid_thw`` rows ``(t, h, w)`` for every video of the row: ``t`` temporal
    groups of 2 sampled frames (an odd count padded, ``t = ceil(frames / 2)``), ``h, w`` in
    patches."""
    padded_len: int
    """Physical row length T: real tokens plus alignment gaps and tail padding."""
    loss_tokens: int
    """Tokens with a label (not used by the FLOPs, kept for throughput figures)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "seq_lens", tuple(int(n) for n in self.seq_lens))
        for name in ("image_grids", "video_grids"):
            grids = tuple(tuple(int(v) for v in g) for g in getattr(self, name))
            object.__setattr__(self, name, grids)
        if not self.seq_lens or any(n <= 0 for n in self.seq_lens):
            raise ValueError(f"seq_lens must be one or more positive lengths, got {self.seq_lens}")
        if self.padded_len < self.num_tokens:
            raise ValueError(
                f"padded_len ({self.padded_len}) is shorter than the real tokens "
                f"({self.num_tokens}); it must include them"
            )
        if not 0 <= self.loss_tokens <= self.num_tokens:
            raise ValueError(
                f"loss_tokens ({self.loss_tokens}) must lie in [0, {self.num_tokens}] "
                "(the real tokens of the row)"
            )
        for what, grids in (("an image", self.image_grids), ("a video", self.video_grids)):
            for grid in grids:
                if len(grid) != 3 or any(v <= 0 for v in grid):
                    raise ValueError(f"{what} grid is three positive ints (t, h, w), got {grid}")

    @property
    def num_tokens(self) -> int:
        """Real tokens of the row (``Σ seq_lens``)."""
        return sum(self.seq_lens)

    @property
    def num_padding(self) -> int:
        """Alignment gaps plus tail padding."""
        return self.padded_len - self.num_tokens


@dataclass(frozen=True)
class Flops:
    """Forward and backward FLOPs of one part of the model."""

    forward: int = 0
    backward: int = 0

    @property
    def total(self) -> int:
        return self.forward + self.backward

    def __add__(self, other: Flops) -> Flops:
        return Flops(self.forward + other.forward, self.backward + other.backward)


@dataclass(frozen=True, kw_only=True)
class FlopsBreakdown:
    """FLOPs of one training step on one row, by part of the model."""

    lm_dense: Flops
    """LM linear layers: q/k/v/o, the gated MLP or router + routed experts + shared expert."""
    lm_attention: Flops
    """LM ``QKᵀ`` and ``AV``, per conversation."""
    lm_head: Flops
    """The output projection over the real tokens."""
    vision_patch_embed: Flops
    """ViT patch embedding (a Conv3d that is a Linear over ``3·t_patch·patch²`` inputs)."""
    vision_blocks: Flops
    """ViT block linears: qkv, proj, fc1, fc2."""
    vision_attention: Flops
    """ViT attention, within each image and within each temporal group of a video."""
    vision_merger: Flops
    """The 2x2 patch merger feeding the LLM."""
    vision_deepstack: Flops
    """The DeepStack mergers (one per ``deepstack_visual_indexes`` entry)."""
    lora_adapters: Flops
    """LoRA A/B matmuls, and the per-step ``W + B·A`` fold of adapted MoE experts."""
    video_vision: Flops = Flops()
    """Of the ``vision_*`` parts above, what the video grids cost (already counted in them,
    not a part of its own: :attr:`forward` and :attr:`total` do not add it again)."""

    @property
    def lm(self) -> Flops:
        return self.lm_dense + self.lm_attention + self.lm_head

    @property
    def vision(self) -> Flops:
        return (
            self.vision_patch_embed
            + self.vision_blocks
            + self.vision_attention
            + self.vision_merger
            + self.vision_deepstack
        )

    @property
    def forward(self) -> int:
        return self.lm.forward + self.vision.forward + self.lora_adapters.forward

    @property
    def backward(self) -> int:
        return self.lm.backward + self.vision.backward + self.lora_adapters.backward

    @property
    def total(self) -> int:
        return self.forward + self.backward

    def as_dict(self) -> dict[str, int]:
        """Flat ``{"<part>/forward": ..., "<part>/backward": ..., "total": ...}`` for logging;
        ``video_vision/*`` is the videos' share of the ``vision_*`` parts (not to be summed
        with them)."""
        out: dict[str, int] = {}
        for name in (*_PARTS, "video_vision"):
            part: Flops = getattr(self, name)
            out[f"{name}/forward"] = part.forward
            out[f"{name}/backward"] = part.backward
        out["forward"] = self.forward
        out["backward"] = self.backward
        out["total"] = self.total
        return out


_PARTS = tuple(f.name for f in fields(FlopsBreakdown) if f.name != "video_vision")
"""The parts of a step that add up to its total."""


def _matmul(fwd: int, *, weight_grad: bool, input_grad: bool) -> Flops:
    """A matmul ``x·W`` of ``fwd`` FLOPs: backward runs ``dW`` and/or ``dx``, each costing
    as much as the forward."""
    return Flops(fwd, fwd * (int(weight_grad) + int(input_grad)))


class _Tally:
    """Accumulates forward/backward FLOPs per part while walking the model."""

    def __init__(self, include_backward: bool) -> None:
        self.include_backward = include_backward
        self.parts: dict[str, Flops] = {name: Flops() for name in _PARTS}

    def add(self, part: str, flops: Flops) -> None:
        if not self.include_backward:
            flops = Flops(flops.forward, 0)
        self.parts[part] = self.parts[part] + flops

    def total(self) -> Flops:
        return sum(self.parts.values(), Flops())


def _normalise_targets(targets: Iterable[str]) -> frozenset[str]:
    out = set()
    for name in targets:
        short = name.removeprefix("mlp.")
        if short not in _LINEAR_TARGETS and short not in _EXPERT_TARGETS:
            raise ValueError(
                f"unknown LoRA target {name!r}; expected names from {LORA_TARGETS_ALL} "
                f"or {LM_HEAD_TARGET!r} (expert parameters may be written with their 'mlp.' "
                "prefix)"
            )
        out.add(short)
    return frozenset(out)


def _text_and_vision(config) -> tuple[object, object]:
    text = getattr(config, "text_config", None)
    vision = getattr(config, "vision_config", None)
    if text is None or vision is None:
        raise ValueError(
            f"expected a Qwen3VLConfig or Qwen3VLMoeConfig (with text_config and "
            f"vision_config), got {type(config).__name__}"
        )
    return text, vision


def _head_dim(text) -> int:
    return getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads


def _is_moe_layer(text, layer: int) -> bool:
    # The rule of Qwen3VLMoeTextDecoderLayer: sparse unless listed in mlp_only_layers or off
    # the decoder_sparse_step grid.
    num_experts = getattr(text, "num_experts", 0) or 0
    if num_experts <= 0:
        return False
    mlp_only = getattr(text, "mlp_only_layers", None) or []
    step = getattr(text, "decoder_sparse_step", 1) or 1
    return layer not in mlp_only and (layer + 1) % step == 0


def step_flops(
    config,
    pack: PackShape,
    *,
    mode: Mode,
    lora_rank: int = 0,
    lora_targets: Iterable[str] = LORA_TARGETS_ALL,
    include_backward: bool = True,
    freeze_vision: bool = False,
) -> FlopsBreakdown:
    """Exact FLOPs of one training step (forward, and backward unless
    ``include_backward=False``) on the row ``pack``.

    ``mode="full"`` trains every weight (``freeze_vision=True`` keeps the ViT and mergers
    frozen); ``mode="lora"`` freezes the base model and adds rank-``lora_rank`` adapters on
    ``lora_targets`` (names from :data:`LORA_TARGETS_ALL`; the ViT is always frozen).

    The row is one forward call: the per-call fold of LoRA-adapted MoE experts
    (``W + s·B·A``, independent of the tokens) is counted once. PEFT also evaluates that fold
    a second time per call, only to validate the parametrization it registers; that wasted
    work is not counted.
    """
    if mode not in ("full", "lora"):
        raise ValueError(f"mode must be 'full' or 'lora', got {mode!r}")
    if mode == "lora" and lora_rank <= 0:
        raise ValueError(f"mode='lora' needs lora_rank > 0, got {lora_rank}")
    if mode == "full" and lora_rank != 0:
        raise ValueError("lora_rank applies to mode='lora' only; leave it 0 for mode='full'")
    targets = _normalise_targets(lora_targets) if mode == "lora" else frozenset()
    text, vision = _text_and_vision(config)

    merge = vision.spatial_merge_size
    for what, grids in (("image", pack.image_grids), ("video", pack.video_grids)):
        for t, h, w in grids:
            if h % merge or w % merge:
                raise ValueError(
                    f"{what} grid {(t, h, w)} is not a multiple of spatial_merge_size={merge}"
                )
    visual_tokens = sum(t * h * w for t, h, w in pack.image_grids + pack.video_grids) // merge**2
    if visual_tokens > pack.num_tokens:
        raise ValueError(
            f"the images and videos need {visual_tokens} LLM tokens but the row has only "
            f"{pack.num_tokens} real tokens"
        )

    tally = _Tally(include_backward)
    train_vision = mode == "full" and not freeze_vision
    # Two passes of the same ViT, as HF runs them (get_image_features, get_video_features).
    _vision_flops(vision, pack.image_grids, trainable=train_vision, tally=tally)
    videos = _Tally(include_backward)
    _vision_flops(vision, pack.video_grids, trainable=train_vision, tally=videos)
    for part, flops in videos.parts.items():
        tally.add(part, flops)
    _lm_flops(
        text,
        pack.seq_lens,
        train_base=mode == "full",
        targets=targets,
        rank=lora_rank,
        tally=tally,
    )
    return FlopsBreakdown(**tally.parts, video_vision=videos.total())


def _vision_flops(vision, grids, *, trainable: bool, tally: _Tally) -> None:
    d = vision.hidden_size
    inter = vision.intermediate_size
    out = vision.out_hidden_size
    merged_width = d * vision.spatial_merge_size**2  # the merger sees m² patches side by side
    # Conv3d with kernel = stride = (t_patch, patch, patch): one Linear per patch over
    # in_channels·t_patch·patch² inputs (3·2·16·16 = 1536 on Qwen3-VL).
    patch_inputs = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
    num_deepstack = len(vision.deepstack_visual_indexes or ())
    # Frozen ViT: no graph at all. Trainable: patch embed gets dW only (pixel_values need no
    # grad); every later matmul has a trainable weight and an input that requires grad.
    later = dict(weight_grad=trainable, input_grad=trainable)
    for t, h, w in grids:
        # t = 1 for an image; a video's t temporal groups of 2 frames (the last one padded
        # for an odd frame count) each run as one image would.
        patches = t * h * w
        per_slice = h * w  # attention runs within one temporal group
        merged = patches // vision.spatial_merge_size**2
        # 2 FLOPs per multiply-accumulate throughout.
        tally.add(
            "vision_patch_embed",
            _matmul(2 * patches * patch_inputs * d, weight_grad=trainable, input_grad=False),
        )
        # Per block: qkv d→3d, proj d→d, fc1 d→I, fc2 I→d: 2·N·(3d² + d² + dI + Id).
        block = 2 * patches * (4 * d * d + 2 * d * inter)
        tally.add("vision_blocks", _matmul(vision.depth * block, **later))
        # Per block: QKᵀ and AV over S×S scores for all heads (heads·head_dim = d): 2·2·S²·d
        # for each of the t groups.
        attention = 4 * t * per_slice**2 * d
        tally.add("vision_attention", _matmul(vision.depth * attention, **later))
        # Merger: fc1 (m²d→m²d) then fc2 (m²d→out) on N/m² merged tokens; the LayerNorm and
        # GELU are elementwise.
        merger = 2 * merged * (merged_width * merged_width + merged_width * out)
        tally.add("vision_merger", _matmul(merger, **later))
        tally.add("vision_deepstack", _matmul(num_deepstack * merger, **later))


def _lm_flops(text, seq_lens, *, train_base: bool, targets, rank: int, tally: _Tally) -> None:
    hidden = text.hidden_size
    head_dim = _head_dim(text)
    q_width = text.num_attention_heads * head_dim
    kv_width = text.num_key_value_heads * head_dim  # GQA: k/v are narrower than q
    tokens = sum(seq_lens)
    # Σ len²: each conversation attends only to itself (varlen / THD attention).
    sum_sq = sum(n * n for n in seq_lens)

    def linear(
        name: str, n: int, d_in: int, d_out: int, input_rg: bool, part: str = "lm_dense"
    ) -> bool:
        """A base Linear (plus its LoRA adapter if targeted); returns whether its output
        requires grad."""
        tally.add(
            part,
            _matmul(2 * n * d_in * d_out, weight_grad=train_base, input_grad=input_rg),
        )
        if name not in targets:
            return input_rg or train_base
        # LoRA: h = x·Aᵀ (d_in→r), then h·Bᵀ (r→d_out). A needs dA, and dx only if x requires
        # grad; B needs dB and dh (A is trainable).
        a = _matmul(2 * n * d_in * rank, weight_grad=True, input_grad=input_rg)
        b = _matmul(2 * n * rank * d_out, weight_grad=True, input_grad=True)
        tally.add("lora_adapters", a + b)
        return True

    # In full mode the embedding is trainable, so the residual stream requires grad from the
    # start; under LoRA nothing does until the first adapter.
    stream_rg = train_base
    for layer in range(text.num_hidden_layers):
        q_rg = linear("q_proj", tokens, hidden, q_width, stream_rg)
        k_rg = linear("k_proj", tokens, hidden, kv_width, stream_rg)
        v_rg = linear("v_proj", tokens, hidden, kv_width, stream_rg)
        # QKᵀ and AV: 2·len²·heads·head_dim each (k/v heads are repeated to all q heads).
        # Backward of S = QKᵀ: dQ if q requires grad, dK if k does; of O = PV: dP if the
        # scores do, dV if v does — each as many FLOPs as the forward matmul.
        attention = 2 * sum_sq * q_width
        scores_rg = q_rg or k_rg
        tally.add("lm_attention", Flops(attention, attention * (q_rg + k_rg)))
        tally.add("lm_attention", Flops(attention, attention * (scores_rg + v_rg)))
        o_rg = linear("o_proj", tokens, q_width, hidden, scores_rg or v_rg)
        stream_rg = stream_rg or o_rg
        if _is_moe_layer(text, layer):
            mlp_rg = _moe_flops(text, tokens, stream_rg, train_base, targets, rank, tally, linear)
        else:
            mlp_rg = _gated_mlp(linear, tokens, hidden, text.intermediate_size, stream_rg)
        stream_rg = stream_rg or mlp_rg
    # The LM head (frozen under LoRA unless adapted itself, but the stream needs dx) over
    # every real token: HF computes logits for all positions, labelled or not.
    linear(LM_HEAD_TARGET, tokens, hidden, text.vocab_size, stream_rg, part="lm_head")


def _gated_mlp(linear, tokens: int, hidden: int, inter: int, input_rg: bool) -> bool:
    # down(act(gate(x)) * up(x)): three matmuls.
    gate_rg = linear("gate_proj", tokens, hidden, inter, input_rg)
    up_rg = linear("up_proj", tokens, hidden, inter, input_rg)
    return linear("down_proj", tokens, inter, hidden, gate_rg or up_rg)


def _moe_flops(text, tokens, input_rg, train_base, targets, rank, tally, linear) -> bool:
    hidden = text.hidden_size
    num_experts = text.num_experts
    top_k = text.num_experts_per_tok
    inter = text.moe_intermediate_size
    # Router: hidden → num_experts logits for every token.
    tally.add(
        "lm_dense",
        _matmul(2 * tokens * hidden * num_experts, weight_grad=train_base, input_grad=input_rg),
    )
    router_rg = input_rg or train_base
    routed = tokens * top_k  # each token runs through its top-k experts
    out_rg = router_rg  # the routing weights scale the expert outputs
    gate_up_trained = train_base or "experts.gate_up_proj" in targets
    down_trained = train_base or "experts.down_proj" in targets
    # gate_up_proj: hidden → 2·I (gate and up fused), then down_proj: I → hidden.
    tally.add(
        "lm_dense",
        _matmul(2 * routed * hidden * 2 * inter, weight_grad=gate_up_trained, input_grad=input_rg),
    )
    gate_up_rg = input_rg or gate_up_trained
    tally.add(
        "lm_dense",
        _matmul(2 * routed * inter * hidden, weight_grad=down_trained, input_grad=gate_up_rg),
    )
    out_rg = out_rg or gate_up_rg or down_trained
    # PEFT target_parameters: each forward folds W + s·(B·A) for all experts with one baddbmm
    # (experts × d_out × r × d_in MACs); backward gives dA and dB, each as large again.
    folds = (("experts.gate_up_proj", 2 * inter * hidden), ("experts.down_proj", inter * hidden))
    for name, size in folds:
        if name in targets:
            tally.add(
                "lora_adapters",
                _matmul(2 * num_experts * rank * size, weight_grad=True, input_grad=True),
            )
    shared = getattr(text, "shared_expert_intermediate_size", 0) or 0
    if shared:
        # Qwen2-MoE style shared expert (Qwen3-VL-MoE has none): a gated MLP on every token
        # plus a hidden → 1 sigmoid gate.
        out_rg = _gated_mlp(linear, tokens, hidden, shared, input_rg) or out_rg
        tally.add(
            "lm_dense", _matmul(2 * tokens * hidden, weight_grad=train_base, input_grad=input_rg)
        )
    return out_rg


def lm_num_params(config) -> int:
    """Parameters of the language model: embedding, decoder layers (all experts), final norm
    and the LM head unless tied to the embedding. The ViT is not included."""
    text, _ = _text_and_vision(config)
    hidden = text.hidden_size
    head_dim = _head_dim(text)
    q_width = text.num_attention_heads * head_dim
    kv_width = text.num_key_value_heads * head_dim
    bias = bool(getattr(text, "attention_bias", False))
    attention = hidden * (q_width + 2 * kv_width) + q_width * hidden
    if bias:
        attention += q_width + 2 * kv_width + hidden
    attention += 2 * head_dim  # q_norm and k_norm (RMSNorm over head_dim)
    norms = 2 * hidden  # input and post-attention RMSNorm
    total = 0
    for layer in range(text.num_hidden_layers):
        if _is_moe_layer(text, layer):
            mlp = text.num_experts * hidden  # router
            mlp += text.num_experts * 3 * hidden * text.moe_intermediate_size
            shared = getattr(text, "shared_expert_intermediate_size", 0) or 0
            mlp += 3 * hidden * shared + (hidden if shared else 0)
        else:
            mlp = 3 * hidden * text.intermediate_size
        total += attention + norms + mlp
    embedding = text.vocab_size * hidden
    tied = bool(getattr(config, "tie_word_embeddings", False))
    return embedding + total + hidden + (0 if tied else embedding)


def nominal_flops(config, capacity_tokens: int) -> int:
    """The ``6·N·tokens`` figure others report: N = :func:`lm_num_params` (all experts, both
    embeddings), tokens = the row capacity (padding included). Factor 6 = 2 FLOPs per
    multiply-accumulate × (1 forward + 2 backward matmuls per weight)."""
    if capacity_tokens < 0:
        raise ValueError(f"capacity_tokens must be >= 0, got {capacity_tokens}")
    return 6 * lm_num_params(config) * capacity_tokens


def peak_bf16_flops(device_name: str) -> float | None:
    """Dense BF16 peak FLOP/s of a device from :data:`PEAK_BF16_DENSE_TFLOPS`, matched by name
    (``torch.cuda.get_device_name()``, e.g. ``"NVIDIA H100 80GB HBM3"``); ``None`` for a CPU,
    an unknown device or a PCIe/NVL variant (lower clocks, not in the table)."""
    name = device_name.upper()
    if "PCIE" in name or "NVL" in name:
        return None
    for key, tflops in PEAK_BF16_DENSE_TFLOPS.items():
        if key in name:
            return tflops * 1e12
    return None


def mfu(flops_per_s: float, device_name: str) -> float | None:
    """Model FLOPs utilisation of one device, in [0, 1]: achieved FLOP/s over its dense BF16
    peak. ``None`` where there is no peak to compare to (CPU: report TFLOP/s only)."""
    peak = peak_bf16_flops(device_name)
    if peak is None:
        return None
    return flops_per_s / peak
