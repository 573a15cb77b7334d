"""``packline bench train``: training throughput with packing on and off, side by side in
one run on the default set, and the seconds each needs to reach the same eval loss.

Both runs train the same conversations per optimizer step (packing off lays them out
padded, ``train.unpacked_micro_batch_size`` per micro-batch), so their loss curves agree
step for step and the comparison is cost alone. They train in turns, a window of steps each
(:mod:`packline.bench.train`), so a load that comes and goes lands on both; throughput is
given per wall-clock second and per CPU-second, with its spread over the windows. With
``--noise`` a CPU-bound neighbour runs beside the second half and the ratio quiet and noisy
are compared. This module runs the stages before train and prints; the figures and the
targets (``speedup`` ≥ 2 with equal accuracy; with ``--noise`` the ratio within ±15 %) are
:class:`packline.report.summary.PackingComparison`'s and
:class:`packline.bench.train.Interleaved`'s.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from packline.progress import console, stdout_to_stderr
from packline.report.table import summary_table, target_lines
from packline.workdir import hold

WINDOW_STEPS = 2
"""Optimizer steps per window (the default of ``--window``)."""


def bench_train(
    *,
    as_json: bool = False,
    work_dir: str | Path | None = None,
    config: str | Path | None = None,
    overrides: list[str] | None = None,
    eval_every: int = 10,
    window_steps: int = WINDOW_STEPS,
    noise: bool = False,
) -> dict[str, Any]:
    """Train packing on and off from scratch on the default set (``config``, default
    ``configs/tiny_cpu.yaml``; work dir ``runs/bench``), in turns of ``window_steps``
    steps (``noise``: with a CPU-bound neighbour beside the second half), and print the
    comparison; returns :meth:`packline.bench.train.Interleaved.to_dict` (what ``--json``
    prints)."""
    from packline.bench.train import train_interleaved
    from packline.catalog import dataset_path, lengths_path, processor_dir
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
        out_dir = cfg.work_path / "bench-train"
        console.log(
            f"bench train: packing on and off from scratch, in turns of {window_steps} steps"
            + (", a CPU-bound neighbour beside the second half" if noise else "")
        )
        measured = train_interleaved(
            cfg,
            dataset_path=dataset_path(cfg),
            processor_dir=processor_dir(cfg),
            lengths_path=lengths_path(cfg),
            out_dir=out_dir,
            window_steps=window_steps,
            noise=noise,
        )
    result = measured.to_dict()
    if as_json:
        print(json.dumps(result, indent=2))
        return result
    from packline.progress import wide_console

    out = wide_console()
    out.print(
        summary_table(
            measured.pair.runs,
            title="bench train: packing on vs off, same conversations per step, in turns",
            source=f"from {out_dir}",
        )
    )
    if measured.noisy_from is not None:
        n = result["noise"]
        out.print(
            f"packed ÷ unpacked, median of the windows: quiet {n['quiet_wall']:.2f}x, with the "
            f"neighbour {n['noisy_wall']:.2f}x (× {n['noisy_over_quiet_wall']:.3f}); per "
            f"CPU-second quiet {n['quiet_cpu']:.2f}x, with it {n['noisy_cpu']:.2f}x "
            f"(× {n['noisy_over_quiet_cpu']:.3f})"
        )
    for line in target_lines(measured.targets()):
        out.print(line)
    return result
