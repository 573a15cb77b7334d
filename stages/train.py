"""Stage train (backend ``local``): Qwen3-VL LoRA with packing on and off, side by side.

Outputs in ``<work>/train/``::

    packed/ unpacked/           one run each: checkpoints/step_NNNNNN/, adapter/,
                                metrics.jsonl (per step), eval.jsonl (per evaluation),
                                pack_fill.png, config.yaml (resolved), result.json
    comparison.json             real tokens/s, time to the same real tokens, loss, accuracy

Each run resumes from its latest complete checkpoint, so an interrupted stage picks up
where it stopped. Every run is an MLflow child run of the stage with per-step metrics.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import torch

from packline.counters import layout_metrics, row_fills
from packline.flops import mfu
from packline.progress import console, progress
from packline.qwen.processor import load_processor
from packline.tracking import Tracker
from packline.train.distributed import (
    init_from_env,
    launched,
    threads_per_rank,
    torchrun_command,
)
from packline.train.evaluate import chance_accuracy, eval_accuracy, eval_loss
from packline.train.loop import Trainer, barrier, dist_rank_world
from packline.train.records import append_record, drop_torn_tail, read_records
from packline.train.setup import build_trainer, run_paths
from schemas.config import PipelineConfig, TrainBackend
from stages.base import (
    InputError,
    StageResult,
    fingerprint,
    is_up_to_date,
    require_record,
    write_record,
)

STAGE = "train"


def fingerprint_inputs(cfg: PipelineConfig) -> str:
    from stages import connect

    sections = ["model", "lora", "train", "packing"]
    if cfg.train.backend == TrainBackend.megatron:
        sections.append("megatron")
    return fingerprint(connect.fingerprint_inputs(cfg), cfg.section_hash(*sections))


def _claim_run_dir(run_dir: Path, fp: str) -> None:
    """Checkpoints resume only the run they belong to: a run dir left by another config
    (another fingerprint) is cleared instead of resumed."""
    marker = run_dir / "fingerprint"
    if run_dir.exists() and (not marker.is_file() or marker.read_text() != fp):
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    marker.write_text(fp)


def train_run(
    cfg: PipelineConfig, *, packed: bool, run_dir: Path, tracker: Tracker, fp: str
) -> dict | None:
    """Train one run to ``train.max_steps`` (resuming if checkpoints of the same config
    exist); evaluate at the start, every ``train.eval_every`` steps and at the end. Under
    data parallelism every rank calls this; rank 0 evaluates, logs and returns the summary
    (the other ranks return None)."""
    rank, _ = dist_rank_world()
    if rank == 0:
        _claim_run_dir(run_dir, fp)
    barrier()
    dataset_dir, processor_dir = run_paths(cfg)
    processor = load_processor(processor_dir)
    device = train_device()
    trainer = build_trainer(cfg, processor, packed=packed, run_dir=run_dir, device=device)
    model, settings = trainer.model, trainer.s
    start = trainer.resume()
    log = run_dir / "metrics.jsonl"
    name = "packed" if packed else "unpacked"
    lead = rank == 0
    if lead:  # a kill in the middle of a record left a fragment: the next starts clean
        for torn in (log, run_dir / "eval.jsonl"):
            drop_torn_tail(torn)

    def evaluate(step: int) -> dict:
        """Rank 0 evaluates (and gets the metrics and the per-kind accuracy); the others
        wait for it."""
        metrics: dict = {}
        if lead:
            loss, _ = eval_loss(
                model,
                dataset_dir,
                processor_dir,
                settings.packing,
                buffer=settings.packing_buffer_size,
                image_token_id=trainer.image_token_id,
            )
            acc, asked, by_kind = eval_accuracy(
                model, processor, dataset_dir, max_samples=cfg.train.eval_samples
            )
            metrics = {"eval/loss": loss, "eval/accuracy": acc, "eval/questions": float(asked)}
            tracker.log_metrics(metrics, step=step)
            metrics["by_kind"] = by_kind
            append_record(run_dir / "eval.jsonl", {"step": step, **metrics})
        barrier()
        return metrics

    device_name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    chance, chance_by_kind = float("nan"), {}
    if lead and cfg.train.eval_samples:
        chance, chance_by_kind = chance_accuracy(dataset_dir, max_samples=cfg.train.eval_samples)
        tracker.log_metrics({"eval/accuracy_chance": chance}, step=start)
    first_eval = evaluate(start) if start == 0 else {}
    every = cfg.train.eval_every
    with progress(disable=not lead) as bar:
        task = bar.add_task(f"train {name}", total=settings.max_steps, completed=start)
        while trainer.step < settings.max_steps:
            r = trainer.train_step()
            metrics = _step_metrics(r, trainer, device_name)
            if lead:
                tracker.log_metrics(metrics, step=r.step)
                # One value per laid-out row (the pack-fill histogram of `packline
                # compare`); its step is the row's index in the run, resume-exact.
                total = trainer.counters.total
                laid_out = total.rows  # packed rows, or padded rows (one per conversation)
                tracker.log_series(
                    "pack/row_fill",
                    row_fills(r.row_real_tokens, settings.packing.seq_length),
                    first_step=laid_out - len(r.row_real_tokens) + 1,
                )
                record = {"step": r.step, **metrics, "keys": r.keys}
                record["row_real_tokens"] = r.row_real_tokens
                if trainer.world > 1:
                    record["keys_by_rank"] = r.keys_by_rank
                    record["weights_checksums"] = r.weights_checksums
                append_record(log, record)
            bar.update(task, completed=r.step, description=f"train {name} loss {r.loss:.3f}")
            if settings.save_every and r.step % settings.save_every == 0:
                trainer.save_checkpoint()
            if every and r.step % every == 0 and r.step < settings.max_steps:
                evaluate(r.step)
    if trainer.step % max(settings.save_every, 1):
        trainer.save_checkpoint()
    final_eval = evaluate(trainer.step)
    if not lead:
        return None
    # The LM head, when adapted, stays frozen: save the adapters alone, not its base weights.
    model.save_pretrained(run_dir / "adapter", save_embedding_layers=False)
    tracker.log_artifact(run_dir / "adapter")
    (run_dir / "config.yaml").write_text(cfg.to_yaml())  # the resolved config of this run
    tracker.log_artifact(run_dir / "config.yaml")
    steps = read_records(log)  # a resumed run re-logs the replayed steps; the last wins
    fill_plot = _plot_row_fill(steps, cfg.packing.seq_length, run_dir / "pack_fill.png", name)
    tracker.log_artifact(fill_plot)
    real = sum(s["train/tokens_real"] for s in steps)
    wall = sum(s["train/step_seconds"] for s in steps)
    total = trainer.counters.total
    return {
        "run": name,
        "steps": trainer.step,
        "ranks": trainer.world,
        "precision": "bf16" if trainer.bf16 else "fp32",  # what train.precision resolved to
        "real_tokens": real,
        "seconds": wall,
        "real_tokens_per_s": real / wall if wall else 0.0,
        "final_train_loss": steps[-1]["train/loss"],
        "eval_loss_start": first_eval.get("eval/loss"),
        "eval_loss": final_eval["eval/loss"],
        "eval_accuracy_start": first_eval.get("eval/accuracy"),
        "eval_accuracy": final_eval["eval/accuracy"],
        "eval_accuracy_chance": chance,
        # per question kind (count, colour, ...): which answers were learned, against chance
        "eval_by_kind": {
            kind: {**v, "chance": chance_by_kind.get(kind)}
            for kind, v in final_eval["by_kind"].items()
        },
        "tflops_useful": total.flops_useful / 1e12,
        "tflops_executed": total.flops_executed / 1e12,
        "padded_tokens": total.padded_tokens,
        # of `seconds`: the same work whatever the layout (rank 0)
        "data_seconds": sum(s.get("train/data_seconds", 0.0) for s in steps),
        "vision_seconds": sum(s.get("train/vision_seconds", 0.0) for s in steps),
    }


def _step_metrics(r, trainer: Trainer, device_name: str) -> dict[str, float]:
    """MLflow metrics of one optimizer step (counts summed over ranks)."""
    c = trainer.counters.total
    metrics = {
        "train/loss": r.loss,
        "train/lr": r.lr,
        "train/grad_norm": r.grad_norm,
        "train/step_seconds": r.seconds,
        "train/data_seconds": r.data_seconds,
        "train/vision_seconds": r.vision_seconds,
        **r.counts.to_metrics("train"),
        **{k.replace("train/", "train/cum_"): v for k, v in c.to_metrics("train").items()},
        "throughput/real_tokens_per_s": r.counts.tokens_real / r.seconds,
        "flops/tflops_per_s": r.counts.flops_useful / r.seconds / 1e12,
        "train/tokens_real_rank_spread": float(max(r.rank_real_tokens) - min(r.rank_real_tokens)),
        "flops/useful_rank_spread": float(max(r.rank_flops) - min(r.rank_flops)),
        **trainer.ledger_metrics(),
    }
    metrics.update(
        layout_metrics(
            r.row_real_tokens,
            conversations=r.counts.conversations,
            padded_tokens=r.counts.padded_tokens,
            seq_length=trainer.s.packing.seq_length,
        )
    )
    util = mfu(r.counts.flops_useful / r.seconds / trainer.world, device_name)
    if util is not None:  # a GPU with a known peak; on CPU: TFLOP/s only
        metrics["flops/mfu"] = util
    return metrics


def _plot_row_fill(steps: list[dict], seq_length: int, path: Path, name: str) -> Path:
    """Histogram of real tokens / seq_length over the rows the run laid out: packed rows,
    or one per conversation when packing is off."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fills = [n / seq_length for s in steps for n in s.get("row_real_tokens", [])]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.hist(fills, bins=20, range=(0, 1), color="#4c72b0")
    mean = sum(fills) / len(fills) if fills else 0.0
    ax.set_title(f"{name}: fill of {len(fills)} rows (mean {mean:.3f})")
    ax.set_xlabel("real tokens / seq_length")
    ax.set_ylabel("rows")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def train_device() -> torch.device:
    """This rank's GPU when there is one, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def train_mode(
    cfg: PipelineConfig,
    *,
    packed: bool,
    run_dir: Path,
    fp: str,
    parent_run_id: str | None,
) -> dict | None:
    """One training run with its MLflow child run (opened by rank 0 only)."""
    name = "packed" if packed else "unpacked"
    rank, _ = dist_rank_world()
    tracker = Tracker.disabled()
    if rank == 0:
        tracker = Tracker.start(
            cfg,
            f"train-{name}",
            parent_run_id=parent_run_id,
            tags={"packline.stage": STAGE, "packline.packing": str(packed).lower()},
        )
    try:
        result = train_run(cfg, packed=packed, run_dir=run_dir, tracker=tracker, fp=fp)
    except BaseException:
        tracker.end("FAILED")
        raise
    tracker.end()
    if result is not None:
        (run_dir / "result.json").write_text(json.dumps(result, indent=2))
    return result


def _launch_ranks(
    cfg: PipelineConfig,
    *,
    packed: bool,
    run_dir: Path,
    fp: str,
    parent_run_id: str | None,
) -> dict:
    """Run :func:`train_mode` under torchrun with ``train.nproc_per_node`` ranks and read
    rank 0's summary."""
    nproc = cfg.train.nproc_per_node
    run_dir.mkdir(parents=True, exist_ok=True)
    config_path = run_dir.parent / f"{run_dir.name}.launch.yaml"
    config_path.write_text(cfg.to_yaml())
    (run_dir / "result.json").unlink(missing_ok=True)
    args = [str(config_path), "--mode", "packed" if packed else "unpacked", "--fp", fp]
    if parent_run_id:
        args += ["--parent-run-id", parent_run_id]
    cmd = torchrun_command(nproc, "stages.train_ranks", args)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads_per_rank(nproc))}
    console.log(f"train {run_dir.name}: {nproc} data-parallel ranks under torchrun")
    done = subprocess.run(cmd, env=env, check=False)
    if done.returncode != 0:
        raise RuntimeError(
            f"torchrun with {nproc} ranks failed (exit {done.returncode}) for the "
            f"{run_dir.name} run; see the rank logs above"
        )
    return json.loads((run_dir / "result.json").read_text())


