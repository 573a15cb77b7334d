"""``packline bench train``: training throughput with packing on and off, side by side in
one run on the default set, and the seconds each needs to reach the same eval loss.

Both runs train the same conversations per optimizer step (packing off lays them out
padded, ``train.unpacked_micro_batch_size`` per micro-batch), so their loss curves agree
step for step and the comparison is cost alone. This module runs the stages and prints;
the figures (speedup, with the data wait and the vision tower taken out, executed FLOPs
ratio, seconds to the same eval loss) and the target (``speedup`` ≥ 2 with equal
accuracy) are :class:`packline.report.summary.PackingComparison`'s.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from packline.progress import console, stdout_to_stderr
from packline.report.summary import PackingComparison, RunSummary
from packline.report.table import summary_table, target_lines
from packline.workdir import hold, remove_owned


def read_summary(run_dir: Path) -> RunSummary:
    """The summary the train stage wrote for one finished run (its ``result.json``)."""
    return RunSummary.from_dict(json.loads((run_dir / "result.json").read_text()))


def bench_train(
    *,
    as_json: bool = False,
    work_dir: str | Path | None = None,
    config: str | Path | None = None,
    overrides: list[str] | None = None,
    eval_every: int = 10,
) -> dict[str, Any]:
    """Train packing on and off from scratch on the default set (``config``, default
    ``configs/tiny_cpu.yaml``; work dir ``runs/bench``) and print the comparison; returns
    :meth:`PackingComparison.side_by_side` (what ``--json`` prints)."""
    from packline.catalog import stage_dir
    from schemas.config import load_config
    from stages.runner import available_stages, run_stage

    work_dir = Path(work_dir) if work_dir is not None else Path("runs") / "bench"
    cfg = load_config(
        config,
        [
            *(overrides or []),
            f"work_dir={work_dir}",
            "mlflow.enabled=false",
            "train.compare_packing=true",
            f"train.eval_every={eval_every}",
        ],
    )
    # --json: stdout holds the JSON object only
    with stdout_to_stderr(as_json), hold(cfg.work_path):
        for stage in available_stages():  # the inputs of train, skipped when up to date
            if stage != "train":
                run_stage(cfg, stage)
        remove_owned(stage_dir(cfg, "train"))  # from scratch, no resume
        console.log("bench train: packing on, then off, from scratch")
        run_stage(cfg, "train", force=True)
    train_dir = stage_dir(cfg, "train")
    pair = PackingComparison(
        packed=read_summary(train_dir / "packed"),
        unpacked=read_summary(train_dir / "unpacked"),
    )
    result = pair.side_by_side()
    if as_json:
        print(json.dumps(result, indent=2))
    else:
        from packline.progress import wide_console

        out = wide_console()
        out.print(
            summary_table(
                pair.runs,
                title="bench train: packing on vs off, same conversations per step",
                source=f"from {train_dir}",
            )
        )
        for line in target_lines(pair):
            out.print(line)
    return result
