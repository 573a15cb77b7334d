"""Stage prepare: a conversation folder (or the built-in set) → WebDataset shards + Energon
metadata + ``manifest.parquet`` + ``rejects.jsonl``.

Outputs in ``<work>/prepare/``::

    train-000000.tar ... val-000000.tar ...  WebDataset shards (<key>.json, <key>.img<k>.<ext>,
                       <key>.vid<k>.<ext>: each image's and video's original bytes; the
                       JSON holds each video's probed header; for train.backend megatron
                       also <key>.vid<k>.f<j>.png, each video's pre-sampled frames)
    .nv-meta/          Energon index, split.yaml, dataset.yaml (packline's CrudeWebdataset),
                       bridge_dataset.yaml + bridge_sample_loader.py (Bridge's ChatMLWebdataset)
    bridge.yaml        MetadatasetV2 over these shards through bridge_dataset.yaml: what
                       Bridge's dataset.path names
    manifest.parquet   one row per accepted sample
    rejects.jsonl      one row per rejected row, with its reason

Every bad row is rejected with a reason and counted; the stage fails (exit 2) only when the
rejected share exceeds ``prepare.max_reject_fraction``. Every video is decoded once; the
container's caveats that do not make a length wrong (no frame count in the header, fewer
frames than announced, a variable frame rate, a display rotation) are counted in the metrics
(``prepare/video_frames_counted`` ...), with the decoded facts recorded.

Videos for Megatron-Bridge (``train.backend: megatron`` only): Bridge's Qwen-VL dataset
reads a video as a list of frames, never as a video file, and samples no frames by time (it
has no frame rate; see :mod:`packline.energon.bridge_sample_loader`). So prepare samples each
video itself, at the configured processor's own sampling
(:func:`packline.qwen.processor.video_geometry`: its fps, ``min_frames``, ``max_frames``; the
frames packline's own loader would give the processor),
decodes those frames upright and stores them losslessly as ``<key>.vid<k>.f<j>.png``, next
to the video file, which packline's own readers keep using. The choice is recorded: the JSON
document's ``"presampled"`` holds, per video, the sampled frame indices and the source fps;
the stage's summary holds the sampling and the metrics count the frames and their bytes
(``prepare/bridge_frames``, ``prepare/bridge_frame_bytes``). PNG frames take more room than
the video file (often many times more), hence only for that backend, whose setting is in
prepare's fingerprint.
"""

from __future__ import annotations

import bisect
import time
from contextlib import ExitStack
from dataclasses import replace
from pathlib import Path

from packline.backends import backend
from packline.conversations import (
    Rejected,
    SeenKeys,
)
from packline.energon.files import PACKLINE_METADATASET
from packline.energon.writer import RejectSink, ShardSink, TableSink, index_with_energon
from packline.fingerprints import stage_fingerprint
from packline.progress import console, progress
from packline.rows import (
    ROWS_PER_TASK,
    Accepted,
    Refused,
    Tally,
    check_outcome,
    check_rows,
    check_shard,
    init_worker,
    prepare_metrics,
    reject_record,
    row_context,
    row_weight,
    shards_checked,
    source_rows,
)
from packline.sources import SourceError, chunked, resolve_source
from packline.workers import ordered_map
from schemas.config import PipelineConfig, SourceKind
from schemas.errors import UserError
from schemas.tables import ManifestModel
from stages.base import (
    StageResult,
    building,
    stage_dir,
    stage_result,
    write_record,
)

STAGE = "prepare"


def prepare(cfg: PipelineConfig, fp: str | None = None) -> StageResult:
    """Read, check and shard the conversations, streaming, over ``prepare.num_workers``
    processes; index them for Energon. An Energon source is adopted in place instead."""
    t0 = time.perf_counter()
    fp = fp or stage_fingerprint(cfg, STAGE)
    source = resolve_source(cfg)
    if cfg.data.kind is SourceKind.energon:
        return _adopt_energon(cfg, fp, source, t0)
    context = row_context(cfg, bridge_frames=backend(cfg).renders_for_bridge)
    seen = SeenKeys("line")  # a LLaVA record's number, as rejects.jsonl's "line" holds it
    tally = Tally()
    num_rows = 0
    # the sinks close their files when the stage fails (a full disk gets its room back)
    with building(cfg.work_path, STAGE) as out, ExitStack() as sinks:
        sink = sinks.enter_context(ShardSink(out, cfg.prepare.samples_per_shard))
        manifest = sinks.enter_context(
            TableSink(out / "manifest.parquet", ManifestModel, "manifest.parquet")
        )
        rejects = sinks.enter_context(RejectSink(out / "rejects.jsonl"))
        with progress() as bar:
            task = bar.add_task("prepare rows", total=None)
            path, size, rows = source_rows(
                cfg, source, lambda offset: bar.update(task, completed=offset)
            )
            bar.update(task, total=size, description=f"prepare {path.name}")
            checked = ordered_map(
                check_rows,
                chunked(rows, ROWS_PER_TASK, weight=row_weight),
                num_workers=cfg.prepare.num_workers,
                initializer=init_worker,
                initargs=(context,),
                preload=("packline.rows",),
            )
            try:
                for outcomes in checked:
                    for outcome in outcomes:
                        num_rows += 1
                        if isinstance(outcome, Accepted) and (
                            dup := seen.add(outcome.key, outcome.id, outcome.position)
                        ):
                            outcome = Refused(
                                reject_record(
                                    outcome.position, Rejected("duplicate_id", dup, outcome.id)
                                )
                            )
                        if isinstance(outcome, Refused):
                            rejects.add(outcome.record)
                            continue
                        outcome.manifest["shard"] = sink.write(outcome.split, outcome.entry)
                        manifest.add(outcome.manifest)
                        tally.add(outcome)
            except SourceError as exc:
                raise UserError([str(exc)], "prepare: the source cannot be read") from None
        shards = sink.close()
        manifest.close()
        rejects.close()
        check_outcome(cfg, out, num_rows, manifest.num_rows, rejects, str(path))
        console.log(f"prepare: indexing {sum(map(len, shards.values()))} shards with Energon")
        index_with_energon(out, shards, cfg.prepare.num_workers)

    frames = context.frames
    result = stage_result(
        cfg.work_path,
        STAGE,
        fp,
        metrics=prepare_metrics(
            num_rows, manifest.num_rows, rejects, tally, sum(map(len, shards.values()))
        ),
        summary={
            "source": str(source),
            "source_kind": cfg.data.kind.value,
            "rejects_by_reason": dict(rejects.by_reason),
            "bridge_frames": {
                "written": frames is not None,
                # the configured processor's sampling, which chose every video's frames
                "sampling": None
                if frames is None
                else {
                    "fps": frames.fps,
                    "min_frames": frames.min_frames,
                    "max_frames": frames.max_frames,
                },
                "frames": tally.counts["bridge_frames"],
                "bytes": tally.counts["bridge_frame_bytes"],
                "max_per_video": tally.max_frames_per_video,
            },
            "artifacts": [
                str(stage_dir(cfg, STAGE) / "rejects.jsonl"),
                str(stage_dir(cfg, STAGE) / ".nv-meta" / "dataset.yaml"),
            ],
        },
        t0=t0,
    )
    write_record(result)
    return result


