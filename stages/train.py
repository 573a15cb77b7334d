"""Stage train (backend ``local``): Qwen3-VL LoRA with packing on and off, side by side.

Outputs in ``<work>/train/``::

    packed/ unpacked/           one run each: checkpoints/step_NNNNNN/, adapter/,
                                metrics.jsonl (per step), eval.jsonl (per evaluation),
                                pack_fill.png, config.yaml (resolved), result.json (the
                                run's packline.report.summary.RunSummary)
    comparison.json             both summaries and the speedup
    start_eval.json             the step-0 evaluation, kept for the run that starts second
                                from the same weights (packline.train.evaluate.EvalMemo)

The stage reads its inputs (the prepared dataset, connect's processor), hands each run to
:class:`packline.train.trainer.Trainer` (which owns the loop, resumes from the latest
complete checkpoint of the same config, evaluates and logs), then writes the run's outputs
and prints the one summary table. Every run is an MLflow child run of the stage.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import time
from pathlib import Path

from packline import metrics as names
from packline.catalog import lengths_path, read_forecast, train_run_dir
from packline.fingerprints import stage_fingerprint
from packline.progress import console
from packline.qwen.processor import load_processor
from packline.report.plots import plot_row_fill
from packline.report.summary import (
    COMPARISON,
    RunSummary,
    compare_metrics,
    comparison_record,
)
from packline.report.table import summary_table
from packline.tracking import Tracker
from packline.train.adapter import save_adapter
from packline.train.distributed import (
    barrier,
    init_from_env,
    launched,
    rank_device,
    rank_world,
    shutdown,
    threads_per_rank,
    torchrun_command,
)
from packline.train.evaluate import EvalMemo
from packline.train.records import read_records
from packline.train.setup import build_trainer
from packline.train.trainer import METRICS_LOG
from packline.workdir import claim_dir, mark_owned
from schemas.config import PipelineConfig, load_config
from stages.base import (
    StageResult,
    dataset_path,
    processor_dir,
    require_current,
    stage_dir,
    stage_result,
    write_record,
)

STAGE = "train"
RESULT = "result.json"
RUN_NAMES = ("packed", "unpacked")
"""The run dirs under ``<work>/train``: packing on, packing off."""
START_EVAL = "start_eval.json"


def _claim_stage_dir(out: Path) -> Path:
    """``<work>/train``, made or taken (a dir an earlier packline trained in, without the
    ownership marker, is known by its run dirs' fingerprints)."""
    if not out.is_symlink() and any((out / m / "fingerprint").is_file() for m in RUN_NAMES):
        mark_owned(out, STAGE)
    return claim_dir(out, STAGE)


def _claim_run_dir(run_dir: Path, fp: str) -> None:
    """Checkpoints resume only the run they belong to: a run dir left by another config
    (another fingerprint) is cleared instead of resumed."""
    marker = run_dir / "fingerprint"
    if marker.is_file() and not run_dir.is_symlink():  # a run dir packline made
        if marker.read_text() != fp:
            shutil.rmtree(run_dir)
        else:
            mark_owned(run_dir, "train run")
    claim_dir(run_dir, "train run")
    marker.write_text(fp)


def train_run(
    cfg: PipelineConfig, *, packed: bool, run_dir: Path, tracker: Tracker, fp: str
) -> RunSummary | None:
    """Train one run with the :class:`~packline.train.trainer.Trainer` (which resumes from
    checkpoints of the same config), then write its outputs. Under data parallelism every
    rank calls this; rank 0 writes and returns the summary (the others return None)."""
    rank, _ = rank_world()
    if rank == 0:
        _claim_run_dir(run_dir, fp)
    barrier()
    processor = load_processor(processor_dir(cfg))
    trainer = build_trainer(
        cfg,
        processor,
        packed=packed,
        dataset_path=dataset_path(cfg),
        processor_dir=processor_dir(cfg),
        lengths_path=lengths_path(cfg),
        run_dir=run_dir,
        device=rank_device(),
        tracker=tracker,
        eval_memo=EvalMemo(run_dir.parent / START_EVAL, key=fp),
    )
    tracker.set_tags(
        {
            names.TAG_PRECISION: trainer.precision,
            names.TAG_RANKS: str(trainer.world),
        }
    )
    tracker.log_params({f"ran.{k}": v for k, v in trainer.what_ran().items()})
    outcome = trainer.train()
    whole = trainer.whole_model()  # every rank: the adapters are gathered when split (EP, PP)
    if not trainer.lead:
        return None
    name = "packed" if packed else "unpacked"
    (run_dir / "config.yaml").write_text(cfg.to_yaml())  # the resolved config of this run
    tracker.log_artifact(run_dir / "config.yaml")
    steps = read_records(run_dir / METRICS_LOG)  # a resumed run re-logs replayed steps
    rows = [n for s in steps for n in s.get(names.RECORD_ROW_REAL_TOKENS, [])]
    tracker.log_artifact(
        plot_row_fill(rows, cfg.packing.seq_length, run_dir / "pack_fill.png", name)
    )
    summary = trainer.summary(outcome)
    # Under EP or PP too the adapter is the one-process PEFT adapter of the whole model.
    adapter = save_adapter(whole, run_dir / "adapter", cfg, summary, read_forecast(cfg), fp)
    tracker.log_artifact(adapter)
    return summary


def tracked_run_summary(
    cfg: PipelineConfig,
    *,
    packed: bool,
    run_dir: Path,
    fp: str,
    parent_run_id: str | None,
) -> RunSummary | None:
    """Train one run (packing on or off) under its MLflow child run (opened by rank 0 only)
    and return its :class:`RunSummary`: rank 0's, written to ``run_dir/result.json`` too;
    None on the other ranks of a launch."""
    name = "packed" if packed else "unpacked"
    rank, _ = rank_world()
    tracker = Tracker.disabled()
    if rank == 0:
        tracker = Tracker.start(
            cfg,
            f"train-{name}",
            parent_run_id=parent_run_id,
            tags={names.TAG_STAGE: STAGE, names.TAG_PACKING: str(packed).lower()},
        )
    try:
        result = train_run(cfg, packed=packed, run_dir=run_dir, tracker=tracker, fp=fp)
    except BaseException:
        tracker.end_failed()
        raise
    tracker.end()
    if result is not None:
        (run_dir / RESULT).write_text(json.dumps(result.to_dict(), indent=2))
    return result


def _launch_ranks(
    cfg: PipelineConfig,
    *,
    packed: bool,
    run_dir: Path,
    fp: str,
    parent_run_id: str | None,
) -> RunSummary:
    """Run :func:`tracked_run_summary` under torchrun with ``train.nproc_per_node`` ranks
    (each one :func:`main`) and read rank 0's summary."""
    nproc = cfg.train.nproc_per_node
    run_dir.mkdir(parents=True, exist_ok=True)
    config_path = run_dir.parent / f"{run_dir.name}.launch.yaml"
    config_path.write_text(cfg.to_yaml())
    (run_dir / RESULT).unlink(missing_ok=True)
    args = [str(config_path), "--mode", "packed" if packed else "unpacked", "--fp", fp]
    if parent_run_id:
        args += ["--parent-run-id", parent_run_id]
    cmd = torchrun_command(nproc, "stages.train", args)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads_per_rank(nproc))}
    par = cfg.train.parallel
    split = (
        f"PP {par.pipeline_parallel} × EP {par.expert_parallel}, "
        if not (par.pipeline_parallel == par.expert_parallel == 1)
        else ""
    )
    console.log(
        f"train {run_dir.name}: {nproc} ranks under torchrun ({split}"
        f"{nproc // par.pipeline_parallel} data-parallel)"
    )
    done = subprocess.run(cmd, env=env, check=False)
    if done.returncode != 0:
        raise RuntimeError(
            f"torchrun with {nproc} ranks failed (exit {done.returncode}) for the "
            f"{run_dir.name} run; see the rank logs above"
        )
    return RunSummary.from_dict(json.loads((run_dir / RESULT).read_text()))


