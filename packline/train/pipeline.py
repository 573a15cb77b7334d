"""Pipeline parallelism for the local backend: the Qwen3-VL decoder split into stages
(:mod:`packline.train.stage_split`) and run by ``torch.distributed.pipelining`` (GPipe or
1F1B), on packed fixed-width rows, by :class:`PipelineRunner`.

Loss: the last stage computes ``token_loss_sum`` (float64 Σ token cross-entropy) of each
micro-batch and back-propagates it divided by the step's global target count (all rows of
all data-parallel ranks); gradients accumulate over micro-batches (``scale_grads=False``):
summed, as for data parallelism. :meth:`PipelineRunner.step` returns the pipeline's Σ token
loss on every stage (summed over the pipeline group from the last stage).

Measured on CPU over gloo (tests/integration/test_pipeline_parallel.py; torch 2.14,
transformers 5.24, peft 0.21; 4 real rows of 512 tokens with images and videos): PP 2
(GPipe and 1F1B) and PP 4 equal one process bitwise (loss and every LoRA gradient, Δ = 0)
for the tiny dense and MoE models (router statistics too) and for a 4-layer variant whose
carried deepstack features have layers after them (vision LoRA); PP 2 × EP 2 (experts split
by :mod:`packline.train.expert_parallel`) is within 6e-7 of each gradient's largest value
(EP's expert GEMM sums the tokens in another order). GPU / nccl: untested.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch import nn

from packline.packing.thd import PackedBatch, to_device
from packline.qwen.forward import conversation_weights, token_loss_sum
from packline.qwen.moe import RouterStats
from packline.train.distributed import all_gather_object, all_reduce_sum
from packline.train.layout import LayoutGroups
from packline.train.stage_split import (
    StageModule,
    StagePlan,
    check_stage_inputs,
    requires_grad_after,
    unwrap_model,
)
from schemas.layout import ParallelLayout


class PipelineRunner:
    """This rank's pipeline stage of ``model`` and its schedule.

    ``model``: the full model (PEFT-wrapped), built with the same seed and adapters on every
    rank; it is stripped in place to this rank's stage (:class:`StageModule`). ``layout``
    and ``groups``: :class:`~schemas.layout.ParallelLayout` and its
    :class:`~packline.train.layout.LayoutGroups` (this rank's stage from
    ``layout.coords(rank)``, its pipeline's process group from ``groups.pipeline``).
    ``seq_length``: T of every row (fixed-width rows, ``packing.pad_to_max_length``).
    ``n_microbatches``: rows per data-parallel rank per step (one row per micro-batch; 1F1B
    needs at least P). ``schedule``: ``gpipe`` or ``1f1b`` (default ``layout.schedule``).
    ``image_token_id`` / ``video_token_id``: the processor's, checked against the model's
    config (HF finds the visual positions from the config's ids).

    ``bf16``: run each stage under bf16 autocast (what crosses stages stays float32; the
    stages chained in one process equal the bf16 packed forward bitwise on CPU, the
    torchrun checks run float32).

    Under expert parallelism (``packline.train.expert_parallel``: ``distribute_experts`` and
    ``apply_lora_ep`` before this) the experts' adapters are this rank's slices: read and
    load states with that module's ``local_adapter_state`` / ``load_full_adapter_state`` on
    :attr:`model`, not :meth:`local_adapter_state` here.

    Vision LoRA trains too: the deepstack features carried to later stages send their
    gradients back to stage 0. MoE: :attr:`router_stats` sums the router statistics of this
    stage's layers over real tokens; HF's load-balancing loss term is not added under
    pipeline parallelism (it couples the layers of all stages in one product).
    """

    def __init__(
        self,
        model: nn.Module,
        layout: ParallelLayout,
        groups: LayoutGroups,
        *,
        seq_length: int,
        n_microbatches: int,
        image_token_id: int,
        video_token_id: int | None = None,
        schedule: str | None = None,
        device: torch.device | None = None,
        bf16: bool = False,
        per_sample: bool = False,
    ):
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        schedule = schedule or layout.schedule
        classes = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}
        if schedule not in classes:
            raise ValueError(f"schedule {schedule!r} is not one of {', '.join(classes)}")
        P = layout.pipeline
        if schedule == "1f1b" and n_microbatches < P:
            raise ValueError(
                f"1F1B needs at least {P} micro-batches per pipeline, got {n_microbatches} "
                "(raise train.global_batch_size or use schedule: gpipe)"
            )
        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError("pipeline parallelism needs a process group (run under torchrun)")
        base = unwrap_model(model)
        config = base.config
        for name, given in (("image_token_id", image_token_id), ("video_token_id", video_token_id)):
            have = getattr(config, name, None)
            if given is not None and have is not None and int(given) != int(have):
                raise ValueError(
                    f"{name} {given} is not the model config's {have}: the stages find the "
                    "visual positions from the config"
                )
        self.layout, self.groups = layout, groups
        self.coords = layout.coords(groups.rank)
        self.seq_length = int(seq_length)
        self.n_microbatches = int(n_microbatches)
        self.schedule_name = schedule
        self.device = device or next(model.parameters()).device
        text = base.model.language_model
        num_layers = len(text.layers)
        num_deepstack = len(getattr(config.vision_config, "deepstack_visual_indexes", []))
        plans = [StagePlan(stage=s, num_stages=P, num_layers=num_layers,
                           num_deepstack=num_deepstack) for s in range(P)]  # fmt: skip
        hidden_grad = requires_grad_after(model, plans)
        deepstack_grad = any(p.requires_grad for p in base.model.visual.parameters())
        hidden_size, vocab = text.config.hidden_size, text.config.vocab_size
        stage = self.coords.stage

        self.model = model
        self.module = StageModule(model, stage=stage, num_stages=P)
        self.module.bf16 = bf16
        self.plan = self.module.plan
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.param_names = [n for n, _ in named]
        """Full-model names of :attr:`params` (PEFT's, as one process names them)."""
        self.params = [p for _, p in named]
        """This stage's trainable parameters; gradients accumulate here."""

        T, meta = self.seq_length, torch.device("meta")

        def example(shape, dtype, grad):
            return torch.empty(shape, dtype=dtype, device=meta).requires_grad_(grad)

        def boundary(s):  # what crosses from stage s to s + 1
            out = [example((1, T, hidden_size), torch.float32, hidden_grad[s])]
            if plans[s].carried_out:
                shape = (plans[s].carried_out, 1, T, hidden_size)
                out.append(example(shape, torch.float32, deepstack_grad))
            return tuple(out)

        inputs = (example((1, T), torch.long, False),) if stage == 0 else boundary(stage - 1)
        outputs = (example((1, T, vocab), torch.float32, True),) if self.plan.is_last else (
            boundary(stage)
        )  # fmt: skip
        self._schedules: dict[tuple[int, bool], object] = {}

        def make(n: int, train: bool):
            pipe_stage = PipelineStage(
                self.module,
                stage,
                P,
                self.device,
                input_args=inputs,
                output_args=outputs,
                group=groups.pipeline,
            )
            # Losses are summed (Σ token loss / global targets per micro-batch): never scaled.
            return classes[schedule if train else "gpipe"](
                pipe_stage, n, loss_fn=self._loss, scale_grads=False
            )

        self._make = make
        self.per_sample = per_sample
        """``train.loss: sample``: the last stage weighs each row's tokens by
        :func:`~packline.qwen.forward.conversation_weights` (sent with the labels)."""
        self._global_targets = 1
        self._loss_sums: list[torch.Tensor] = []

    # -- the loss ---------------------------------------------------------------------------

    def _loss(self, logits: torch.Tensor, target) -> torch.Tensor:
        """The schedule's loss of one micro-batch: ``target`` is its labels, or (labels,
        weights) with :attr:`per_sample`."""
        labels, weights = target if isinstance(target, tuple) else (target, None)
        loss_sum, _ = token_loss_sum(logits, labels, weights)
        self._loss_sums.append(loss_sum.detach())
        return loss_sum / self._global_targets

    def _schedule(self, n: int, train: bool):
        key = (n, train)
        if key not in self._schedules:
            self._schedules[key] = self._make(n, train)
        return self._schedules[key]

    # -- one step ----------------------------------------------------------------------------

    def _check_rows(self, rows: list[PackedBatch], n: int) -> None:
        """Every stage checks every row before the schedule starts, and all stages of the
        pipeline agree: a bad row raises on every stage (naming the stage that found it)
        instead of leaving the others waiting for activations that never come."""
        problem = ""
        try:
            if len(rows) != n:
                raise ValueError(f"{len(rows)} rows for {n} micro-batches")
            for i, row in enumerate(rows):
                width = row.input_ids.shape[-1]
                if tuple(row.input_ids.shape) != (1, self.seq_length):
                    raise ValueError(
                        f"row {i} of shape {tuple(row.input_ids.shape)}: pipeline stages need "
                        f"fixed-width rows of (1, {self.seq_length}) "
                        "(packing.pad_to_max_length: true)"
                    )
                try:
                    check_stage_inputs(
                        self.plan.stage,
                        position_ids=row.position_ids,
                        cu_seqlens_padded=row.cu_seqlens_padded,
                        length=width,
                    )
                except ValueError as err:
                    raise ValueError(f"row {i}: {err}") from None
        except ValueError as err:
            problem = str(err)
        failed = torch.tensor([1.0 if problem else 0.0], dtype=torch.float64)
        if float(all_reduce_sum(failed, group=self.groups.pipeline)[0]) == 0:
            return
        found = [p for p in all_gather_object(problem, self.groups.pipeline) if p]  # every stage
        if problem:
            raise ValueError(problem)
        raise ValueError(
            f"pipeline stage {self.plan.stage}: another stage refused the step's rows: "
            + "; ".join(found)
        )

    def _microbatches(self, rows: list[PackedBatch], *, labels: bool):
        arg_mbs, kwarg_mbs, target_mbs = [], [], []
        for row in rows:
            row = to_device(row, self.device)
            kwargs = {
                "position_ids": row.position_ids,
                "cu_seqlens_padded": row.cu_seqlens_padded,
            }
            if self.module.recorder is not None:
                kwargs["real_token_mask"] = row.real_token_mask()
            if self.plan.is_first:
                arg_mbs.append((row.input_ids,))
                kwargs.update(
                    pixel_values=row.pixel_values,
                    image_grid_thw=row.image_grid_thw,
                    pixel_values_videos=row.pixel_values_videos,
                    video_grid_thw=row.video_grid_thw,
                )
            else:
                arg_mbs.append(())
            kwarg_mbs.append(kwargs)
            weights = conversation_weights(row)[0] if self.per_sample else None
            target_mbs.append(row.labels if weights is None else (row.labels, weights))
        return dict(
            arg_mbs=arg_mbs if self.plan.is_first else None,
            kwarg_mbs=kwarg_mbs,
            target_mbs=target_mbs if self.plan.is_last and labels else None,
        )

    def _pipeline_sum(self) -> float:
        """Σ of the last stage's per-micro-batch loss sums, on every stage."""
        total = torch.zeros(1, dtype=torch.float64)
        if self.plan.is_last:
            for s in self._loss_sums:
                total += s.double().cpu()
        self._loss_sums = []
        return float(all_reduce_sum(total, group=self.groups.pipeline)[0])

    def step(self, rows: list[PackedBatch], *, global_targets: int) -> float:
        """Forward and backward of ``rows`` (this pipeline's rows of the step, the same on
        every stage, one micro-batch each) with each micro-batch's loss = Σ token loss /
        ``global_targets`` (the step's target tokens over all data-parallel ranks);
        gradients accumulate in :attr:`params` (summed; reducing them over the stage's
        data-parallel ranks is the caller's). Returns Σ token loss of ``rows`` (float64
        sums, valid on every stage)."""
        if global_targets <= 0:
            raise ValueError(f"global_targets must be positive, got {global_targets}")
        self._check_rows(rows, self.n_microbatches)
        self._global_targets = int(global_targets)
        self._loss_sums = []
        schedule = self._schedule(self.n_microbatches, True)
        module, recorder = self.module, self.module.recorder
        with recorder if recorder is not None else nullcontext():
            module.recording = recorder is not None
            try:
                schedule.step(**self._microbatches(rows, labels=True), return_outputs=False)
            finally:
                module.recording = False
        return self._pipeline_sum()

    def eval_loss_sum(self, rows: list[PackedBatch]) -> float:
        """Σ token loss of ``rows`` (forward only, no gradients), on every stage."""
        if not rows:
            return 0.0
        self._check_rows(rows, len(rows))
        self._global_targets = 1
        self._loss_sums = []
        schedule = self._schedule(len(rows), False)
        with torch.no_grad():
            schedule.eval(**self._microbatches(rows, labels=True))
        return self._pipeline_sum()

    # -- router statistics (MoE) ------------------------------------------------------------

    @property
    def router_stats(self) -> RouterStats | None:
        """This stage's router statistics (its MoE layers, the real tokens of every row it
        ran in :meth:`step`) since the last :meth:`reset_router_stats`; None for a dense
        model or before a step. Stages hold different layers and data-parallel ranks
        different rows: one SUM over the world of :meth:`RouterStats.to_tensor` counts
        each (layer, token) once. Evaluation does not record."""
        stats = self.module.router_stats
        if stats is None and self.module.recorder is not None:
            r = self.module.recorder
            return RouterStats.zeros(r.num_experts, r.top_k)
        return stats

    def reset_router_stats(self) -> None:
        self.module.router_stats = None

    # -- adapter state -----------------------------------------------------------------------

    def local_adapter_state(self) -> dict[str, torch.Tensor]:
        """This stage's trainable parameters by their full-model names (detached copies);
        the stages' states together are the one-process adapter state."""
        return {n: p.detach().clone() for n, p in zip(self.param_names, self.params, strict=True)}

    def load_adapter_state(self, state: dict[str, torch.Tensor]) -> None:
        """Copy this stage's parameters out of a full (one-process) adapter state; raises
        ``KeyError`` naming the ones ``state`` lacks."""
        missing = [n for n in self.param_names if n not in state]
        if missing:
            raise KeyError(f"adapter state lacks {len(missing)} of this stage's: {missing[:3]}")
        with torch.no_grad():
            for n, p in zip(self.param_names, self.params, strict=True):
                p.copy_(state[n].to(p.device, p.dtype))
