"""One optimizer step's gradients, packing on and off, on every rank of a torchrun launch.

Run by ``tests/integration/test_train_ddp.py`` as
``python -m torch.distributed.run --standalone --nproc-per-node=2 -m
tests.integration.ddp_step_check WORK OUT.json``; rank 0 writes the comparison.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from packline.train.distributed import all_gather_object, init_from_env, shutdown
from tests.conftest import make_config
from tests.integration.train_helpers import SMALL, trainer_for


def main(work: str, out: str) -> None:
    init_from_env()
    try:
        cfg = make_config(Path(work), *SMALL, "train.global_batch_size=4")
        packed = trainer_for(cfg, True, Path(work) / "ddp_p")
        unpacked = trainer_for(cfg, False, Path(work) / "ddp_u")
        rows = packed.step_rows()
        loss_p, n_p = packed.accumulate_gradients(packed.micro_batches(rows))
        micro_u = unpacked.micro_batches(rows)
        loss_u, n_u = unpacked.accumulate_gradients(micro_u)
        gp = torch.cat([p.grad.flatten() for p in packed.params]).double()
        gu = torch.cat([p.grad.flatten() for p in unpacked.params]).double()
        keys = all_gather_object([k for row in rows for k in row.keys])
        grads_p = all_gather_object(gp)
        if packed.rank == 0:
            result = {
                "world": packed.world,
                "loss_packed": loss_p,
                "loss_unpacked": loss_u,
                "targets_packed": n_p,
                "targets_unpacked": n_u,
                "cosine": torch.nn.functional.cosine_similarity(gp, gu, dim=0).item(),
                "keys_by_rank": keys,
                "conversations_per_row": [r.num_conversations for r in rows],
                "padded_tokens_unpacked": sum(m.num_padded_tokens for m in micro_u),
                "grads_equal_across_ranks": all(torch.equal(grads_p[0], g) for g in grads_p),
            }
            Path(out).write_text(json.dumps(result))
    finally:
        shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:])
