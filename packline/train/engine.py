"""How one rank runs a step's forward and backward under its parallel layout.

:class:`~packline.train.trainer.Trainer` owns the loop (data, counters, checkpoints,
evaluation); an engine owns what the layout changes (:mod:`packline.train.layout`):

- :class:`DataParallelEngine` — every rank holds the whole model (one process, or torchrun
  data parallel): forward and backward per micro-batch, gradients summed over all ranks,
  ``torch.nn.utils.clip_grad_norm_``.
- :class:`ExpertParallelEngine` — the MoE's experts split over a stage's ranks with
  transformers' engine (:mod:`packline.train.expert_parallel`); forward and backward per
  micro-batch as above, dense adapter gradients summed over the data-parallel ranks, expert
  adapter gradients over the copies of each expert, the norm over both meshes.
- :class:`PipelineEngine` — the decoder split into stages with
  ``torch.distributed.pipelining`` (:mod:`packline.train.pipeline`), optionally with EP inside
  each stage; the schedule runs every micro-batch of the step.

Every engine computes the same loss — Σ token loss / the global batch's target tokens, the
gradients summed, never averaged — so the layout changes where the work runs, not the run:
the equivalence tests compare each layout with one process on the same rows. Checkpoints do
not go through the engine: every rank saves what it holds under layout-free names
(:mod:`packline.train.checkpoint`), so any layout resumes any other's.

MoE models: every engine records the router logits (:class:`packline.qwen.moe.RouterRecorder`)
and keeps the step's :class:`~packline.qwen.moe.RouterStats` over real tokens only;
``moe_aux_loss_coef`` > 0 adds HF's load-balancing loss over each micro-batch's real tokens
(divided by the global number of micro-batches, so its gradient too is summed once).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch

from packline.packing.thd import IGNORE_INDEX, PaddedBatch, to_device
from packline.qwen.forward import (
    LOSS_CHUNK_TOKENS,
    conversation_weights,
    packed_forward,
    packed_loss,
    padded_forward,
    padded_loss,
    token_loss_sum,
)
from packline.qwen.moe import RouterRecorder, RouterStats, aux_loss
from packline.train.distributed import (
    all_gather_object,
    all_reduce_sum,
    check_replicas,
    sum_grads_over_ranks,
)
from packline.train.layout import LayoutGroups
from schemas.layout import ParallelLayout


@dataclass
class StepLoss:
    """What one rank's forward and backward of a step returns."""

    loss_sum: float
    """Σ token loss of this rank's rows (float64). Under PP every stage of a pipeline
    returns the pipeline's sum; only stage 0's ranks are counted
    (:func:`~packline.train.layout.count_once`)."""
    router: RouterStats | None = None
    """This rank's router statistics of the step (MoE only): its layers, its tokens."""


def _is_moe(model) -> bool:
    config = getattr(model, "config", None)
    return getattr(getattr(config, "text_config", config), "num_experts", None) is not None


