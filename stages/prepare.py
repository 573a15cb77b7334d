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
import io
import json
import shutil
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pandas as pd
import webdataset as wds
import yaml

from packline.conversations import (
    ConversationRow,
    FolderMedia,
    MediaSource,
    Rejected,
    SeenKeys,
    VideoLimits,
    llava_record,
    parse_record,
)
from packline.energon.files import BRIDGE_METADATASET, PACKLINE_METADATASET
from packline.fingerprints import stage_fingerprint
from packline.parallel import ordered_map
from packline.progress import console, progress
from packline.qwen.processor import image_geometry, video_geometry
from packline.qwen.vision import ImageGeometry, VideoGeometry
from packline.sources import NotUtf8, SourceError, chunked, jsonl_rows, llava_records
from packline.workdir import mark_owned, new_temp_dir, publish
from schemas.config import PipelineConfig, SourceKind, TrainBackend
from schemas.errors import UserError
from schemas.tables import REJECT_REASONS, ManifestModel, RejectsModel, validate_table
from stages.base import (
    StageResult,
    building,
    stage_dir,
    write_record,
)

STAGE = "prepare"
SOURCE_DONE = "_SOURCE_COMPLETE"
DATASET_YAML = {"__module__": "megatron.energon", "__class__": "CrudeWebdataset"}
#: Megatron-Bridge's view of the same shards: its ``ChatMLWebdataset`` sample type, fed by
#: packline's sample loader (copied into ``.nv-meta/``), selected by ``bridge.yaml``.
BRIDGE_DATASET_CONFIG = "bridge_dataset.yaml"
BRIDGE_SAMPLE_LOADER = "bridge_sample_loader.py"
BRIDGE_DATASET_YAML = {
    "__module__": "megatron.bridge.data.energon.task_encoder_utils",
    "__class__": "ChatMLWebdataset",
    "sample_loader": f"{BRIDGE_SAMPLE_LOADER}:sample_loader",
    "part_filter": f"{BRIDGE_SAMPLE_LOADER}:part_filter",
}


def video_limits(cfg: PipelineConfig) -> VideoLimits:
    """What prepare accepts of a row's videos."""
    return VideoLimits(
        geometry=video_geometry(cfg),
        max_videos=cfg.prepare.max_videos,
        max_frames_per_video=cfg.prepare.max_frames_per_video,
        max_video_seconds=cfg.prepare.max_video_seconds,
    )


def synthetic_source_dir(cfg: PipelineConfig) -> Path:
    """Where the built-in set of these settings is generated once (the generator's version in
    the name: a copy an older packline wrote is not reused)."""
    from packline.synthetic import SHAPES_VERSION

    d = cfg.data
    name = f"shapes-v{SHAPES_VERSION}-seed{d.seed}-train{d.num_train}-val{d.num_val}"
    return cfg.work_path / "source" / f"{name}-video{d.video_share:g}"


