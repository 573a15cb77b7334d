"""FSDP2 of the dense tiny model against one process, on every rank of a torchrun launch.

Run by ``tests/integration/test_fsdp.py`` as ``python -m torch.distributed.run --standalone
--nproc-per-node=2 -m tests.integration.fsdp_check WORK RUN_DIR OUT.json MODE``:

- ``train``: the stage's trainer under ``train.parallel.fsdp=true`` trains ``STEPS`` steps
  (each rank its own rows); rank 0 trains the one-process model (the same seed, AdamW and
  schedule) on every rank's rows of each step and writes both runs' losses, gradient norms
  and final adapters' difference. The FSDP2 run then checkpoints (sharded) and exports its
  gathered adapter, for the one-process resume the test does next.
- ``resume``: a fresh FSDP2 trainer resumes the run's latest checkpoint (written by one
  process); rank 0 writes the step it resumed at and whether the gathered adapters and every
  AdamW value equal the checkpoint's bitwise.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

from packline import metrics as names
from packline.catalog import processor_dir
from packline.qwen.processor import load_processor
from packline.train.distributed import all_gather_object, init_from_env, shutdown
from packline.train.engine import DataParallelEngine
from packline.train.records import read_records
from packline.train.setup import apply_lora, build_model
from packline.train.trainer import lr_lambda
from schemas.layout import ParallelLayout
from tests.conftest import make_config
from tests.integration.parallel_rows import step_rows
from tests.integration.train_helpers import SMALL, trainer_for

FSDP = (*SMALL, "train.global_batch_size=4", "train.parallel.fsdp=true", "train.nproc_per_node=2")
STEPS = 3


def _whole(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().cpu()


def _one_process_losses(cfg, trainer) -> tuple[list[float], list[float], dict]:
    """The reference: one process, one model (the same seed, AdamW and schedule), every
    rank's rows of each step."""
    s = trainer.s
    torch.manual_seed(cfg.train.seed)
    model = apply_lora(build_model(cfg, load_processor(processor_dir(cfg))), cfg.lora)
    engine = DataParallelEngine(
        model,
        ParallelLayout(world=1),
        rank=0,
        image_token_id=trainer.image_token_id,
        video_token_id=trainer.video_token_id,
        bf16=False,
        aux_loss_coef=0.0,
        loss_chunk_tokens=s.loss_chunk_tokens,
    )
    opt = torch.optim.AdamW(engine.params, lr=s.lr, betas=s.betas, weight_decay=s.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda k: lr_lambda(k, warmup=s.warmup_steps, total=s.max_steps)
    )
    per_rank = [step_rows(cfg, d=d, data=2, steps=STEPS) for d in range(2)]
    losses, norms = [], []
    for k in range(STEPS):
        rows = [row for d in range(2) for row in per_rank[d][k]]
        targets = sum(r.num_loss_tokens for r in rows)
        out = engine.forward_backward(
            rows, packed=True, global_targets=targets, global_micro=len(rows)
        )
        losses.append(out.loss_sum / targets)
        norms.append(engine.clip(s.grad_clip))
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
    return losses, norms, engine.local_state()


def train(cfg, run_dir: Path, out: Path) -> None:
    trainer = trainer_for(cfg, True, run_dir)
    trainer.train()  # STEPS steps, logged; the last one checkpointed (sharded)
    full = trainer.engine.full_adapter_state()  # every rank gathers; rank 0 gets it
    shards = all_gather_object(
        {n: (p.to_local().numel(), p.numel()) for n, p in trainer.model.named_parameters()}
    )
    model = trainer.whole_model()
    if trainer.lead:
        model.save_pretrained(run_dir / "adapter", save_embedding_layers=False)  # as the stage
        results = read_records(run_dir / "metrics.jsonl")
        losses, norms, ref = _one_process_losses(cfg, trainer)
        report = {
            "world": trainer.world,
            "engine": type(trainer.engine).__name__,
            "sharding": trainer.what_ran()["sharding"],
            "losses": [r[names.TRAIN_LOSS] for r in results],
            "reference_losses": losses,
            "grad_norms": [r[names.TRAIN_GRAD_NORM] for r in results],
            "reference_grad_norms": norms,
            "adapter_max_abs_diff": max((full[n] - ref[n]).abs().max().item() for n in ref),
            "adapter_names_equal": sorted(full) == sorted(ref),
            # every weight, frozen or LoRA, held in halves: no rank holds one whole
            "halves": all(
                2 * local <= whole + 1 for rank in shards for local, whole in rank.values()
            ),
        }
        out.write_text(json.dumps(report))


def resume(cfg, run_dir: Path, out: Path) -> None:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    trainer = trainer_for(cfg, True, run_dir)
    step = trainer.resume()
    full = trainer.engine.full_adapter_state()
    state = {
        n: {k: _whole(v) for k, v in trainer.optimizer.state[p].items()}
        for n, p in trainer.model.named_parameters()
        if p.requires_grad
    }
    if trainer.lead:
        ckpt = trainer.checkpointer.latest()
        flat = run_dir / "flat.pt"
        dcp_to_torch_save(ckpt, flat)
        saved = torch.load(flat, weights_only=False)
        adapters = saved["adapter"]
        optimizer = saved["optimizer"]
        report = {
            "step": step,
            "adapters_equal": sorted(full) == sorted(adapters)
            and all(torch.equal(full[n], adapters[n]) for n in adapters),
            "optimizer_equal": all(
                torch.equal(v, optimizer[f"{n}:{field}"])
                for n, fields in state.items()
                for field, v in fields.items()
            ),
            "optimizer_values": sum(len(f) for f in state.values()),
        }
        out.write_text(json.dumps(report))


def main(work: str, run_dir: str, out: str, mode: str) -> None:
    init_from_env()
    try:
        cfg = make_config(Path(work), *FSDP, f"train.max_steps={STEPS}")
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        {"train": train, "resume": resume}[mode](cfg, Path(run_dir), Path(out))
    finally:
        shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:])