def train(
    cfg: PipelineConfig, fp: str | None = None, *, parent_run_id: str | None = None
) -> StageResult:
    """Train packing on and off (or only the configured mode) and compare them. With
    ``train.nproc_per_node`` > 1 each run happens under torchrun; when this process is
    itself one rank of a launch (torchrun on SLURM), it joins the process group and trains
    as that rank. (``train.backend: megatron`` is :mod:`stages.train_megatron`'s: the runner
    picks the backend.) The runner has made sure validate passed these settings first."""
    t0 = time.perf_counter()
    fp = fp or stage_fingerprint(cfg, STAGE)
    require_current(cfg, "validate", by="train")
    out = _claim_stage_dir(stage_dir(cfg, STAGE))
    modes = [True, False] if cfg.train.compare_packing else [cfg.packing.enabled]
    runs = []
    if launched():
        init_from_env()
    if rank_world()[0] == 0:  # shared by this invocation's runs only (code may have changed)
        (out / START_EVAL).unlink(missing_ok=True)
    for packed in modes:
        run_dir = train_run_dir(cfg, packed)
        kwargs = {"packed": packed, "run_dir": run_dir, "fp": fp, "parent_run_id": parent_run_id}
        if cfg.train.nproc_per_node > 1 and not launched():
            runs.append(_launch_ranks(cfg, **kwargs))
        else:
            runs.append(tracked_run_summary(cfg, **kwargs))
    if any(r is None for r in runs):  # not rank 0 of a launch: rank 0 reports
        return stage_result(
            cfg.work_path,
            STAGE,
            fp,
            metrics={},
            summary={},
            t0=t0,
        )
    (out / COMPARISON).write_text(json.dumps(comparison_record(runs), indent=2))
    console.print(summary_table(runs, source=f"from {out}"))
    metrics = compare_metrics(runs)
    result = stage_result(
        cfg.work_path,
        STAGE,
        fp,
        metrics=metrics,
        summary={"artifacts": [str(out / COMPARISON)]},
        t0=t0,
    )
    write_record(result)
    return result


def main(argv: list[str] | None = None) -> int:
    """One rank of a train run under torchrun, started by :func:`_launch_ranks`: ``python -m
    stages.train CONFIG --mode packed|unpacked --fp FINGERPRINT [--parent-run-id ID]``.
    Rank 0 writes the run's ``result.json``."""
    p = argparse.ArgumentParser(prog="python -m stages.train")
    p.add_argument("config")
    p.add_argument("--mode", choices=RUN_NAMES, required=True)
    p.add_argument("--fp", required=True, help="fingerprint of the stage's inputs")
    p.add_argument("--parent-run-id", default=None)
    ns = p.parse_args(argv)
    cfg = load_config(ns.config, [])
    init_from_env()
    try:
        run_dir = train_run_dir(cfg, ns.mode == "packed")
        packed = ns.mode == "packed"
        tracked_run_summary(
            cfg, packed=packed, run_dir=run_dir, fp=ns.fp, parent_run_id=ns.parent_run_id
        )
    finally:
        shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