def ensure_validated(cfg: PipelineConfig) -> None:
    """Train only on settings validate has passed. A validate record of other settings
    (``packline stage train key=value`` after a run) is renewed first: validate's errors
    stop the stage. Ranks of an outside launch (torchrun on SLURM) cannot validate in
    parallel, so there a stale record is an error; the pipeline's validate job renews it."""
    from stages import validate

    require_record(cfg, "validate", by="train")  # validate requires connect in turn
    if is_up_to_date(cfg, "validate", validate.fingerprint_inputs(cfg)):
        return
    if launched():
        raise InputError(
            [
                f"validate's record in {cfg.work_path} is for other settings "
                "(run `packline stage validate` with these settings first)"
            ],
            "train cannot start",
        )
    console.log("[yellow]validate: its record is for other settings; validating these[/]")
    validate.validate_config(cfg)


def train_lora(
    cfg: PipelineConfig, fp: str | None = None, *, parent_run_id: str | None = None
) -> StageResult:
    """Train packing on and off (or only the configured mode) and compare them. With
    ``train.nproc_per_node`` > 1 each run happens under torchrun; when this process is
    itself one rank of a launch (torchrun on SLURM), it joins the process group and trains
    as that rank. With ``train.backend: megatron`` run the Megatron-Bridge finetune instead
    (cluster only)."""
    t0 = time.perf_counter()
    fp = fp or fingerprint_inputs(cfg)
    ensure_validated(cfg)
    if cfg.train.backend == TrainBackend.megatron:
        from stages.train_megatron import train_megatron

        return train_megatron(cfg, fp, parent_run_id=parent_run_id)
    out = cfg.work_path / STAGE
    modes = [True, False] if cfg.train.compare_packing else [cfg.packing.enabled]
    runs = []
    if launched():
        init_from_env()
    for packed in modes:
        run_dir = out / ("packed" if packed else "unpacked")
        kwargs = {"packed": packed, "run_dir": run_dir, "fp": fp, "parent_run_id": parent_run_id}
        if cfg.train.nproc_per_node > 1 and not launched():
            runs.append(_launch_ranks(cfg, **kwargs))
        else:
            runs.append(train_mode(cfg, **kwargs))
    if any(r is None for r in runs):  # not rank 0 of a launch: rank 0 reports
        return StageResult(
            stage=STAGE,
            out_dir=out,
            fingerprint=fp,
            skipped=False,
            metrics={},
            summary={},
            seconds=time.perf_counter() - t0,
        )
    comparison = {"runs": runs}
    if len(runs) == 2:
        on, off = runs
        comparison["speedup_real_tokens_per_s"] = on["real_tokens_per_s"] / off["real_tokens_per_s"]
    (out / "comparison.json").write_text(json.dumps(comparison, indent=2))
    _print_comparison(runs)
    metrics = {}
    for r in runs:
        for k in ("real_tokens_per_s", "eval_loss", "eval_accuracy", "final_train_loss", "seconds"):
            metrics[f"compare/{r['run']}_{k}"] = float(r[k])
    if "speedup_real_tokens_per_s" in comparison:
        metrics["compare/speedup_real_tokens_per_s"] = comparison["speedup_real_tokens_per_s"]
    result = StageResult(
        stage=STAGE,
        out_dir=out,
        fingerprint=fp,
        skipped=False,
        metrics=metrics,
        summary={"artifacts": [str(out / "comparison.json")]},
        seconds=time.perf_counter() - t0,
    )
    write_record(cfg, result)
    return result


