"""The MoE router's load-balancing loss and expert loads, over a row's real tokens only.

HF Qwen3-VL-MoE computes its load-balancing loss (``load_balancing_loss_func``) over the
tokens its ``attention_mask`` marks, and a packed row passes ``attention_mask=None`` (a 2-D
mask would make its conversations attend to each other, :mod:`packline.qwen.forward`). So
``output_router_logits=True`` on a packed row counts the alignment gaps and the fixed-width
tail as tokens: the loss, and every expert load read from it, depend on the layout — on the
tiny MoE, 2.166 instead of 2.080 for three conversations (71 tokens) at fixed width 256
(tests/unit/test_moe_router.py). The pads are still routed and dispatched to the experts
(that costs compute, not correctness); what must not see them is the statistics.
Megatron-Bridge fixed the same for Megatron (#5470).

So the mask goes to the loss only, never to the model:

- :class:`RouterRecorder` keeps each router call's logits through forward hooks, so it works
  wherever the routers are: a plain HF model, a PEFT-wrapped one, a pipeline stage holding
  only some decoder layers, and under expert parallelism (the router runs, replicated,
  before tokens are dispatched to the experts' ranks; measured with transformers' EP2 ×
  FSDP2 over gloo, the logits (to 1.5e-7), the aux loss (bitwise) and its gradients (to
  4e-9) equal one process's);
- :func:`aux_loss` is HF's own function over those logits, with the row's
  ``real_token_mask()`` as its ``attention_mask``: differentiable, the term a trainer adds;
- :class:`RouterStats` holds the same quantities as sums (detached, float64), which add over
  micro-batches, pipeline stages (each holds some layers) and data-parallel ranks
  (``to_tensor`` → ``all_reduce`` SUM → ``from_tensor``), and gives the logged
  ``moe/aux_loss`` and expert loads.

Shape legend: ``N`` tokens of one forward (batch × sequence, the router's rows), ``E``
experts, ``k`` experts per token (top-k).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import (
    Qwen3VLMoeTextTopKRouter,
    load_balancing_loss_func,
)

from packline import metrics


def _routing_sizes(
    model: torch.nn.Module, routers: list[Qwen3VLMoeTextTopKRouter]
) -> tuple[int, int]:
    """(experts, experts per token) from the model's (text) config, else from its routers;
    every router must agree."""
    config = getattr(model, "config", None)
    text = getattr(config, "text_config", config)
    num_experts = getattr(text, "num_experts", None)
    top_k = getattr(text, "num_experts_per_tok", None)
    if (num_experts is None or top_k is None) and routers:
        num_experts, top_k = routers[0].num_experts, routers[0].top_k
    if num_experts is None or top_k is None:
        raise ValueError(
            f"{type(model).__name__} is not a Qwen3-VL-MoE model: its config has no "
            "num_experts / num_experts_per_tok and it holds no Qwen3VLMoeTextTopKRouter"
        )
    for router in routers:
        assert (router.num_experts, router.top_k) == (num_experts, top_k), (
            f"router of {router.num_experts} experts, top-{router.top_k}; the config says "
            f"{num_experts}, top-{top_k}"
        )
    return int(num_experts), int(top_k)


class RouterRecorder:
    """Records the router logits of every MoE layer of ``model`` while in a ``with`` block.

    ``logits`` holds one (N, E) tensor per router call, in call order (for one forward: the
    model's MoE layers in order), as the router returned it — not detached, so a loss over
    them trains what produced them. Call :meth:`clear` before each forward; the hooks are
    removed on leaving the block. A model whose layers are all dense (a pipeline stage of
    ``mlp_only_layers``) records nothing. Under activation checkpointing the recomputation
    in backward calls the routers again and appends to ``logits``: compute the loss before
    backward, clear before the next forward.
    """

    def __init__(self, model: torch.nn.Module):
        self.routers = [m for m in model.modules() if isinstance(m, Qwen3VLMoeTextTopKRouter)]
        self.num_experts, self.top_k = _routing_sizes(model, self.routers)
        self.logits: list[torch.Tensor] = []
        self._handles: list[torch.utils.hooks.RemovableHandle] = []

    def __enter__(self) -> RouterRecorder:
        if self._handles:
            raise RuntimeError("this RouterRecorder is already recording")
        self._handles = [r.register_forward_hook(self._record) for r in self.routers]
        return self

    def __exit__(self, *exc_info) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _record(self, module, args, output) -> None:
        self.logits.append(output[0])  # (router_logits, scores, indices)

    def clear(self) -> None:
        """Forget the recorded logits (a new list: one handed out earlier keeps its own)."""
        self.logits = []


def _check_rows(logits: Sequence[torch.Tensor], mask: torch.Tensor) -> None:
    if not logits:
        raise ValueError("no router logits: the forward ran no MoE layer while recording")
    for i, layer in enumerate(logits):
        if layer.dim() != 2 or layer.shape[0] != mask.numel():
            raise ValueError(
                f"router logits {i} of shape {tuple(layer.shape)} do not match a mask of "
                f"{tuple(mask.shape)}: each layer's logits must be (batch × seq, experts) of "
                "the one forward the mask describes (clear the recorder before each forward)"
            )


def aux_loss(
    logits: Sequence[torch.Tensor], mask: torch.Tensor, *, num_experts: int, top_k: int
) -> torch.Tensor:
    """HF's load-balancing loss (``load_balancing_loss_func``) over the real tokens only.

    ``logits``: one (N, E) tensor per MoE layer of one forward (:attr:`RouterRecorder.logits`);
    ``mask``: (batch, seq) bool with batch × seq = N, True on real tokens (a row's
    ``real_token_mask()``). ``E · Σₑ fₑ · Pₑ`` with ``fₑ`` the top-k assignments to expert
    ``e`` and ``Pₑ`` its router probabilities, each summed over layers and real tokens and
    divided by layers × real tokens. Differentiable; float32, as HF computes it.

    Add it to the language-model loss and run one backward of the sum: under FSDP2 a backward
    of this term alone fails (measured, EP2 × FSDP2 over gloo: "setStorage ... out of bounds
    for storage of size 0"), since FSDP unshards a module's weights for backward from hooks
    on that module's outputs, which the router logits alone do not pass through.
    """
    _check_rows(logits, mask)
    return load_balancing_loss_func(tuple(logits), num_experts, top_k, mask)


@dataclass(kw_only=True)
class RouterStats:
    """The router's statistics over real tokens, as sums: they add across micro-batches,
    pipeline stages and data-parallel ranks.

    The aux loss of summed stats is the aux loss of the union of their tokens (HF's formula
    applied to the sums: one normalization over every layer and token), not the mean of
    per-micro-batch losses. The term a trainer adds (:func:`aux_loss`) is computed per
    micro-batch; for one micro-batch both agree (to ~1e-7: float64 sums here, float32 in
    HF).
    """

    num_experts: int
    top_k: int
    counts: torch.Tensor  # (E,) float64
    """Top-k assignments of real tokens to each expert, summed over layers (k per token)."""
    prob_sums: torch.Tensor  # (E,) float64
    """Router probabilities of real tokens for each expert, summed over layers."""
    num_layer_tokens: torch.Tensor  # () float64
    """(MoE layer, real token) pairs counted."""

    @classmethod
    def zeros(
        cls, num_experts: int, top_k: int, device: torch.device | str | None = None
    ) -> RouterStats:
        """No tokens yet (the start of a sum; a pipeline stage without MoE layers)."""
        zero = torch.zeros(num_experts, dtype=torch.float64, device=device)
        return cls(
            num_experts=num_experts,
            top_k=top_k,
            counts=zero,
            prob_sums=zero.clone(),
            num_layer_tokens=torch.zeros((), dtype=torch.float64, device=device),
        )

    @classmethod
    def from_logits(
        cls,
        logits: Sequence[torch.Tensor],
        mask: torch.Tensor,
        top_k: int,
        *,
        num_experts: int | None = None,
    ) -> RouterStats:
        """The stats of one forward's router logits over the tokens ``mask`` marks (shapes
        as :func:`aux_loss`), detached. Routing is recomputed as the router does it (float32
        softmax, top-k). No logits (a stage without MoE layers) give zeros, for which
        ``num_experts`` must be given. No device sync."""
        if not logits:
            if num_experts is None:
                raise ValueError("no router logits: pass num_experts for empty stats")
            return cls.zeros(num_experts, top_k, mask.device)
        _check_rows(logits, mask)
        if num_experts is not None and logits[0].shape[-1] != num_experts:
            raise ValueError(f"router logits of {logits[0].shape[-1]} experts, not {num_experts}")
        num_experts = logits[0].shape[-1]
        device = logits[0].device
        weight = mask.reshape(-1).to(device=device, dtype=torch.float64)
        stats = cls.zeros(num_experts, top_k, device)
        with torch.no_grad():
            for layer in logits:
                probs = torch.softmax(layer.detach().float(), dim=-1)  # (N, E)
                _, chosen = torch.topk(probs, top_k, dim=-1)  # (N, k)
                stats.counts.scatter_add_(0, chosen.reshape(-1), weight.repeat_interleave(top_k))
                stats.prob_sums += (probs.double() * weight[:, None]).sum(dim=0)
            stats.num_layer_tokens += weight.sum() * len(logits)
        return stats

    def _check_same(self, other: RouterStats) -> None:
        if (self.num_experts, self.top_k) != (other.num_experts, other.top_k):
            raise ValueError(
                f"router stats of {self.num_experts} experts, top-{self.top_k} and of "
                f"{other.num_experts}, top-{other.top_k} cannot be added"
            )

    def __add__(self, other: RouterStats) -> RouterStats:
        self._check_same(other)
        return RouterStats(
            num_experts=self.num_experts,
            top_k=self.top_k,
            counts=self.counts + other.counts,
            prob_sums=self.prob_sums + other.prob_sums,
            num_layer_tokens=self.num_layer_tokens + other.num_layer_tokens,
        )

    def to_tensor(self) -> torch.Tensor:
        """(2E + 1,) float64: counts, prob_sums, num_layer_tokens — sum it over ranks with
        ``all_reduce`` and read it back with :meth:`from_tensor`."""
        return torch.cat([self.counts, self.prob_sums, self.num_layer_tokens.view(1)])

    @classmethod
    def from_tensor(cls, flat: torch.Tensor, *, top_k: int) -> RouterStats:
        """The stats of a :meth:`to_tensor` (summed or not)."""
        if flat.dim() != 1 or flat.numel() % 2 != 1 or flat.numel() < 3:
            raise ValueError(f"a flat RouterStats tensor has 2E + 1 values, got {flat.shape}")
        num_experts = (flat.numel() - 1) // 2
        flat = flat.to(torch.float64)
        return cls(
            num_experts=num_experts,
            top_k=top_k,
            counts=flat[:num_experts].clone(),
            prob_sums=flat[num_experts:-1].clone(),
            num_layer_tokens=flat[-1].clone(),
        )

    def aux_loss(self) -> torch.Tensor:
        """() float64: HF's load-balancing loss over the counted tokens,
        ``E · Σₑ (countsₑ / n) · (prob_sumsₑ / n)`` with n = :attr:`num_layer_tokens`
        (NaN when nothing was counted)."""
        n = self.num_layer_tokens
        return self.num_experts * ((self.counts / n) * (self.prob_sums / n)).sum()

    def expert_loads(self) -> torch.Tensor:
        """(E,) float64: each expert's assignments / the mean over experts — 1.0 everywhere
        when balanced; they sum to E."""
        return self.counts / self.counts.mean()

    def metrics(self) -> dict[str, float]:
        """``moe/aux_loss``, ``moe/expert_load_max``, ``moe/expert_load_min`` (one sync)."""
        loads = self.expert_loads()
        values = torch.stack([self.aux_loss(), loads.max(), loads.min()]).tolist()
        names = (metrics.MOE_AUX_LOSS, metrics.MOE_EXPERT_LOAD_MAX, metrics.MOE_EXPERT_LOAD_MIN)
        return dict(zip(names, values, strict=True))
