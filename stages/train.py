"""Stage train (backend ``local``): Qwen3-VL LoRA with packing on and off, side by side.

Outputs in ``<work>/train/``::

    packed/ unpacked/           one run each: checkpoints/step_NNNNNN/, adapter/, metrics.jsonl
    comparison.json             real tokens/s, time to the same real tokens, loss, accuracy

Each run resumes from its latest complete checkpoint, so an interrupted stage picks up
where it stopped. Every run is an MLflow child run of the stage with per-step metrics.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import torch

from packline.counters import flops_model_for
from packline.flops import mfu
from packline.progress import console, progress
from packline.qwen.processor import load_processor
from packline.tracking import Tracker
from packline.train.evaluate import eval_accuracy, eval_loss
from packline.train.loop import Trainer
from packline.train.setup import apply_lora, build_model, loop_settings, run_paths
from schemas.config import PipelineConfig
from stages.base import StageResult, fingerprint, require_record, write_record

STAGE = "train"


def fingerprint_inputs(cfg: PipelineConfig) -> str:
    from stages import connect

    return fingerprint(
        connect.fingerprint_inputs(cfg), cfg.section_hash("model", "lora", "train", "packing")
    )


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
) -> dict:
    """Train one run to ``train.max_steps`` (resuming if checkpoints of the same config
    exist); evaluate at the start and the end."""
    _claim_run_dir(run_dir, fp)
    dataset_dir, processor_dir = run_paths(cfg)
    processor = load_processor(processor_dir)
    torch.manual_seed(cfg.train.seed)
    model = apply_lora(build_model(cfg, processor), cfg.lora)
    settings = loop_settings(cfg, packed=packed)
    trainer = Trainer(
        model,
        settings=settings,
        dataset_dir=dataset_dir,
        processor_dir=processor_dir,
        run_dir=run_dir,
        flops_model=flops_model_for(cfg, processor),
        image_token_id=int(processor.image_token_id),
        pad_token_id=int(processor.tokenizer.pad_token_id),
    )
    start = trainer.resume()
    log = run_dir / "metrics.jsonl"
    run_dir.mkdir(parents=True, exist_ok=True)
    name = "packed" if packed else "unpacked"

    def evaluate(step: int) -> dict[str, float]:
        loss, _ = eval_loss(
            model,
            dataset_dir,
            processor_dir,
            settings.packing,
            buffer=settings.packing_buffer_size,
            image_token_id=trainer.image_token_id,
        )
        acc, asked = eval_accuracy(
            model, processor, dataset_dir, max_samples=cfg.train.eval_samples
        )
        metrics = {"eval/loss": loss, "eval/accuracy": acc, "eval/questions": float(asked)}
        tracker.log_metrics(metrics, step=step)
        return metrics

    device_name = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    first_eval = evaluate(start) if start == 0 else {}
    seconds = 0.0
    with progress() as bar:
        task = bar.add_task(f"train {name}", total=settings.max_steps, completed=start)
        while trainer.step < settings.max_steps:
            r = trainer.train_step()
            seconds += r.seconds
            c = trainer.counters.total
            metrics = {
                "train/loss": r.loss,
                "train/lr": r.lr,
                "train/grad_norm": r.grad_norm,
                "train/step_seconds": r.seconds,
                **r.counts.to_metrics("train"),
                **{k.replace("train/", "train/cum_"): v for k, v in c.to_metrics("train").items()},
                "throughput/real_tokens_per_s": r.counts.real_tokens / r.seconds,
                "flops/tflops_per_s": r.counts.flops_useful / r.seconds / 1e12,
                "train/real_tokens_rank_spread": float(
                    max(r.rank_real_tokens) - min(r.rank_real_tokens)
                ),
                **trainer.ledger.to_metrics(),
            }
            util = mfu(r.counts.flops_useful / r.seconds / trainer.world, device_name)
            if util is not None:  # a GPU with a known peak; on CPU: TFLOP/s only
                metrics["flops/mfu"] = util
            tracker.log_metrics(metrics, step=r.step)
            with log.open("a") as f:
                f.write(json.dumps({"step": r.step, **metrics, "keys": r.keys}) + "\n")
            bar.update(task, completed=r.step, description=f"train {name} loss {r.loss:.3f}")
            if settings.save_every and r.step % settings.save_every == 0:
                trainer.save_checkpoint()
    if trainer.step % max(settings.save_every, 1):
        trainer.save_checkpoint()
    final_eval = evaluate(trainer.step)
    model.save_pretrained(run_dir / "adapter")
    tracker.log_artifact(run_dir / "adapter")
    by_step = {}
    for line in log.read_text().splitlines():  # a resumed run re-logs the replayed steps
        rec = json.loads(line)
        by_step[rec["step"]] = rec
    steps = [by_step[k] for k in sorted(by_step)]
    real = sum(s["train/real_tokens"] for s in steps)
    wall = sum(s["train/step_seconds"] for s in steps)
    return {
        "run": name,
        "steps": trainer.step,
        "real_tokens": real,
        "seconds": wall,
        "real_tokens_per_s": real / wall if wall else 0.0,
        "final_train_loss": steps[-1]["train/loss"],
        "eval_loss_start": first_eval.get("eval/loss"),
        "eval_loss": final_eval["eval/loss"],
        "eval_accuracy_start": first_eval.get("eval/accuracy"),
        "eval_accuracy": final_eval["eval/accuracy"],
        "tflops_useful": trainer.counters.total.flops_useful / 1e12,
        "padded_tokens": trainer.counters.total.padded_tokens,
    }


def train_lora(
    cfg: PipelineConfig, fp: str | None = None, *, parent_run_id: str | None = None
) -> StageResult:
    """Train packing on and off (or only the configured mode) and compare them."""
    t0 = time.perf_counter()
    fp = fp or fingerprint_inputs(cfg)
    require_record(cfg, "validate", by="train")  # validate requires connect in turn
    out = cfg.work_path / STAGE
    modes = [True, False] if cfg.train.compare_packing else [cfg.packing.enabled]
    runs = []
    for packed in modes:
        name = "packed" if packed else "unpacked"
        tracker = Tracker.start(
            cfg,
            f"train-{name}",
            parent_run_id=parent_run_id,
            tags={"packline.stage": STAGE, "packline.packing": str(packed).lower()},
        )
        try:
            runs.append(train_run(cfg, packed=packed, run_dir=out / name, tracker=tracker, fp=fp))
        except BaseException:
            tracker.end("FAILED")
            raise
        tracker.end()
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
    from rich.table import Table

    table = Table(title="packing on vs off (same conversations per optimizer step)")
    for col in ("run", "real tok/s", "seconds", "train loss", "eval loss", "eval acc (start→end)"):
        table.add_column(col, justify="right")
    for r in runs:
        start = r["eval_accuracy_start"]
        acc = (
            f"{start:.2f}→{r['eval_accuracy']:.2f}"
            if start is not None
            else f"{r['eval_accuracy']:.2f}"
        )
        table.add_row(
            r["run"],
            f"{r['real_tokens_per_s']:.0f}",
            f"{r['seconds']:.1f}",
            f"{r['final_train_loss']:.3f}",
            f"{r['eval_loss']:.3f}",
            acc,
        )
    console.print(table)
