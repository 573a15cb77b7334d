"""Stage connect: the processor meets the data — exact token lengths of every sample.

Outputs in ``<work>/connect/``::

    processor/              the processor dir every later stage loads (tiny one built here,
                            or a copy of ``processor.path``)
    lengths.parquet         key, split, text/image/total/loss tokens, images (exact), FLOPs alone
    forecast.json           packing fill per buffer size and the lower bound
    length_histogram.png    distribution of conversation lengths vs seq_length
    bridge_videos.json      train.backend megatron with videos: what Bridge's encoder makes of
                            them (frames kept, re-sampled, its timestamps against the real
                            ones), the figures validate warns with

Every sample is read once, through Energon's loader over :func:`stages.base.dataset_path`.
The cheap rule (image size from the file header → the resize rule → visual tokens, plus
tokenized text) measures every sample; the real processor measures every sample too
(``connect.verify: all``, the default) or a seeded sample of N (``connect.verify: N``), and
must agree with the cheap rule wherever it ran: the packer's large buffers rely on it being
exact. Any mismatch fails the stage and is listed. A sample the processor did not measure
gets the cheap rule's record (the same columns), and the record says which was done.

The work spreads over ``connect.num_tasks`` tasks (SLURM) and each task's
``connect.num_workers`` loader workers: task r of N measures Energon's rank-r share and
writes it in parts that a killed connect resumes from; the task that finishes last merges
the parts into the stage dir (:mod:`packline.energon.parts`). The table is the same for any
task and worker count.
"""

from __future__ import annotations

import json
import shutil
import time
from typing import Any

import pandas as pd

from packline.backends import backend
from packline.catalog import BRIDGE_VIDEOS, FORECAST_FILE, manifest_path
from packline.energon.measure import (
    Measuring,
    VisualRule,
    bridge_video_metrics,
    bridge_video_summary,
    lengths_table,
    measure_share,
    verify_keys,
    verify_line,
)
from packline.energon.parts import (
    PartsDir,
    Task,
    attempt_id,
    current_task,
)
from packline.fingerprints import stage_fingerprint
from packline.forecast import config_forecast, sample_costs
from packline.progress import console
from packline.qwen.processor import materialize_processor
from packline.report.plots import plot_length_histogram
from schemas.choices import ExecutorKind
from schemas.config import PipelineConfig
from schemas.errors import UserError
from schemas.tables import SPLITS, LengthsModel, validate_table
from stages.base import (
    PROCESSOR,
    StageResult,
    building,
    dataset_path,
    is_up_to_date,
    processor_dir,
    require_record,
    stage_dir,
    stage_result,
    write_record,
)

STAGE = "connect"


def bridge_max_num_frames(cfg: PipelineConfig) -> int:
    """The ``max_num_frames`` Bridge's encoder gets (see
    :func:`packline.megatron.overrides.max_num_frames`)."""
    from packline.megatron.overrides import max_num_frames

    return max_num_frames(cfg)


def this_task(cfg: PipelineConfig) -> Task | None:
    """This process's connect task in a SLURM job step of ``connect.num_tasks`` tasks (see
    :func:`packline.energon.parts.current_task`); None when it measures every share."""
    return current_task(cfg.connect.num_tasks, slurm=cfg.executor.kind is ExecutorKind.slurm)