class Engine(ABC):
    """What every layout's engine does (see the module docstring): the step's forward and
    backward over this rank's micro-batches (shared), and the layout's own gradient
    reduction, clipping, replica check and states (abstract)."""

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
        loss_chunk_tokens: int = LOSS_CHUNK_TOKENS,
        per_sample: bool = False,
    ):
        self.model = model
        self.loss_chunk_tokens = loss_chunk_tokens
        self.per_sample = per_sample
        """``train.loss: sample``: each conversation's tokens weigh 1/its targets in the sum
        (:func:`~packline.qwen.forward.conversation_weights`); the caller divides by the
        global batch's conversations instead of its target tokens."""
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

    # -- the step ---------------------------------------------------------------------------

    def forward_backward(
        self, micro: list, *, packed: bool, global_targets: int, global_micro: int
    ) -> StepLoss:
        """Backward of Σ token loss / ``global_targets`` over this rank's micro-batches
        (plus the aux term of each, / ``global_micro``); gradients accumulate locally. With
        :attr:`per_sample` the sum is weighed and ``global_targets`` is the global batch's
        conversations with a target."""
        device = self.params[0].device
        loss_total = torch.zeros((), dtype=torch.float64, device=device)
        stats = None
        recording = self.recorder if self.recorder is not None else nullcontext()
        with recording:
            for m in micro:
                m = to_device(m, device)
                if self.recorder is not None:
                    self.recorder.clear()
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=self.bf16):
                    loss_sum, _, _ = self.loss_of(m, packed=packed)
                loss = loss_sum / global_targets
                if self.recorder is not None and m.num_real_tokens:
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

    def loss_of(self, m, *, packed: bool) -> tuple[torch.Tensor, int, int]:
        """Σ token loss of micro-batch ``m`` (on the device), the LM head chunk by chunk: no
        [T, vocab] tensor (:func:`~packline.qwen.forward.packed_loss`)."""
        loss_of = packed_loss if packed else padded_loss
        return loss_of(
            self.model,
            m,
            image_token_id=self.image_token_id,
            video_token_id=self.video_token_id,
            chunk_tokens=self.loss_chunk_tokens,
            per_sample=self.per_sample,
        )

    def evaluating(self, model):
        """A context for rank 0's evaluation of ``model`` (the whole one-process model):
        where it is already placed, nothing to do."""
        return nullcontext()

    # -- what the layout decides ------------------------------------------------------------

    @property
    @abstractmethod
    def owns_whole_state(self) -> bool:
        """Every rank holds the same whole adapter state."""

    @abstractmethod
    def reduce_gradients(self) -> None:
        """Sum (never average) the gradients over the ranks holding copies of each weight."""

    @abstractmethod
    def clip(self, max_norm: float) -> float:
        """Clip by the global gradient norm; returns the norm before clipping."""

    @abstractmethod
    def check_replicas(self, *, step: int) -> list[float]:
        """Every rank's checksum of what it holds; raises when copies differ."""

    @abstractmethod
    def local_state(self) -> dict[str, torch.Tensor]:
        """The trainable tensors this rank owns."""

    @abstractmethod
    def full_adapter_state(self) -> dict[str, torch.Tensor] | None:
        """The one-process adapter state (every rank calls this; rank 0 gets it)."""


class DataParallelEngine(Engine):
    """One process, or torchrun data parallel: the whole model on every rank, gradients
    summed over all of them."""

    @property
    def owns_whole_state(self) -> bool:
        return True

    def reduce_gradients(self) -> None:
        """Sum (never average) the gradients over the ranks holding copies of each weight."""
        sum_grads_over_ranks(self.params)

    def clip(self, max_norm: float) -> float:
        return float(torch.nn.utils.clip_grad_norm_(self.params, max_norm))

    def check_replicas(self, *, step: int) -> list[float]:
        """Every rank's checksum of its trainable weights; raises when copies of the same
        weights differ after a step (:func:`~packline.train.distributed.check_replicas`)."""
        return check_replicas(self.params, step=step)

    def local_state(self) -> dict[str, torch.Tensor]:
        """The trainable tensors this rank owns, by the model's parameter names."""
        return {n: p.detach().clone() for n, p in self.model.named_parameters() if p.requires_grad}

    def full_adapter_state(self) -> dict[str, torch.Tensor] | None:
        """The one-process adapter state (every rank calls this; rank 0 gets it)."""
        return self.local_state() if self.rank == 0 else None