def _adopt_energon(cfg: PipelineConfig, fp: str, source: Path, t0: float) -> StageResult:
    """Adopt an Energon dataset in Megatron-Bridge's ChatML layout in place: check every
    sample (its shards over ``prepare.num_workers`` processes), write the manifest, the
    rejects and the configs that leave the rejected samples out
    (:func:`packline.energon.chatml.write_adoption`); no shard is copied or rewritten."""
    from packline.energon.chatml import ChatMLDataset, write_adoption

    try:
        dataset = ChatMLDataset.open(source, max_part_bytes=cfg.prepare.max_media_bytes)
    except ValueError as exc:  # one problem a line (every entry naming a file outside it)
        problems = str(exc).splitlines()
        raise UserError(problems, "prepare: the Energon dataset cannot be adopted") from None
    context = replace(row_context(cfg), dataset=dataset, frames=None)
    shards = dataset.shards()
    starts: list[int] = []  # the position of each shard's first sample, in shard order
    seen = SeenKeys(
        "position",
        earlier_id=lambda position, key: (
            f"{shards[bisect.bisect_right(starts, position) - 1][1]}/{key}"
        ),
    )
    tally = Tally()
    excluded: list[str] = []
    unreadable: dict[str, str] = {}  # shard → why it cannot be read (left out whole)
    num_rows = 0
    with building(cfg.work_path, STAGE) as out, ExitStack() as sinks:
        manifest = sinks.enter_context(
            TableSink(out / "manifest.parquet", ManifestModel, "manifest.parquet")
        )
        rejects = sinks.enter_context(RejectSink(out / "rejects.jsonl"))
        with progress() as bar:
            task = bar.add_task(f"adopt {source.name} (shards)", total=len(shards))
            checked = ordered_map(
                check_shard,
                iter(shards),
                num_workers=cfg.prepare.num_workers,
                initializer=init_worker,
                initargs=(context,),
                preload=("packline.rows",),
            )
            for (_, shard), outcomes in zip(shards, shards_checked(checked), strict=True):
                bar.advance(task)
                starts.append(num_rows + 1)
                for outcome in outcomes:
                    num_rows += 1  # the sample's position in the whole dataset
                    if isinstance(outcome, Accepted) and (
                        dup := seen.add(outcome.key, outcome.id, num_rows)
                    ):
                        dup += " (an Energon key names one sample in the whole dataset)"
                        outcome = Refused(
                            reject_record(num_rows, Rejected("duplicate_id", dup, outcome.id))
                        )
                    if isinstance(outcome, Refused):
                        outcome.record["line"] = num_rows
                        rejects.add(outcome.record)
                        if outcome.record["reason"] == "shard_unreadable":
                            unreadable.setdefault(shard, str(outcome.record["detail"]))
                        else:
                            excluded.append(str(outcome.record["id"]))
                        continue
                    manifest.add(outcome.manifest)
                    tally.add(outcome)
        manifest.close()
        rejects.close()
        check_outcome(
            cfg, out, num_rows, manifest.num_rows, rejects, str(source), [*unreadable.values()]
        )
        write_adoption(out, stage_dir(cfg, STAGE), dataset, [*unreadable, *excluded])

    result = stage_result(
        cfg.work_path,
        STAGE,
        fp,
        metrics=prepare_metrics(num_rows, manifest.num_rows, rejects, tally, len(shards)),
        summary={
            "source": str(source),
            "source_kind": cfg.data.kind.value,
            "adopted": {
                "shards": len(shards),
                "excluded": len(excluded),
                "unreadable_shards": sorted(unreadable),
            },
            "rejects_by_reason": dict(rejects.by_reason),
            "bridge_frames": {"written": False, "frames": 0, "bytes": 0, "max_per_video": 0},
            "artifacts": [
                str(stage_dir(cfg, STAGE) / "rejects.jsonl"),
                str(stage_dir(cfg, STAGE) / PACKLINE_METADATASET),
            ],
        },
        t0=t0,
    )
    write_record(result)
    return result
