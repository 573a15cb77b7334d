"""What a local training run's parallel layout (:class:`schemas.layout.ParallelLayout`: who
holds and reads what) needs of torch, once:

- :class:`LayoutGroups` — the layout's ``DeviceMesh`` and its process groups (stage's
  data-parallel ranks, the pipeline's stages, the expert-parallel ranks, the copies of each
  expert);
- :func:`count_once` — a per-rank value summed over the world with one copy per
  data-parallel index (every stage reads the same rows: their counters count once);
- :func:`clip_grad_norm` — the global gradient norm over parameters that live on different
  meshes (dense adapters replicated over a stage's data ranks, expert adapters over the
  copies of their experts, stages holding different layers), each parameter counted once.
"""

from __future__ import annotations

from functools import cached_property

import torch
import torch.distributed as dist

from schemas.layout import ParallelLayout


class LayoutGroups:
    """The layout as torch's ``DeviceMesh`` and the process groups it gives, created
    collectively (every rank builds the same meshes):

    - ``mesh`` ``(pp, edp, ep, tp)`` — pipeline stages × copies of each expert × expert
      slices × 1 (the tensor-parallel dim transformers' expert parallelism asks for), so
      ``rank = stage·data + copy·E + e``: ``pipeline`` (the same ``d`` on every stage) is
      its ``pp`` dim, ``expert`` (a stage's E slices of one copy) its ``ep``, and
      ``expert_copies`` (the copies of this rank's experts) its ``edp``;
    - ``stage_mesh`` ``(pp, dp)`` — ``stage_data`` (a stage's data-parallel ranks) is its
      ``dp`` dim.

    Without a process group (one rank) the meshes and groups are None and the collectives
    below are no-ops."""

    def __init__(self, layout: ParallelLayout):
        self.layout = layout
        self.rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        self.coords = layout.coords(self.rank)
        self.mesh = self.stage_mesh = None
        self.stage_data = self.pipeline = self.expert = self.expert_copies = None
        if layout.world == 1:
            return
        from torch.distributed.device_mesh import init_device_mesh

        lay = layout
        device = "cuda" if torch.cuda.is_available() else "cpu"
        self.mesh = init_device_mesh(
            device,
            (lay.pipeline, lay.expert_data, lay.expert, 1),
            mesh_dim_names=("pp", "edp", "ep", "tp"),
        )
        self.stage_mesh = init_device_mesh(
            device, (lay.pipeline, lay.data), mesh_dim_names=("pp", "dp")
        )
        self.stage_data = self.stage_mesh.get_group("dp")
        self.pipeline = self.mesh.get_group("pp")
        self.expert = self.mesh.get_group("ep")
        self.expert_copies = self.mesh.get_group("edp")

    @cached_property
    def pipeline_ranks(self) -> list[int]:
        """Global ranks of this rank's pipeline, stage 0 first."""
        return [self.layout.rank_of(stage=s, d=self.coords.d) for s in range(self.layout.pipeline)]


# -- collectives that depend on the layout -----------------------------------------------------


def _all_reduce(t: torch.Tensor, group=None) -> torch.Tensor:
    from packline.train.distributed import all_reduce_sum

    return all_reduce_sum(t, group=group)


def count_once(values: torch.Tensor, layout: ParallelLayout, rank: int) -> torch.Tensor:
    """``values`` (this rank's, float64) summed over the data-parallel indices: stage 0's
    ranks contribute, the other stages (which read the same rows) add zeros. Every rank gets
    the sum.

    >>> count_once(torch.tensor([3.0], dtype=torch.float64), ParallelLayout(), 0)
    tensor([3.], dtype=torch.float64)
    """
    contribution = values if layout.coords(rank).stage == 0 else torch.zeros_like(values)
    return _all_reduce(contribution.clone())


def clip_grad_norm(
    params: list[torch.Tensor], replicas: list[int], max_norm: float
) -> torch.Tensor:
    """Clip the gradients of ``params`` by their global norm and return it, as
    ``torch.nn.utils.clip_grad_norm_`` does on one process, when the parameters live on
    several meshes: ``replicas[i]`` is how many ranks hold a copy of ``params[i]`` (after
    its gradient was summed over them), so each distinct parameter enters the norm once.
    One all-reduce over the world; float64.

    >>> p = torch.nn.Parameter(torch.zeros(2)); p.grad = torch.tensor([3.0, 4.0])
    >>> float(clip_grad_norm([p], [1], 1.0)), [round(g, 5) for g in p.grad.tolist()]
    (5.0, [0.6, 0.8])
    """
    device = params[0].device if params else torch.device("cpu")
    sq = torch.zeros((), dtype=torch.float64, device=device)
    for p, n in zip(params, replicas, strict=True):
        if p.grad is not None:
            g = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
            sq += g.detach().double().pow(2).sum() / n
    total = _all_reduce(sq.reshape(1).cpu()).sqrt()[0]
    coef = min(1.0, max_norm / (float(total) + 1e-6))
    if coef < 1.0:
        for p in params:
            if p.grad is not None:
                p.grad.mul_(coef)
    return total
