"""Memory of a training step: measured with torch's own tracker, and forecast.

:func:`measured_peak` runs a step under ``torch.distributed._tools.mem_tracker.MemTracker``
(which follows every tensor's storage, by module and by kind: parameters, gradients,
activations, optimizer state, on any device, the CPU included) and returns the step's peak
by kind. MemTracker installs a gradient hook on every parameter of each module it sees,
which a frozen parameter refuses (a LoRA model's base is frozen): the tracker made here
lets those through without one (they never get a gradient to count). MemTracker is imported
only to measure: its import pulls ``torch.utils.flop_counter``, which warns on every CUDA build
without triton ("flop counting will not work for triton kernels") into the run's console.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch

_NO_HOOK = SimpleNamespace(remove=lambda: None)


def _frozen_aware_tracker():
    """torch's MemTracker for a model with frozen parameters (see the module docstring)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    class FrozenAwareTracker(MemTracker):
        def track_model(self, model: torch.nn.Module) -> None:
            for param in model.parameters():
                if not param.requires_grad:
                    self._param_to_grad_hook_handles[param] = (_NO_HOOK, _NO_HOOK)
            self.track_external(model)

    return FrozenAwareTracker()


class _Forward(torch.nn.Module):
    """A step's forward as one module call: MemTracker counts a module called twice outside
    a common parent (the chunked loss's LM head, called per chunk) as a second iteration."""

    def __init__(self, model: torch.nn.Module, forward: Callable[[], torch.Tensor]):
        super().__init__()
        self.model = model
        self.run = forward

    def forward(self) -> torch.Tensor:
        return self.run()


def measured_peak(
    model: torch.nn.Module, forward: Callable[[], torch.Tensor], *extra: Any
) -> dict[str, int]:
    """The peak bytes of a training step of ``model``: ``forward()`` (returning the loss) and
    its backward, by kind (``Parameter``, ``Gradient``, ``Activation``, ``Temp``,
    ``Optstate``, ``Other`` and ``Total``), summed over devices; ``extra``: optimizers or
    tensors made outside the step to count too."""
    tracker = _frozen_aware_tracker()
    whole = _Forward(model, forward)
    tracker.track_model(whole)
    if extra:
        tracker.track_external(*extra)
    with tracker:
        whole().backward()
    peak: dict[str, int] = {}
    for by_kind in tracker.get_tracker_snapshot("peak").values():
        for kind, value in by_kind.items():
            name = getattr(kind, "value", str(kind))
            peak[name] = peak.get(name, 0) + int(value)
    return peak


# --- the forecast --------------------------------------------------------------------------

GIB = 1024**3


@dataclass(frozen=True)
class StepShape:
    """What a training step's memory depends on, besides the model: its widest forward."""

    tokens: int
    """Tokens of the widest forward: a packed row (``packing.seq_length``), or a padded
    micro-batch (rows × the longest)."""
    vision_patches: int
    """ViT patches of that forward's images and video frames (4 per visual token)."""
    visual_tokens: int
    """Visual tokens of that forward (what the ViT hands the language model)."""


@dataclass(frozen=True)
class MemoryForecast:
    """Per-GPU peak of a training step, by part (bytes)."""

    weights: int
    """The frozen base (over ``shards`` ranks when sharded, with what FSDP2 gathers)."""
    adapters: int
    """LoRA weights, their gradients and AdamW's two moments, fp32."""
    activations: int
    """What the backward keeps of the forward (the layers' saved tensors, or with
    checkpointing only their inputs)."""
    recompute: int
    """With checkpointing, one layer's saved tensors, recomputed in the backward (0
    without)."""
    activations_per_token: int
    """Of ``activations``: bytes per token, without checkpointing (all layers)."""
    activations_per_token_checkpointed: int
    """Bytes per token with checkpointing (the layers' inputs)."""
    loss_chunk: int
    """One chunk of the loss's logits (``train.loss_chunk_tokens`` × vocabulary)."""
    vision: int
    """The frozen ViT's forward over the row's images (no graph kept: its widest moment)."""
    checkpointing: bool

    @property
    def total(self) -> int:
        """Weights, adapters and the kept activations, then the largest of what comes and
        goes on top of them (never at once): a loss chunk, the ViT's forward, a recomputed
        layer."""
        transient = max(self.loss_chunk, self.vision, self.recompute)
        return self.weights + self.adapters + self.activations + transient

    def parts_gib(self) -> dict[str, float]:
        return {
            "weights": self.weights / GIB,
            "adapters_and_optimizer": self.adapters / GIB,
            "activations": self.activations / GIB,
            "recomputed_layer": self.recompute / GIB,
            "loss_chunk": self.loss_chunk / GIB,
            "vision_tower": self.vision / GIB,
            "total": self.total / GIB,
        }

    def line(self) -> str:
        """The forecast as validate prints it."""
        p = self.parts_gib()
        per_token = self.activations_per_token / 1024
        per_token_ck = self.activations_per_token_checkpointed / 1024
        return (
            f"{p['total']:.2f} GiB per GPU: weights {p['weights']:.2f}, adapters + AdamW "
            f"{p['adapters_and_optimizer']:.2f}, activations {p['activations']:.2f} "
            f"({per_token:,.1f} KiB/token, {per_token_ck:,.1f} with checkpointing: "
            f"{'on' if self.checkpointing else 'off'}), loss chunk {p['loss_chunk']:.2f}, "
            f"vision tower {p['vision_tower']:.2f}"
        )


def _text_vision(config):
    return getattr(config, "text_config", config), getattr(config, "vision_config", None)


