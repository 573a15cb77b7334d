"""How one rank runs a step's forward and backward under its parallel layout.

:class:`~packline.train.trainer.Trainer` owns the loop (data, counters, checkpoints,
evaluation); an engine owns what the layout changes (:mod:`packline.train.layout`):

- :class:`DataParallelEngine` — every rank holds the whole model (one process, or torchrun
  data parallel): forward and backward per micro-batch, gradients summed over all ranks,
  ``torch.nn.utils.clip_grad_norm_``; the adapters are one state, saved by rank 0.
- :class:`ExpertParallelEngine` — the MoE's experts split over a stage's ranks with
  transformers' engine (:mod:`packline.train.expert_parallel`); forward and backward per
  micro-batch as above, dense adapter gradients summed over the data-parallel ranks, expert
  adapter gradients over the copies of each expert, the norm over both meshes; each rank
  saves the adapters it owns.
- :class:`PipelineEngine` — the decoder split into stages with
  ``torch.distributed.pipelining`` (:mod:`packline.train.pipeline`), optionally with EP inside
  each stage; the schedule runs every micro-batch of the step; each rank saves its stage's
  adapters.

Every engine computes the same loss — Σ token loss / the global batch's target tokens, the
gradients summed, never averaged — so the layout changes where the work runs, not the run:
the equivalence tests compare each layout with one process on the same rows.

MoE models: every engine records the router logits (:class:`packline.qwen.moe.RouterRecorder`)
and keeps the step's :class:`~packline.qwen.moe.RouterStats` over real tokens only;
``moe_aux_loss_coef`` > 0 adds HF's load-balancing loss over each micro-batch's real tokens
(divided by the global number of micro-batches, so its gradient too is summed once).
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch

from packline.packing.thd import to_device
from packline.qwen.forward import packed_forward, padded_forward, token_loss_sum
from packline.qwen.moe import RouterRecorder, RouterStats, aux_loss
from packline.train.distributed import (
    all_gather_object,
    all_reduce_sum,
    check_replicas,
    sum_grads_over_ranks,
)
from packline.train.layout import LayoutGroups, ParallelLayout, count_once


@dataclass
class StepLoss:
    """What one rank's forward and backward of a step returns."""

    loss_sum: float
    """Σ token loss of this rank's rows (float64; 0 on ranks whose rows another stage's
    rank counts: only stage 0's ranks contribute to :func:`count_once`)."""
    router: RouterStats | None = None
    """This rank's router statistics of the step (MoE only): its layers, its tokens."""


def _is_moe(model) -> bool:
    config = getattr(model, "config", None)
    return getattr(getattr(config, "text_config", config), "num_experts", None) is not None


class Engine:
    """The data-parallel engine's interface; see the module docstring."""

    def __init__(
        self,
        model,
        layout: ParallelLayout,
        *,
        rank: int = 0,
        groups: LayoutGroups | None = None,
        image_token_id: int,
        video_token_id: int | None = None,
        bf16: bool = False,
        aux_loss_coef: float = 0.0,
    ):
        self.model = model
        self.image_token_id = image_token_id
        self.video_token_id = video_token_id
        self.bf16 = bf16
        self.layout = layout
        self.rank = rank
        self.groups = groups
        self.coords = layout.coords(rank)
        self.aux_loss_coef = aux_loss_coef
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.recorder = RouterRecorder(model) if _is_moe(model) else None

    @property
    def owns_whole_state(self) -> bool:
        """Every rank holds the same whole adapter state (rank 0 saves it for all)."""
        return True

    # -- the step ---------------------------------------------------------------------------

    def forward_backward(
        self, micro: list, *, packed: bool, global_targets: int, global_micro: int
    ) -> StepLoss:
        """Backward of Σ token loss / ``global_targets`` over this rank's micro-batches
        (plus the aux term of each, / ``global_micro``); gradients accumulate locally."""
        device = self.params[0].device
        loss_total = torch.zeros((), dtype=torch.float64, device=device)
        forward = packed_forward if packed else padded_forward
        stats = None
        recording = self.recorder if self.recorder is not None else nullcontext()
        with recording:
            for m in micro:
                m = to_device(m, device)
                if self.recorder is not None:
                    self.recorder.clear()
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=self.bf16):
                    logits = forward(
                        self.model,
                        m,
                        image_token_id=self.image_token_id,
                        video_token_id=self.video_token_id,
                    )
                loss_sum, _ = token_loss_sum(logits, m.labels)
                loss = loss_sum / global_targets
                if self.recorder is not None:
                    mask = m.real_token_mask()
                    r = self.recorder
                    s = RouterStats.from_logits(r.logits, mask, top_k=r.top_k)
                    stats = s if stats is None else stats + s
                    if self.aux_loss_coef:
                        term = aux_loss(r.logits, mask, num_experts=r.num_experts, top_k=r.top_k)
                        loss = loss + self.aux_loss_coef * term / global_micro
                loss.backward()
                loss_total += loss_sum.detach().double()
        return StepLoss(float(loss_total), stats)

    def reduce_gradients(self) -> None:
        """Sum (never average) the gradients over the ranks holding copies of each weight."""
        sum_grads_over_ranks(self.params)

    def clip(self, max_norm: float) -> float:
        return float(torch.nn.utils.clip_grad_norm_(self.params, max_norm))

    def check_replicas(self, *, step: int) -> list[float]:
        """Every rank's checksum of its trainable weights; raises when copies of the same
        weights differ after a step (:func:`~packline.train.distributed.check_replicas`)."""
        return check_replicas(self.params, step=step)

    # -- states -----------------------------------------------------------------------------

    def local_state(self) -> dict[str, torch.Tensor]:
        """The trainable tensors this rank owns, by the model's parameter names."""
        return {n: p.detach().clone() for n, p in self.model.named_parameters() if p.requires_grad}

    def load_local_state(self, state: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for n, p in self.model.named_parameters():
                if n in state:
                    p.copy_(state[n])

    def full_adapter_state(self) -> dict[str, torch.Tensor] | None:
        """The one-process adapter state (every rank calls this; rank 0 gets it)."""
        return self.local_state() if self.rank == 0 else None


class DataParallelEngine(Engine):
    """One process, or torchrun data parallel: the whole model on every rank."""


def router_metrics(stats: RouterStats | None, layout: ParallelLayout) -> dict[str, float]:
    """``moe/*`` of the step over every rank's tokens and layers (a collective; empty for a
    dense model). Stats add over stages (different layers) and data ranks (different
    tokens): one sum over the world counts each (layer, token) once."""
    if stats is None:
        return {}
    total = all_reduce_sum(stats.to_tensor().clone())
    return RouterStats.from_tensor(total, top_k=stats.top_k).metrics()


def gather_full_state(local: dict[str, torch.Tensor], merge, rank: int) -> dict | None:
    """Every rank's ``local`` state to rank 0, merged there by ``merge(parts)``."""
    parts = all_gather_object({n: t.cpu() for n, t in local.items()})
    return merge(parts) if rank == 0 else None


def count_step_once(values: list[float], layout: ParallelLayout, rank: int) -> list[float]:
    """``values`` of this rank summed once per data-parallel index (see :func:`count_once`)."""
    t = torch.tensor(values, dtype=torch.float64)
    return count_once(t, layout, rank).tolist()