class SplitEngine(Engine):
    """What EP and PP share: each rank holds part of the adapters (its experts' slices, its
    stage's layers), sums dense gradients over its stage's data ranks and expert gradients
    over the copies of its experts, clips by the norm over every mesh,
    and the parts merge back into the one-process PEFT state
    (:func:`packline.train.expert_parallel.merge_adapter_states`)."""

    @property
    def owns_whole_state(self) -> bool:
        return False

    def evaluating(self, model):
        return _visiting(model, self.params[0].device)

    def reduce_gradients(self) -> None:
        from packline.train.expert_parallel import reduce_adapter_grads

        reduce_adapter_grads(self.model, self.groups)

    def clip(self, max_norm: float) -> float:
        from packline.train.expert_parallel import clip_adapter_grads

        return float(clip_adapter_grads(self.model, self.layout, max_norm))

    def local_state(self) -> dict:
        from packline.train.expert_parallel import local_adapter_state

        return local_adapter_state(self.model)

    def full_adapter_state(self) -> dict[str, torch.Tensor] | None:
        from packline.train.expert_parallel import merge_adapter_states

        parts = all_gather_object(self.local_state())
        return merge_adapter_states(parts) if self.rank == 0 else None

    def check_replicas(self, *, step: int) -> list[float]:
        """Copies of the same weights must agree after every step: the dense adapters over
        a stage's data ranks, each expert slice over its copies. Returns every rank's
        checksum of what it holds."""
        from packline.train.distributed import weights_checksum
        from packline.train.expert_parallel import adapter_params

        dense, expert = adapter_params(self.model)
        c = self.coords
        mine = (c.stage, c.ep_rank, weights_checksum(dense), weights_checksum(expert))
        every = all_gather_object(mine)
        for what, key, index in (
            ("dense adapters", lambda e: e[0], 2),
            ("expert adapters", lambda e: (e[0], e[1]), 3),
        ):
            groups: dict = {}
            for e in every:
                groups.setdefault(key(e), set()).add(e[index])
            split = {k: v for k, v in groups.items() if len(v) > 1}
            if split:
                raise RuntimeError(
                    f"{what} diverged between ranks holding copies of them after step {step} "
                    f"(checksums by stage / expert slice: {split}); gradients must be summed "
                    "identically on every copy"
                )
        return [e[2] + e[3] for e in every]


@contextmanager
def _visiting(model, device: torch.device):
    """Rank 0's one-process copy of a split layout lives in host RAM (the GPU holds this
    rank's part): on ``device`` for the evaluation only, then back."""
    model.to(device)
    try:
        yield
    finally:
        model.to("cpu")


def _every_rank_alike(micro: list) -> list:
    """``micro`` and as many idle micro-batches (one token, no target, outside the router
    statistics) as make every rank run the same number: each forward is a collective (EP's
    all-to-all, FSDP's gathers). Packing off lays a rank's conversations out in as many
    padded micro-batches as they need, which differs between ranks."""
    most = max(all_gather_object(len(micro)))
    return [*micro, *(_idle_micro() for _ in range(most - len(micro)))]


class ExpertParallelEngine(SplitEngine):
    """EP without PP: the forward and backward of :class:`Engine`, every rank together (in
    each MoE layer tokens cross ranks to their experts and back), every rank running as many
    micro-batches (:func:`_every_rank_alike`)."""

    def forward_backward(self, micro: list, **kwargs) -> StepLoss:
        return super().forward_backward(_every_rank_alike(micro), **kwargs)

    def loss_of(self, m, *, packed: bool) -> tuple[torch.Tensor, int, int]:
        """Through the model's own forward, whole logits: transformers' engine made the HF
        model the FSDP root, whose forward alone gathers the weights no decoder layer holds
        (the chunked loss calls the body and the LM head directly, past that hook)."""
        forward = packed_forward if packed else padded_forward
        logits = forward(
            self.model, m, image_token_id=self.image_token_id, video_token_id=self.video_token_id
        )
        weights = conversation_weights(m)[0] if self.per_sample else None
        loss_sum, targets = token_loss_sum(logits, m.labels, weights)
        return loss_sum, targets, 0