def resolve_source(cfg: PipelineConfig) -> Path:
    """What to read: the user's folder, LLaVA JSON file or Energon dataset, or the built-in
    set generated once into the work dir (in a temp dir of this process, checked whole —
    every row and the media it names — before it is marked complete and renamed into place;
    a copy found incomplete is generated again)."""
    if cfg.data.kind is not SourceKind.synthetic:
        return Path(cfg.data.source).expanduser().resolve()
    from packline.synthetic import shapes_dataset_problem, write_shapes_dataset

    out = synthetic_source_dir(cfg)
    total = cfg.data.num_train + cfg.data.num_val
    if (out / SOURCE_DONE).is_file():
        problem = shapes_dataset_problem(out, num_rows=total)
        if problem is None:
            return out
        console.log(f"[yellow]the built-in set in {out} is incomplete ({problem}): regenerating[/]")
        mark_owned(out, "built-in set")  # its completion file says packline wrote it
    tmp = new_temp_dir(out.parent, f".tmp-{out.name}-")
    try:
        with progress() as bar:
            task = bar.add_task("generate shapes", total=total)
            write_shapes_dataset(
                tmp,
                num_train=cfg.data.num_train,
                num_val=cfg.data.num_val,
                seed=cfg.data.seed,
                video_share=cfg.data.video_share,
                progress=lambda n: bar.advance(task, n),
            )
        problem = shapes_dataset_problem(tmp, num_rows=total)
        assert problem is None, f"the built-in set just written is not whole: {problem}"
        (tmp / SOURCE_DONE).write_text(f"{total} rows\n")
        publish(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def media_dir(cfg: PipelineConfig) -> Path:
    """The folder a row's media paths are relative to: the conversation folder, or for a
    LLaVA JSON file ``data.media_dir`` (default: the file's folder)."""
    return cfg.data.llava_media_dir() or resolve_source(cfg)


def writes_bridge_frames(cfg: PipelineConfig) -> bool:
    """Whether prepare writes each video's pre-sampled frames for Megatron-Bridge (see the
    module docstring): for ``train.backend: megatron``."""
    return cfg.train.backend is TrainBackend.megatron


def _png(frame) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(frame).save(buf, format="PNG")  # lossless, deterministic
    return buf.getvalue()


def _bridge_frames(row: ConversationRow, geometry: VideoGeometry) -> tuple[dict, list[dict]]:
    """The frame parts of a row's videos for Megatron-Bridge (``vid<k>.f<j>.png``: the
    frames ``geometry`` samples, decoded upright) and, per video, what was sampled."""
    from packline.video import decode_frames

    parts: dict[str, bytes] = {}
    presampled = []
    for k, video in enumerate(row.videos):
        h = video.header
        indices = [int(i) for i in geometry.sample_indices(h.num_frames, h.fps)]
        for j, frame in enumerate(decode_frames(video.data, indices, rotation=h.rotation)):
            parts[f"vid{k}.f{j:03d}.png"] = _png(frame)
        presampled.append({"indices": indices, "fps": h.fps})
    return parts, presampled


# --- checking rows in worker processes ----------------------------------------------------------


@dataclass(frozen=True)
class RowContext:
    """What every row check needs, set once per worker process (:func:`_init_worker`)."""

    kind: SourceKind
    media: MediaSource | None
    geometry: ImageGeometry
    videos: VideoLimits
    max_images: int
    val_fraction: float
    #: the sampling of each video's frames for Megatron-Bridge; None writes none
    frames: VideoGeometry | None
    #: rows whose conversation holds more characters are rejected (``text_too_long``)
    max_text_chars: int = 0
    #: the Energon dataset adopted in place (``packline.energon.chatml.ChatMLDataset``)
    dataset: Any = None

    def parse(self, record: Any, media: MediaSource | None) -> ConversationRow:
        """``record`` checked with these settings (:func:`parse_record`)."""
        return parse_record(
            record,
            media,
            geometry=self.geometry,
            max_images=self.max_images,
            val_fraction=self.val_fraction,
            videos=self.videos,
            max_text_chars=self.max_text_chars,
        )


@dataclass
class Accepted:
    """A row that passed every check: its WebDataset entry (all parts, ready to write) and
    its manifest columns (``shard`` is filled in by the writer)."""

    position: int
    key: str
    id: str
    split: str
    entry: dict[str, object]
    manifest: dict[str, object]
    #: video header caveats and Bridge's frames, summed into the stage's metrics
    counts: Counter


@dataclass
class Refused:
    """A rejected row: its ``rejects.jsonl`` record."""

    record: dict[str, object]


_CONTEXT: RowContext | None = None


def _init_worker(context: RowContext) -> None:
    global _CONTEXT
    _CONTEXT = context


def _check_rows(chunk: list[tuple[int, Any]]) -> list[Accepted | Refused]:
    """Check a chunk of ``(position, payload)`` rows (jsonl lines or LLaVA records) in this
    worker: each becomes its whole shard entry, or a reject with the reason."""
    ctx = _CONTEXT
    assert ctx is not None, "_init_worker sets the row context first"
    out: list[Accepted | Refused] = []
    for position, payload in chunk:
        try:
            if isinstance(payload, NotUtf8):
                raise Rejected("text_not_utf8", payload.detail)
            if ctx.kind is SourceKind.llava:
                record = llava_record(payload)
            else:
                try:
                    record = json.loads(payload)
                except json.JSONDecodeError as exc:
                    raise Rejected(
                        "malformed_json", f"not JSON: {exc.msg} at column {exc.colno}"
                    ) from None
                except RecursionError:
                    raise Rejected("malformed_json", "JSON nested too deeply to read") from None
            row = ctx.parse(record, ctx.media)
        except Rejected as rej:
            out.append(Refused(_reject(position, rej)))
            continue
        out.append(_accepted(position, row, ctx.frames))
    return out


def _reject(position: int, rej: Rejected) -> dict[str, object]:
    return {"line": position, "id": rej.id, "reason": rej.reason, "detail": rej.detail}


def _accepted(
    position: int, row: ConversationRow, frames: VideoGeometry | None, *, with_entry: bool = True
) -> Accepted:
    """The row's shard entry (its JSON, media bytes and, for Megatron-Bridge, its videos'
    pre-sampled frames; none for an adopted sample, whose shard stays as it is) and
    manifest columns."""
    entry: dict[str, object] = {}
    if with_entry:
        entry = {"__key__": row.key, "json": row.sample_json()}
        for k, img in enumerate(row.images):
            entry[f"img{k}.{img.ext}"] = img.data
        for k, video in enumerate(row.videos):
            entry[f"vid{k}.{video.ext}"] = video.data
    counts: Counter = Counter(
        frames_counted=sum(v.header.counted for v in row.videos),
        variable_rate=sum(v.header.variable_rate for v in row.videos),
        rotated=sum(v.header.rotation != 0 for v in row.videos),
    )
    if frames is not None and row.videos:
        parts, presampled = _bridge_frames(row, frames)
        doc = json.loads(row.sample_json())
        doc["presampled"] = presampled
        entry["json"] = json.dumps(doc, ensure_ascii=False, sort_keys=True).encode()
        entry.update(parts)
        counts["bridge_frames"] = len(parts)
        counts["bridge_frame_bytes"] = sum(map(len, parts.values()))
        counts["bridge_max_per_video"] = max(len(p["indices"]) for p in presampled)
    split = row.split or "train"
    manifest = {
        "key": row.key,
        "id": row.id,
        "split": split,
        "shard": "",
        "num_images": len(row.images),
        "num_turns": len(row.conversation),
        "num_assistant_turns": row.num_assistant_turns,
        "text_chars": row.text_chars,
        "image_bytes": sum(len(i.data) for i in row.images),
        "num_videos": len(row.videos),
        "video_bytes": sum(len(v.data) for v in row.videos),
        "video_frames": sum(v.header.num_frames for v in row.videos),
    }
    return Accepted(position, row.key, row.id, split, entry, manifest, counts)


# --- writing, one row at a time -----------------------------------------------------------------


class ShardSink:
    """The shards of the splits, written as rows arrive: ``<split>-NNNNNN.tar`` holding
    ``per_shard`` rows each (a fixed mtime: the same rows give byte-identical shards)."""

    def __init__(self, out: Path, per_shard: int):
        self.out = out
        self.per_shard = per_shard
        self.names: dict[str, list[str]] = {"train": [], "val": []}
        self._open: dict[str, tuple[wds.TarWriter, int]] = {}

    def write(self, split: str, entry: dict[str, object]) -> str:
        """Write one entry; returns the shard it went to."""
        writer, count = self._open.get(split, (None, self.per_shard))
        if writer is None or count >= self.per_shard:
            if writer is not None:
                writer.close()
            name = f"{split}-{len(self.names[split]):06d}.tar"
            self.names[split].append(name)
            writer, count = wds.TarWriter(str(self.out / name), mtime=0), 0
        writer.write(entry)
        self._open[split] = (writer, count + 1)
        return self.names[split][-1]

    def close(self) -> dict[str, list[str]]:
        for writer, _ in self._open.values():
            writer.close()
        self._open.clear()
        return self.names


class TableSink:
    """A parquet table written in row groups of ``batch_rows`` rows, each validated with its
    pandera model as it is written (the whole table is never in memory)."""

    def __init__(self, path: Path, model: type, name: str, batch_rows: int = 10_000):
        self.path, self.model, self.name, self.batch_rows = path, model, name, batch_rows
        self.rows: list[dict[str, object]] = []
        self.num_rows = 0
        self._writer = None

    def add(self, row: dict[str, object]) -> None:
        self.rows.append(row)
        if len(self.rows) >= self.batch_rows:
            self.flush()

    def flush(self) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        if not self.rows:
            return
        frame = validate_table(self.model, pd.DataFrame(self.rows), self.name)
        table = pa.Table.from_pandas(frame, preserve_index=False)
        if self._writer is None:
            self._writer = pq.ParquetWriter(self.path, table.schema)
        self._writer.write_table(table)
        self.num_rows += len(self.rows)
        self.rows = []

    def close(self) -> None:
        self.flush()
        if self._writer is not None:
            self._writer.close()


class RejectSink:
    """``rejects.jsonl``: one record per rejected row, validated in batches, counted by
    reason."""

    def __init__(self, path: Path, batch_rows: int = 1000):
        self.file = path.open("w")
        self.batch_rows = batch_rows
        self.rows: list[dict[str, object]] = []
        self.by_reason: Counter = Counter()

    def add(self, record: dict[str, object]) -> None:
        self.rows.append(record)
        self.by_reason[str(record["reason"])] += 1
        if len(self.rows) >= self.batch_rows:
            self.flush()

    def flush(self) -> None:
        if not self.rows:
            return
        validate_table(
            RejectsModel,
            pd.DataFrame(self.rows, columns=["line", "id", "reason", "detail"]).astype(
                {"line": "int64", "reason": "str", "detail": "str"}
            ),
            "rejects.jsonl",
        )
        self.file.writelines(json.dumps(r) + "\n" for r in self.rows)
        self.rows = []

    def close(self) -> None:
        self.flush()
        self.file.close()

    @property
    def count(self) -> int:
        return sum(self.by_reason.values())


def _energon_prepare(out: Path, shards: dict[str, list[str]], workers: int) -> None:
    """Index the shards with Energon's own prepare API and write the dataset.yaml."""
    from megatron.energon.flavors.webdataset.base_webdataset import BaseWebdatasetFactory

    paths = [name for names in shards.values() for name in names]
    # No backslashes: Energon brace-expands the pattern first, which eats them.
    patterns = [(split, f"^{split}-[0-9]+[.]tar$") for split, names in shards.items() if names]
    BaseWebdatasetFactory.prepare_dataset(
        out,
        paths,
        split_parts_patterns=patterns,
        shuffle_seed=None,
        workers=max(1, min(workers, len(paths))),
    )
    meta = out / ".nv-meta"
    (meta / "dataset.yaml").write_text(yaml.safe_dump(DATASET_YAML, sort_keys=False))
    _write_bridge_view(out, sorted(split for split, names in shards.items() if names))


def _write_bridge_view(out: Path, splits: list[str]) -> None:
    """Megatron-Bridge's dataset config over the same shards, and the metadataset naming it."""
    from packline.energon import bridge_sample_loader

    meta = out / ".nv-meta"
    shutil.copyfile(bridge_sample_loader.__file__, meta / BRIDGE_SAMPLE_LOADER)
    (meta / BRIDGE_DATASET_CONFIG).write_text(yaml.safe_dump(BRIDGE_DATASET_YAML, sort_keys=False))
    metadataset = {
        "__module__": "megatron.energon",
        "__class__": "MetadatasetV2",
        "splits": {
            split: {"path": ".", "dataset_config": BRIDGE_DATASET_CONFIG} for split in splits
        },
    }
    (out / BRIDGE_METADATASET).write_text(yaml.safe_dump(metadataset, sort_keys=False))


#: Rows a worker checks per task: large enough to amortise the hand-over, small enough that
#: the rows in flight (a window of two tasks per worker) stay a few MB.
ROWS_PER_TASK = 16


def row_context(cfg: PipelineConfig) -> RowContext:
    """The checks' settings for ``cfg``'s source."""
    kind = cfg.data.kind
    return RowContext(
        kind=kind,
        media=None if kind is SourceKind.energon else FolderMedia(media_dir(cfg)),
        geometry=image_geometry(cfg),
        videos=video_limits(cfg),
        max_images=cfg.prepare.max_images,
        val_fraction=cfg.prepare.val_fraction,
        frames=video_geometry(cfg) if writes_bridge_frames(cfg) else None,
        max_text_chars=cfg.prepare.max_text_chars,
    )


def _source_rows(
    cfg: PipelineConfig, source: Path, on_offset
) -> tuple[Path, Iterator[tuple[int, Any]]]:
    """The file the rows come from and the ``(position, payload)`` stream of its rows."""
    if cfg.data.kind is SourceKind.llava:
        return source, llava_records(source, on_offset)
    jsonl = source / "conversations.jsonl"
    if not jsonl.is_file():
        raise UserError([f"{jsonl} does not exist"], "prepare: no conversations")
    return jsonl, jsonl_rows(jsonl, on_offset)


class Tally:
    """The stage's counts, summed row by row as the rows are written."""

    def __init__(self) -> None:
        self.counts: Counter = Counter()
        self.max_frames_per_video = 0

    def add(self, row: Accepted) -> None:
        m = row.manifest
        self.counts.update(
            {
                f"{row.split}_samples": 1,
                "images": m["num_images"],
                "image_bytes": m["image_bytes"],
                "videos": m["num_videos"],
                "video_bytes": m["video_bytes"],
                "video_frames": m["video_frames"],
            }
        )
        self.counts.update({k: v for k, v in row.counts.items() if k != "bridge_max_per_video"})
        self.max_frames_per_video = max(
            self.max_frames_per_video, row.counts.get("bridge_max_per_video", 0)
        )


def prepare_dataset(cfg: PipelineConfig, fp: str | None = None) -> StageResult:
    """Read, check and shard the conversations, streaming, over ``prepare.num_workers``
    processes; index them for Energon. An Energon source is adopted in place instead."""
    t0 = time.perf_counter()
    fp = fp or stage_fingerprint(cfg, STAGE)
    source = resolve_source(cfg)
    if cfg.data.kind is SourceKind.energon:
        return _adopt_energon(cfg, fp, source, t0)
    context = row_context(cfg)
    seen = SeenKeys("line")  # a LLaVA record's number, as rejects.jsonl's "line" holds it
    tally = Tally()
    num_rows = 0
    with building(cfg, STAGE) as out:
        sink = ShardSink(out, cfg.prepare.samples_per_shard)
        manifest = TableSink(out / "manifest.parquet", ManifestModel, "manifest.parquet")
        rejects = RejectSink(out / "rejects.jsonl")
        with progress() as bar:
            task = bar.add_task("prepare rows", total=None)
            path, rows = _source_rows(
                cfg, source, lambda offset: bar.update(task, completed=offset)
            )
            bar.update(task, total=path.stat().st_size, description=f"prepare {path.name}")
            checked = ordered_map(
                _check_rows,
                chunked(rows, ROWS_PER_TASK),
                num_workers=cfg.prepare.num_workers,
                initializer=_init_worker,
                initargs=(context,),
                preload=(__name__,),
            )
            try:
                for outcomes in checked:
                    for outcome in outcomes:
                        num_rows += 1
                        if isinstance(outcome, Accepted) and (
                            dup := seen.add(outcome.key, outcome.id, outcome.position)
                        ):
                            outcome = Refused(
                                _reject(outcome.position, Rejected("duplicate_id", dup, outcome.id))
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
        _check_outcome(cfg, out, num_rows, manifest.num_rows, rejects, str(path))
        console.log(f"prepare: indexing {sum(map(len, shards.values()))} shards with Energon")
        _energon_prepare(out, shards, cfg.prepare.num_workers)

    frames = context.frames
    result = StageResult(
        stage=STAGE,
        out_dir=stage_dir(cfg, STAGE),
        fingerprint=fp,
        skipped=False,
        metrics=_metrics(
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
        seconds=time.perf_counter() - t0,
    )
    write_record(cfg, result)
    return result


def _check_outcome(
    cfg: PipelineConfig,
    out: Path,
    num_rows: int,
    num_accepted: int,
    rejects: RejectSink,
    what: str,
    shard_problems: list[str] = (),
) -> None:
    """Fail (exit 2) when no row is usable or too many were rejected, keeping the rejects;
    ``shard_problems`` (an adopted dataset's unreadable shards, each with its fix) are listed
    first."""
    reasons = dict(rejects.by_reason)
    if num_accepted == 0:
        raise UserError(
            [
                *shard_problems,
                f"none of the {num_rows} rows of {what} is usable; reasons: {reasons}",
            ],
            "prepare: no usable rows",
        )
    fraction = rejects.count / num_rows if num_rows else 0.0
    if fraction > cfg.prepare.max_reject_fraction:
        _keep_rejects(cfg, out / "rejects.jsonl")
        raise UserError(
            [
                *shard_problems,
                f"{rejects.count} of {num_rows} rows rejected ({fraction:.1%}) exceeds "
                f"prepare.max_reject_fraction={cfg.prepare.max_reject_fraction}; "
                f"reasons: {reasons}; see {cfg.work_path / 'prepare.rejects.jsonl'}",
            ],
            "prepare: too many bad rows",
        )
    for problem in shard_problems:
        console.log(f"[yellow]warning:[/] {problem}; its samples are in rejects.jsonl")


def _metrics(
    num_rows: int, num_accepted: int, rejects: RejectSink, tally: Tally, num_shards: int
) -> dict[str, float]:
    c = tally.counts
    metrics = {
        "prepare/rows_total": num_rows,
        "prepare/rows_accepted": num_accepted,
        "prepare/rows_rejected": rejects.count,
        "prepare/reject_fraction": rejects.count / num_rows if num_rows else 0.0,
        "prepare/train_samples": c["train_samples"],
        "prepare/val_samples": c["val_samples"],
        "prepare/images": c["images"],
        "prepare/image_bytes": c["image_bytes"],
        "prepare/shards": num_shards,
        "prepare/videos": c["videos"],
        "prepare/video_bytes": c["video_bytes"],
        "prepare/video_frames": c["video_frames"],
        # The container caveats taken as counted fallbacks (each video once, see the docstring).
        "prepare/video_frames_counted": c["frames_counted"],
        "prepare/video_variable_rate": c["variable_rate"],
        "prepare/video_rotated": c["rotated"],
        # Megatron-Bridge's pre-sampled frames (train.backend megatron; see the docstring)
        "prepare/bridge_frames": c["bridge_frames"],
        "prepare/bridge_frame_bytes": c["bridge_frame_bytes"],
    }
    metrics.update({f"prepare/rejected_{r}": rejects.by_reason.get(r, 0) for r in REJECT_REASONS})
    return {k: float(v) for k, v in metrics.items()}


def _check_shard(item: tuple[str, str]) -> list[Accepted | Refused]:
    """Check every sample of one shard of the adopted dataset (``item``: split, shard) in
    this worker; the accepted ones carry their manifest columns only (nothing is written)."""
    from packline.energon.chatml import ShardUnreadable, indexed_keys, shard_records

    ctx = _CONTEXT
    assert ctx is not None and ctx.dataset is not None, "_init_worker sets the context first"
    _, shard = item
    out: list[Accepted | Refused] = []
    try:
        for position, (_, record, media) in enumerate(shard_records(ctx.dataset, shard), 1):
            try:
                row = ctx.parse(record, media)
            except Rejected as rej:
                out.append(Refused(_reject(position, rej)))
                continue
            accepted = _accepted(position, row, None, with_entry=False)
            accepted.manifest["shard"] = shard
            out.append(accepted)
    except ShardUnreadable as exc:  # every sample its index holds, none of them read
        keys = indexed_keys(ctx.dataset, shard)
        return [
            Refused(_reject(n, Rejected("shard_unreadable", exc.detail, f"{shard}/{key}")))
            for n, key in enumerate(keys, 1)
        ]
    return out


def _shards_checked(
    checked: Iterator[list[Accepted | Refused]],
) -> Iterator[list[Accepted | Refused]]:
    """The shards' outcomes; a shard that changed since it was indexed (``shard_records``'
    ValueError, raised in a worker) stops the stage as bad input (exit 2), saying so."""
    try:
        yield from checked
    except ValueError as exc:
        raise UserError([str(exc)], "prepare: the Energon dataset cannot be adopted") from None


def _adopt_energon(cfg: PipelineConfig, fp: str, source: Path, t0: float) -> StageResult:
    """Adopt an Energon dataset in Megatron-Bridge's ChatML layout in place: check every
    sample (its shards over ``prepare.num_workers`` processes), write the manifest, the
    rejects and the configs that leave the rejected samples out
    (:func:`packline.energon.chatml.write_adoption`); no shard is copied or rewritten."""
    from packline.energon.chatml import ChatMLDataset, write_adoption

    try:
        dataset = ChatMLDataset.open(source)
    except ValueError as exc:
        raise UserError([str(exc)], "prepare: the Energon dataset cannot be adopted") from None
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
    with building(cfg, STAGE) as out:
        manifest = TableSink(out / "manifest.parquet", ManifestModel, "manifest.parquet")
        rejects = RejectSink(out / "rejects.jsonl")
        with progress() as bar:
            task = bar.add_task(f"adopt {source.name} (shards)", total=len(shards))
            checked = ordered_map(
                _check_shard,
                iter(shards),
                num_workers=cfg.prepare.num_workers,
                initializer=_init_worker,
                initargs=(context,),
                preload=(__name__,),
            )
            for (_, shard), outcomes in zip(shards, _shards_checked(checked), strict=True):
                bar.advance(task)
                starts.append(num_rows + 1)
                for outcome in outcomes:
                    num_rows += 1  # the sample's position in the whole dataset
                    if isinstance(outcome, Accepted) and (
                        dup := seen.add(outcome.key, outcome.id, num_rows)
                    ):
                        dup += " (an Energon key names one sample in the whole dataset)"
                        outcome = Refused(
                            _reject(num_rows, Rejected("duplicate_id", dup, outcome.id))
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
        _check_outcome(
            cfg, out, num_rows, manifest.num_rows, rejects, str(source), [*unreadable.values()]
        )
        write_adoption(out, stage_dir(cfg, STAGE), dataset, [*unreadable, *excluded])

    result = StageResult(
        stage=STAGE,
        out_dir=stage_dir(cfg, STAGE),
        fingerprint=fp,
        skipped=False,
        metrics=_metrics(num_rows, manifest.num_rows, rejects, tally, len(shards)),
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
        seconds=time.perf_counter() - t0,
    )
    write_record(cfg, result)
    return result


def _keep_rejects(cfg: PipelineConfig, path: Path) -> None:
    """Copy the rejects next to the work dir so a failed stage still shows them."""
    (cfg.work_path / "prepare.rejects.jsonl").write_bytes(path.read_bytes())
