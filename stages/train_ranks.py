"""One data-parallel rank of a train run: ``python -m stages.train_ranks CONFIG --mode
packed|unpacked --fp FINGERPRINT [--parent-run-id ID]``, started by torchrun from
:func:`stages.train._launch_ranks`. Rank 0 writes the run's ``result.json``."""

from __future__ import annotations

import argparse

from packline.train.distributed import init_from_env, shutdown
from schemas.config import load_config
from stages.base import stage_dir
from stages.train import tracked_run_summary


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m stages.train_ranks")
    p.add_argument("config")
    p.add_argument("--mode", choices=["packed", "unpacked"], required=True)
    p.add_argument("--fp", required=True, help="fingerprint of the stage's inputs")
    p.add_argument("--parent-run-id", default=None)
    ns = p.parse_args(argv)
    cfg = load_config(ns.config, [])
    init_from_env()
    try:
        packed = ns.mode == "packed"
        tracked_run_summary(
            cfg,
            packed=packed,
            run_dir=stage_dir(cfg, "train") / ns.mode,
            fp=ns.fp,
            parent_run_id=ns.parent_run_id,
        )
    finally:
        shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
