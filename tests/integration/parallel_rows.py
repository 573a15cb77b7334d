"""Rows and one-process references for the parallel-layout checks (EP, PP): pure helpers,
no process group needed (torchrun scripts and pytest tests import them).

``parallel_config`` is the tiny MoE on fixed-width rows with expert LoRA; ``step_rows`` is
what data-parallel rank ``d`` of ``data`` reads for one step (the training stream of
``stages/train.py``); ``one_process_step`` is the reference: Σ token loss / targets over a
step's micro-batches on one model, gradients accumulated as the trainer does.
"""

from __future__ import annotations

from pathlib import Path

import torch

from packline.packing.thd import PackedBatch, build_padded_batch, to_device
from packline.qwen.forward import packed_forward, padded_forward, token_loss_sum
from tests.conftest import make_config
from tests.integration.train_helpers import SMALL

MOE_FIXED_WIDTH = (
    "model.moe=true",
    "model.path=null",  # the tiny MoE at random init (the shipped base is dense)
    "packing.pad_to_max_length=true",
    "lora.target_parameters=[mlp.experts.gate_up_proj,mlp.experts.down_proj]",
)
"""The tiny Qwen3-VL-MoE, rows padded to ``packing.seq_length``, LoRA on the experts too."""


def parallel_config(work: Path, *overrides: str):
    """The small set's config (``SMALL``) with :data:`MOE_FIXED_WIDTH` and ``overrides``."""
    return make_config(Path(work), *SMALL, *MOE_FIXED_WIDTH, *overrides)


def step_rows(cfg, *, d: int = 0, data: int = 1, steps: int = 1) -> list[list[PackedBatch]]:
    """The rows data-parallel rank ``d`` of ``data`` trains on in each of the first
    ``steps`` optimizer steps (``train.global_batch_size / data`` rows each)."""
    from packline.train.setup import training_stream

    per_rank, rest = divmod(cfg.train.global_batch_size, data)
    if rest:
        raise ValueError(f"global_batch_size {cfg.train.global_batch_size} over {data} ranks")
    stream = training_stream(cfg, rank=d, world=data)
    return [stream.next_rows(per_rank) for _ in range(steps)]


def all_step_rows(cfg, *, data: int, step: int = 0) -> list[PackedBatch]:
    """Every data-parallel rank's rows of step ``step``, rank 0's first (the one-process
    reference's input)."""
    return [
        row for d in range(data) for row in step_rows(cfg, d=d, data=data, steps=step + 1)[step]
    ]


def padded_micro_batches(rows: list[PackedBatch], *, pad_token_id: int, size: int) -> list:
    """The rows' conversations laid out unpacked, ``size`` per right-padded micro-batch (the
    trainer's packing-off layout)."""
    convs = [c for row in rows for c in row.conversations()]
    return [
        build_padded_batch(convs[i : i + size], pad_token_id=pad_token_id)
        for i in range(0, len(convs), size)
    ]


def one_process_step(
    model,
    micro: list,
    *,
    image_token_id: int,
    video_token_id: int | None,
    packed: bool = True,
    num_targets: int | None = None,
) -> tuple[float, int]:
    """Backward of Σ token loss / ``num_targets`` (default: the targets of ``micro``) on
    ``model``, accumulating into ``.grad``; returns (Σ loss / targets, targets). With
    ``num_targets`` the global count, this is one rank's share of a distributed step."""
    targets = sum(m.num_loss_tokens for m in micro) if num_targets is None else num_targets
    device = next(p for p in model.parameters() if p.requires_grad).device
    forward = packed_forward if packed else padded_forward
    total = 0.0
    for m in micro:
        m = to_device(m, device)
        logits = forward(model, m, image_token_id=image_token_id, video_token_id=video_token_id)
        loss_sum, _ = token_loss_sum(logits, m.labels)
        (loss_sum / targets).backward()
        total += float(loss_sum.detach())
    return total / targets, targets


def seeded_adapter_state(model, *, seed: int = 1, scale: float = 0.05) -> dict[str, torch.Tensor]:
    """Random values (seeded) for every trainable parameter of ``model``: LoRA B nonzero, so
    every factor has a gradient (PEFT starts B at zero, where A's gradient is zero)."""
    gen = torch.Generator().manual_seed(seed)
    return {
        n: torch.randn(p.shape, generator=gen, dtype=p.dtype) * scale
        for n, p in model.named_parameters()
        if p.requires_grad
    }