def connect(
    cfg: PipelineConfig,
    fp: str | None = None,
    *,
    visual_tokens: VisualRule | None = None,
    task: tuple[int, int] | None = None,
) -> StageResult:
    """Measure every sample with the cheap rule and (``connect.verify``) the real processor,
    check that they agree, and publish the lengths, the forecast and the record.

    ``task=(r, N)`` measures only task r's share of N (``N`` must be ``connect.num_tasks``);
    without it, a task of a SLURM job step measures its own (:func:`this_task`), and a
    process on its own measures every task's share in turn. Whichever task finishes last
    merges the parts and returns the stage's result; any other returns a ``partial`` result
    (its share is measured; no record, nothing to log). A killed run resumes from its
    finished parts. ``visual_tokens`` replaces the cheap rule's image-token rule (tests).
    """
    t0 = time.perf_counter()
    fp = fp or stage_fingerprint(cfg, STAGE)
    require_record(cfg.work_path, "prepare", by="connect")
    if task is None:
        task = this_task(cfg)
    if task is not None:
        task = Task(*task)
        if task.world != cfg.connect.num_tasks or not 0 <= task.rank < task.world:
            raise ValueError(
                f"connect task {task.rank} of {task.world}: connect.num_tasks is "
                f"{cfg.connect.num_tasks}, the task must be one of them"
            )
        if is_up_to_date(cfg.work_path, STAGE, fp):  # a task that starts after another one merged
            return _task_result(cfg, fp, {"rank": task.rank, "world": task.world}, t0)
    manifest = pd.read_parquet(manifest_path(cfg))
    parts = PartsDir(cfg, fp)
    bridge = backend(cfg).renders_for_bridge
    measuring = Measuring(
        dataset=dataset_path(cfg),
        processor=parts.materialize(
            lambda out: materialize_processor(cfg, out / PROCESSOR, for_bridge=bridge)
        ),
        splits=tuple(split for split in SPLITS if (manifest["split"] == split).any()),
        num_workers=cfg.connect.num_workers,
        part_size=cfg.connect.part_size,
        verify_keys=verify_keys(
            list(manifest["key"]), cfg.connect.verify_samples, seed=cfg.train.seed
        ),
        visual_tokens=visual_tokens,
        bridge=bridge,
        max_num_frames=bridge_max_num_frames(cfg) if bridge else None,
    )
    attempt = attempt_id()
    info: dict[str, Any] = {}
    for rank in range(parts.world) if task is None else [task.rank]:
        info = measure_share(measuring, parts.task(rank), attempt=attempt)
    if not parts.take_merge(attempt):
        console.log(
            f"connect: task {info['rank']} of {info['world']} measured its share "
            f"({info['samples']:,} samples, {info['samples_resumed']:,} of them resumed from "
            "finished parts); the task that finishes last merges"
        )
        return _task_result(cfg, fp, info, t0)
    return merge_parts(cfg, fp, parts, manifest, t0)


def _task_result(cfg: PipelineConfig, fp: str, info: dict[str, Any], t0: float) -> StageResult:
    """What a task that does not merge returns: its share, no record."""
    return stage_result(
        cfg.work_path,
        STAGE,
        fp,
        metrics={
            "connect/task_samples": float(info.get("samples", 0)),
            "connect/task_samples_measured": float(info.get("samples_measured", 0)),
        },
        summary={"task": info},
        t0=t0,
        partial=True,
    )