def parameter_counts(config, targets: list[str], expert_targets: list[str], rank: int):
    """(parameters of the model, LoRA parameters) of ``config``, counted on the meta device
    (every module, no memory): LoRA adds ``rank · (in + out)`` per adapted Linear of the
    language model and per expert of an adapted 3-D expert parameter."""
    from transformers import AutoModelForImageTextToText

    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(config)
    total = sum(p.numel() for p in model.parameters())
    lora = 0
    for name, module in model.named_modules():
        if "visual" in name.split("."):
            continue
        leaf = name.rsplit(".", 1)[-1]
        if isinstance(module, torch.nn.Linear) and leaf in targets:
            lora += rank * (module.in_features + module.out_features)
        for pname, param in module.named_parameters(recurse=False):
            key = f"{name}.{pname}"
            if param.dim() == 3 and any(key.endswith(t) for t in expert_targets):
                experts, a, b = param.shape
                lora += experts * rank * (a + b)
    return total, lora


def gathered_parameters(config) -> int:
    """Parameters FSDP2 (:mod:`packline.train.sharded`) holds whole during a step besides
    its shards: the root's (everything but the language model's decoder layers: embeddings,
    LM head, final norm, the vision tower) and two decoder layers (the one running and the
    next, prefetched)."""
    from transformers import AutoModelForImageTextToText

    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(config)
    layers = list(model.model.language_model.layers)
    in_layers = sum(p.numel() for layer in layers for p in layer.parameters())
    total = sum(p.numel() for p in model.parameters())
    return total - in_layers + 2 * max(sum(p.numel() for p in x.parameters()) for x in layers)


def forecast_peak(
    config,
    shape: StepShape,
    *,
    base_bytes: int,
    compute_bytes: int,
    lora_rank: int,
    lora_targets: list[str],
    lora_expert_targets: list[str] = (),
    checkpointing: bool,
    loss_chunk_tokens: int,
    shards: int = 1,
    sharded_adapters: bool = False,
) -> MemoryForecast:
    """The per-GPU peak memory of a LoRA training step of ``config`` on ``shape``.

    The activations are counted from the tensors each decoder layer's backward needs, per
    token: a frozen Linear keeps nothing for its input gradient, but an adapted one keeps
    its input for the adapter's; attention keeps q, k, v and its output; the gated MLP its
    gate, up and product; the RMSNorms their inputs. In fp32 that is ``4h + 4q + 3kv + 4i +
    2·heads + r`` per adapted Linear (less ``h + i`` when no MLP projection is adapted)
    elements per token and layer, which torch's MemTracker measures to within 0.3 % on the
    tiny model (``tests/unit/test_train_memory.py``); under bf16 autocast each of those is 2
    bytes but the norms' fp32 upcasts and the adapters' fp32 inputs, about ``14·h`` bytes
    more (measured on CPU autocast).

    ``shards``: the ranks the frozen base is split over; under packline's FSDP2
    (``sharded_adapters``, which splits the adapters and AdamW too) a rank also holds
    :func:`gathered_parameters` whole during the step."""
    text, vision = _text_vision(config)
    h = text.hidden_size
    head_dim = getattr(text, "head_dim", None) or h // text.num_attention_heads
    q, kv = text.num_attention_heads * head_dim, text.num_key_value_heads * head_dim
    moe = getattr(text, "num_experts", None)
    inter = text.moe_intermediate_size * text.num_experts_per_tok if moe else text.intermediate_size
    linears = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    adapted = [t for t in lora_targets if t in linears]
    elements = 4 * h + 4 * q + 3 * kv + 4 * inter + 2 * text.num_attention_heads
    elements += lora_rank * len(adapted)
    if not {"gate_proj", "up_proj", "down_proj"} & set(adapted):
        elements -= h + inter
    if moe:
        elements += 2 * text.num_experts  # router logits and probabilities
    per_layer = elements * compute_bytes + (14 * h if compute_bytes == 2 else 0)
    layers = text.num_hidden_layers
    outside = 6 * h  # embeddings out, final norm in and out (fp32 upcast)
    per_token = layers * per_layer + outside
    per_token_ck = layers * h * compute_bytes + outside
    activations = (per_token_ck if checkpointing else per_token) * shape.tokens
    recompute = per_layer * shape.tokens if checkpointing else 0
    total_params, lora_params = parameter_counts(
        config, list(lora_targets), list(lora_expert_targets), lora_rank
    )
    # the chunk's logits as computed and in fp32, their log-softmax and its gradient
    loss_chunk = min(loss_chunk_tokens, shape.tokens) * text.vocab_size * 12
    vision_bytes = 0
    if vision is not None and shape.vision_patches:
        hv = vision.hidden_size
        iv = vision.intermediate_size
        deepstack = len(getattr(vision, "deepstack_visual_indexes", []) or [])
        per_patch = (6 * hv + 2 * iv) * compute_bytes
        out = shape.visual_tokens * vision.out_hidden_size * (1 + deepstack) * compute_bytes
        vision_bytes = shape.vision_patches * per_patch + out
    shards = max(shards, 1)
    weights = total_params * base_bytes // shards
    adapters = lora_params * 16
    if sharded_adapters and shards > 1:
        weights += gathered_parameters(config) * base_bytes * (shards - 1) // shards
        adapters //= shards
    return MemoryForecast(
        weights=weights,
        adapters=adapters,
        activations=activations,
        recompute=recompute,
        activations_per_token=per_token,
        activations_per_token_checkpointed=per_token_ck,
        loss_chunk=loss_chunk,
        vision=vision_bytes,
        checkpointing=checkpointing,
    )
