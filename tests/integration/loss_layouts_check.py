"""``train.loss: sample`` on every local layout of one torchrun launch: one optimizer step's
loss, packing on and off, against each conversation run alone on one process.

Run by ``tests/integration/test_parallel_train.py`` as ``python -m torch.distributed.run
--standalone --nproc-per-node=2 -m tests.integration.loss_layouts_check WORK OUT.json``
(``WORK``: the tiny MoE's prepared and connected set); rank 0 writes, per layout, the
trainer's loss packed (and unpacked where the layout trains padded rows: not under PP), the
conversations of the step, and the reference: the mean over the step's conversations (every
rank's) of each one's mean token loss, each run alone through the whole model on rank 0.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from packline.packing.thd import build_padded_batch
from packline.qwen.forward import padded_forward, token_loss_sum
from packline.train.distributed import all_gather_object, barrier, init_from_env, shutdown
from tests.conftest import make_config
from tests.integration.train_helpers import trainer_for

#: the layouts of a 2-rank launch and their settings (the tiny MoE, fixed-width rows)
LAYOUTS = {
    "dp2": [],
    "fsdp2": ["train.parallel.fsdp=true"],
    "ep2": ["train.parallel.expert_parallel=2"],
    "pp2": ["train.parallel.pipeline_parallel=2", "train.parallel.schedule=1f1b"],
}


def _reference(model, rows, image_token_id: int, video_token_id: int) -> dict:
    """Each conversation of ``rows`` alone: its mean token loss; their mean (sample) and
    Σ loss ÷ Σ targets (token)."""
    means, total, targets = [], 0.0, 0
    with torch.no_grad():
        for row in rows:
            for conv in row.conversations():
                alone = build_padded_batch([conv])
                logits = padded_forward(
                    model, alone, image_token_id=image_token_id, video_token_id=video_token_id
                )
                s, n = token_loss_sum(logits, alone.labels)
                if n:
                    means.append(float(s) / n)
                    total, targets = total + float(s), targets + n
    sample = sum(means) / len(means)
    return {"sample": sample, "token": total / targets, "conversations": len(means)}


def main(work: str, out: str, *moe: str) -> None:
    init_from_env()
    results = {}
    try:
        for name, settings in LAYOUTS.items():
            cfg = make_config(Path(work), *moe, "train.loss=sample", *settings)
            run = Path(work) / f"loss-{name}"
            packed = trainer_for(cfg, True, run / "packed")
            rows = packed.step_rows()
            loss_p, _ = packed.accumulate_gradients(packed.micro_batches(rows))
            result = {"loss_packed": loss_p, "rows": len(rows)}
            if cfg.train.parallel.pipeline_parallel == 1:
                unpacked = trainer_for(cfg, False, run / "unpacked")
                result["loss_unpacked"] = unpacked.accumulate_gradients(
                    unpacked.micro_batches(rows)
                )[0]
            whole = packed.whole_model()  # every rank; rank 0 gets the one-process model
            every = all_gather_object(rows)
            if packed.rank == 0:
                unique = {tuple(r.keys): r for rank_rows in every for r in rank_rows}
                proc = packed.engine
                result.update(
                    reference=_reference(
                        whole, list(unique.values()), proc.image_token_id, proc.video_token_id
                    ),
                    conversations_per_row=[r.num_conversations for r in unique.values()],
                )
                results[name] = result
            barrier()
        if results:
            Path(out).write_text(json.dumps(results, indent=1))
    finally:
        shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:])