def merge_parts(
    cfg: PipelineConfig, fp: str, parts: PartsDir, manifest: pd.DataFrame, t0: float
) -> StageResult:
    """Every task's parts → the stage dir (lengths, forecast, histogram, Bridge's videos) and
    its record; then the parts are removed. The processor must agree with the cheap rule on
    every sample it measured, and every manifest key must have come out of the loader:
    otherwise a UserError lists them (and the parts are dropped: a rerun measures again)."""
    records = parts.records()
    infos = parts.done_info()
    try:
        df = lengths_table(records, manifest)
    except UserError:
        parts.remove()  # a rerun measures again
        raise
    verified = records["verified"].astype(bool).tolist()
    with building(cfg.work_path, STAGE) as out:
        processor = out / PROCESSOR
        shutil.copytree(parts.processor, processor)
        df["flops"] = sample_costs(cfg, processor, df)
        validate_table(LengthsModel, df, "lengths.parquet").to_parquet(
            out / "lengths.parquet", index=False
        )
        train = df[df["split"] == "train"]
        forecast = config_forecast(cfg, processor, train)
        (out / FORECAST_FILE).write_text(json.dumps(forecast, indent=2))
        plot_length_histogram(df, cfg.packing.seq_length, out / "length_histogram.png")
        bridge_videos = None
        if backend(cfg).renders_for_bridge and int(df["num_videos"].sum()):
            from packline.qwen.processor import load_processor

            bridge_videos = bridge_video_summary(
                records,
                max_num_frames=bridge_max_num_frames(cfg),
                do_sample_frames=bool(load_processor(processor).video_processor.do_sample_frames),
            )
            (out / BRIDGE_VIDEOS).write_text(json.dumps(bridge_videos, indent=2))

    out_dir = stage_dir(cfg, STAGE)
    seconds = time.perf_counter() - t0
    total = df["total_tokens"]
    n_verified = sum(verified)
    verify = {
        "mode": "all" if cfg.connect.verify_samples is None else "sample",
        "samples": n_verified,
        "of": len(df),
        "seed": None if cfg.connect.verify_samples is None else cfg.train.seed,
    }
    metrics: dict[str, float] = {
        "connect/samples": len(df),
        "connect/train_samples": len(train),
        "connect/tokens_total": int(total.sum()),
        "connect/tokens_text": int(df["text_tokens"].sum()),
        "connect/tokens_image": int(df["image_tokens"].sum()),
        "connect/tokens_loss": int(df["loss_tokens"].sum()),
        "connect/length_mean": float(total.mean()),
        "connect/length_p50": float(total.quantile(0.5)),
        "connect/length_p95": float(total.quantile(0.95)),
        "connect/length_max": int(total.max()),
        "connect/overlength": forecast["overlength"],
        "connect/cheap_mismatches": 0,
        "connect/verified_samples": n_verified,
        "connect/verify_all": float(cfg.connect.verify_samples is None),
        "connect/tasks": parts.world,
        "connect/parts": sum(i["parts"] for i in infos),
        "connect/parts_resumed": sum(i["parts_resumed"] for i in infos),
        "connect/samples_resumed": sum(i["samples_resumed"] for i in infos),
        "connect/samples_measured": sum(i["samples_measured"] for i in infos),
        "connect/fill_lower_bound": forecast["lower_bound"]["fill"],
        "connect/fill_unpacked": forecast["unpacked"]["fill"],
        "connect/ms_per_sample": 1000 * seconds / max(len(df), 1),
    }
    metrics.update({f"flops/{k}": v for k, v in forecast["flops"].items()})
    for b, v in forecast["buffers"].items():
        metrics[f"connect/forecast_fill_b{b}"] = v["fill"]
        metrics[f"connect/forecast_packs_b{b}"] = v["packs"]
        if "fill_without_carry" in v:  # carry-over on: what Energon's own rounds would fill
            metrics[f"connect/forecast_fill_nocarry_b{b}"] = v["fill_without_carry"]
    if bridge_videos is not None:  # what Bridge's encoder makes of the videos (validate warns)
        metrics.update(bridge_video_metrics(bridge_videos))
    console.log(verify_line(verify))
    carry = (
        f" (carry-over, {forecast['max_carry_rounds']} rounds)"
        if forecast["max_carry_rounds"]
        else ""
    )
    flops = forecast["flops"]
    straggler = (
        f"; straggler ratio {flops['straggler_ratio']:.3f} over "
        f"{int(flops['straggler_ranks'])} data-parallel ranks"
        if flops["straggler_ranks"] > 1
        else ""
    )
    console.log(
        f"connect: forecast fill{carry} "
        + ", ".join(f"B={b}: {v['fill']:.3f}" for b, v in forecast["buffers"].items())
        + f"; lower bound {forecast['lower_bound']['fill']:.3f}{straggler}"
    )
    result = stage_result(
        cfg.work_path,
        STAGE,
        fp,
        metrics=metrics,
        summary={
            "processor_dir": str(processor_dir(cfg)),
            "verify": verify,
            "tasks": infos,
            "artifacts": [
                str(out_dir / FORECAST_FILE),
                str(out_dir / "length_histogram.png"),
                *([str(out_dir / BRIDGE_VIDEOS)] if bridge_videos is not None else []),
            ],
        },
        seconds=seconds,
    )
    write_record(result)
    parts.remove()
    return result