def _print_comparison(runs: list[dict]) -> None:
    """One column per run, one row per figure (fits a narrow log)."""
    from rich.table import Table

    title = (
        "packing on vs off (same conversations per optimizer step)"
        if len(runs) == 2
        else f"train run {runs[0]['run']}"
    )
    table = Table(title=title)
    table.add_column("")
    for r in runs:
        table.add_column(r["run"], justify="right")

    def accuracy(r: dict) -> str:
        start = r["eval_accuracy_start"]
        end = f"{r['eval_accuracy']:.2f}"
        return f"{start:.2f} → {end}" if start is not None else end

    rows = (
        ("real tokens/s", lambda r: f"{r['real_tokens_per_s']:,.0f}"),
        ("train seconds (same real tokens)", lambda r: f"{r['seconds']:.1f}"),
        ("  of them data (same work)", lambda r: f"{r['data_seconds']:.1f}"),
        (
            "  of them vision tower (same work)",
            lambda r: f"{r['vision_seconds']:.1f}",
        ),
        ("final train loss", lambda r: f"{r['final_train_loss']:.3f}"),
        ("eval loss", lambda r: f"{r['eval_loss']:.3f}"),
        ("eval accuracy (start → end)", accuracy),
        ("accuracy by chance", lambda r: f"{r['eval_accuracy_chance']:.2f}"),
    )
    for label, value in rows:
        table.add_row(label, *(value(r) for r in runs))
    if len(runs) == 2:
        table.caption = (
            f"speedup {runs[0]['real_tokens_per_s'] / runs[1]['real_tokens_per_s']:.2f}x "
            f"({runs[0]['run']} / {runs[1]['run']} real tokens/s)"
        )
    console.print(table)