class ShardedEngine(Engine):
    """FSDP2 of a dense model (:mod:`packline.train.sharded`): every rank holds 1/N of the
    weights and adapters, runs every forward together (FSDP gathers each unit's weights),
    as many micro-batches on every rank (:func:`_every_rank_alike`); FSDP2 sums the
    gradients into their shards in the backward, so there is nothing left to reduce."""

    def __init__(self, model, layout: ParallelLayout, *, root, **kwargs):
        super().__init__(model, layout, **kwargs)
        self.root = root
        """The FSDP2 root (:class:`~packline.train.sharded.LossRoot` around ``model``)."""

    @property
    def owns_whole_state(self) -> bool:
        return False

    def forward_backward(self, micro: list, **kwargs) -> StepLoss:
        return super().forward_backward(_every_rank_alike(micro), **kwargs)

    def loss_of(self, m, *, packed: bool) -> tuple[torch.Tensor, int, int]:
        """Through the FSDP2 root, whose forward gathers the weights no inner unit holds."""
        return self.root(
            m,
            packed=packed,
            image_token_id=self.image_token_id,
            video_token_id=self.video_token_id,
            chunk_tokens=self.loss_chunk_tokens,
            per_sample=self.per_sample,
        )

    def evaluating(self, model):
        return _visiting(model, self.params[0].device)

    def reduce_gradients(self) -> None:
        """Nothing: FSDP2 reduce-scattered (summed) them in the backward."""

    def clip(self, max_norm: float) -> float:
        norm = torch.nn.utils.clip_grad_norm_(self.params, max_norm)  # over every shard
        return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)

    def check_replicas(self, *, step: int) -> list[float]:
        """Every rank's checksum of its shards: sharded, nothing is held twice to compare."""
        from packline.train.distributed import weights_checksum

        return all_gather_object(weights_checksum([p.to_local() for p in self.params]))

    def local_state(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in self.model.named_parameters() if p.requires_grad}

    def full_adapter_state(self) -> dict[str, torch.Tensor] | None:
        from packline.train.sharded import full_tensors

        full = full_tensors(self.model)  # every rank gathers its shards' part
        return full if self.rank == 0 else None


class PipelineEngine(SplitEngine):
    """PP (optionally with EP inside each stage): the step's rows go through the schedule
    of :class:`packline.train.pipeline.PipelineRunner` together, each row one micro-batch;
    every stage checks each row's boundaries and positions. The loss sum is the pipeline's
    (valid on every stage; stage 0's ranks count it); the router statistics are this
    stage's layers (summed over the world they count each layer and token once)."""

    def __init__(self, runner, layout: ParallelLayout, **kwargs):
        super().__init__(runner.model, layout, **kwargs)
        self.runner = runner
        self.params = list(runner.params)
        self.recorder = None  # the runner's stages record their own routers

    def forward_backward(
        self, micro: list, *, packed: bool, global_targets: int, global_micro: int
    ) -> StepLoss:
        if not packed:
            raise ValueError("pipeline parallelism trains packed rows only")
        self.runner.reset_router_stats()
        loss_sum = self.runner.step(micro, global_targets=global_targets)
        return StepLoss(loss_sum, self.runner.router_stats)


def _idle_micro() -> PaddedBatch:
    """A micro-batch of one token and no target: its forward and backward join the experts'
    exchanges and add nothing (``num_real_tokens`` 0 keeps it out of the router stats)."""
    one = torch.zeros((1, 1), dtype=torch.long)
    return PaddedBatch(
        input_ids=one,
        attention_mask=torch.ones_like(one),
        labels=torch.full_like(one, IGNORE_INDEX),
        pixel_values=None,
        image_grid_thw=None,
        keys=[],
        num_real_tokens=0,
        num_padded_tokens=0,
        num_loss_tokens=0,
    )


def router_metrics(stats: RouterStats | None, layout: ParallelLayout) -> dict[str, float]:
    """``moe/*`` of the step over every rank's tokens and layers (a collective; empty for a
    dense model). Stats add over stages (different layers) and data ranks (different
    tokens): one sum over the world counts each (layer, token) once."""
    if stats is None:
        return {}
    total = all_reduce_sum(stats.to_tensor().clone())
    return RouterStats.from_tensor(total, top_k=stats.top_k).metrics()
