"""Checking a source's rows, in worker processes: each row (a jsonl line, a LLaVA record, an
adopted Energon dataset's sample) becomes its whole shard entry and manifest columns, or a
reject with its reason (:func:`packline.conversations.parse_record` decides). prepare maps
:func:`check_rows` (or, for an adopted dataset, :func:`check_shard`) over the source with
:func:`packline.workers.ordered_map`; :func:`row_context` is what every check needs, set
once per worker.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from packline.conversations import (
    ConversationRow,
    FolderMedia,
    MediaSource,
    Rejected,
    VideoLimits,
    llava_record,
    parse_record,
)
from packline.energon.writer import RejectSink, bridge_frame_parts
from packline.progress import console
from packline.qwen.processor import image_geometry, video_geometry
from packline.qwen.vision import ImageGeometry, VideoGeometry
from packline.sources import NotUtf8, reader, resolve_source
from packline.sources.jsonl import JsonlLine
from packline.sources.tables import ChunkWork, EmbeddedMedia, TableRow, chunk_rows
from schemas.config import PipelineConfig
from schemas.errors import UserError
from schemas.tables import REJECT_REASONS


def video_limits(cfg: PipelineConfig) -> VideoLimits:
    """What prepare accepts of a row's videos."""
    return VideoLimits(
        geometry=video_geometry(cfg),
        max_videos=cfg.prepare.max_videos,
        max_frames_per_video=cfg.prepare.max_frames_per_video,
        max_video_seconds=cfg.prepare.max_video_seconds,
    )


@dataclass(frozen=True)
class RowContext:
    """What every row check needs, set once per worker process (:func:`init_worker`)."""

    #: the media source every row shares (None: each row carries its own)
    media: MediaSource | None
    #: the payloads are LLaVA records, not jsonl lines (the reader's ``llava_records``)
    llava_records: bool
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
    #: media over this many bytes are refused unread (``prepare.max_media_bytes``)
    media_max_bytes: int = 1 << 30

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
    #: video header caveats, images with an EXIF orientation and Bridge's frames, summed
    #: into the stage's metrics
    counts: Counter


@dataclass
class Refused:
    """A rejected row: its ``rejects.jsonl`` record."""

    record: dict[str, object]


_CONTEXT: RowContext | None = None


def init_worker(context: RowContext) -> None:
    global _CONTEXT
    _CONTEXT = context


def check_rows(chunk: list[tuple[int, Any]]) -> list[Accepted | Refused]:
    """Check a chunk of ``(position, payload)`` rows (jsonl lines, LLaVA records, a table's
    rows) in this worker: each becomes its whole shard entry, or a reject with the reason."""
    ctx = _CONTEXT
    assert ctx is not None, "init_worker sets the row context first"
    out: list[Accepted | Refused] = []
    for position, payload in chunk:
        if isinstance(payload, ChunkWork):  # a table's chunk, read here
            out += [_table_row(ctx, pos, row) for pos, row in chunk_rows(payload)]
            continue
        if isinstance(payload, TableRow):
            out.append(_table_row(ctx, position, payload))
            continue
        where, media = None, ctx.media
        if isinstance(payload, JsonlLine):  # one of several files: its folder, its address
            where, media = payload.where, FolderMedia(Path(payload.folder), ctx.media_max_bytes)
            payload = payload.text
        try:
            row = _parse_payload(ctx, payload, media)
        except Rejected as rej:
            if where is not None:
                rej = Rejected(rej.reason, f"{where}: {rej.detail}", rej.id)
            out.append(Refused(reject_record(position, rej)))
            continue
        out.append(accepted_row(position, row, ctx.frames))
    return out


def _parse_payload(ctx: RowContext, payload: Any, media: MediaSource | None) -> ConversationRow:
    """A jsonl line (or :class:`NotUtf8`) or a LLaVA record, checked; :class:`Rejected`."""
    if isinstance(payload, NotUtf8):
        raise Rejected("text_not_utf8", payload.detail)
    if ctx.llava_records:
        record = llava_record(payload)
    else:
        try:
            record = json.loads(payload)
        except json.JSONDecodeError as exc:
            raise Rejected("malformed_json", f"not JSON: {exc.msg} at column {exc.colno}") from None
        except RecursionError:
            raise Rejected("malformed_json", "JSON nested too deeply to read") from None
    return ctx.parse(record, media)


def _table_row(ctx: RowContext, position: int, row: TableRow) -> Accepted | Refused:
    """A table's row (Parquet, Arrow) checked as a folder's is, its media read by
    :class:`~packline.sources.tables.EmbeddedMedia`; a reject's detail begins with the
    row's file, chunk and row."""
    try:
        if row.rejected is not None:
            raise row.rejected
        media = EmbeddedMedia(Path(row.folder), max_bytes=ctx.media_max_bytes)
        parsed = ctx.parse(row.record, media)
    except Rejected as rej:
        rej = Rejected(rej.reason, f"{row.where}: {rej.detail}", rej.id)
        return Refused(reject_record(position, rej))
    return accepted_row(position, parsed, ctx.frames)


def reject_record(position: int, rej: Rejected) -> dict[str, object]:
    return {"line": position, "id": rej.id, "reason": rej.reason, "detail": rej.detail}


def accepted_row(
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
        exif_oriented=sum(i.orientation != 1 for i in row.images),
    )
    if frames is not None and row.videos:
        parts, presampled = bridge_frame_parts(row, frames)
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


def check_shard(item: tuple[str, str]) -> list[Accepted | Refused]:
    """Check every sample of one shard of the adopted dataset (``item``: split, shard) in
    this worker; the accepted ones carry their manifest columns only (nothing is written)."""
    from packline.energon.chatml import ShardUnreadable, indexed_keys, shard_records

    ctx = _CONTEXT
    assert ctx is not None and ctx.dataset is not None, "init_worker sets the context first"
    _, shard = item
    out: list[Accepted | Refused] = []
    try:
        for position, (_, record, media) in enumerate(shard_records(ctx.dataset, shard), 1):
            try:
                row = ctx.parse(record, media)
            except Rejected as rej:
                out.append(Refused(reject_record(position, rej)))
                continue
            accepted = accepted_row(position, row, None, with_entry=False)
            accepted.manifest["shard"] = shard
            out.append(accepted)
    except ShardUnreadable as exc:  # every sample its index holds, none of them read
        keys = indexed_keys(ctx.dataset, shard)
        return [
            Refused(reject_record(n, Rejected("shard_unreadable", exc.detail, f"{shard}/{key}")))
            for n, key in enumerate(keys, 1)
        ]
    return out


#: Rows a worker checks per task: large enough to amortise the hand-over, small enough that
#: the rows in flight (a window of two tasks per worker) stay a few MB. A table's chunk the
#: worker reads itself is a task of its own (its rows are not in flight).
ROWS_PER_TASK = 16


def row_weight(item: tuple[int, Any]) -> int:
    """The rows a ``(position, payload)`` stands for: a table's chunk its rows, else 1."""
    payload = item[1]
    return payload.rows if isinstance(payload, ChunkWork) else 1


def row_context(cfg: PipelineConfig, *, bridge_frames: bool = False) -> RowContext:
    """The checks' settings for ``cfg``'s source; ``bridge_frames``: write each video's
    pre-sampled frames for Megatron-Bridge too (see the module docstring; prepare asks the
    train backend's spec)."""
    source = reader(cfg.data.kind)
    return RowContext(
        media=source.media(cfg, resolve_source(cfg)),
        llava_records=source.llava_records,
        geometry=image_geometry(cfg),
        videos=video_limits(cfg),
        max_images=cfg.prepare.max_images,
        val_fraction=cfg.prepare.val_fraction,
        frames=video_geometry(cfg) if bridge_frames else None,
        max_text_chars=cfg.prepare.max_text_chars,
        media_max_bytes=cfg.prepare.max_media_bytes,
    )


def source_rows(
    cfg: PipelineConfig, source: Path, on_offset
) -> tuple[Path, int, Iterator[tuple[int, Any]]]:
    """What the rows come from, the bytes to read in all and the ``(position, payload)``
    stream of its rows: the source format's reader's (:func:`packline.sources.reader`)."""
    return reader(cfg.data.kind).rows(cfg, source, on_offset)


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


# --- the outcome of a whole source -------------------------------------------------------------


def check_outcome(
    cfg: PipelineConfig,
    out: Path,
    num_rows: int,
    num_accepted: int,
    rejects: RejectSink,
    what: str,
    shard_problems: list[str] = (),
) -> None:
    """Fail (exit 2) when no row is usable or too many were rejected, keeping a copy of the
    rejects (``out/rejects.jsonl``) next to the work dir, since the stage dir is not published;
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
        kept = cfg.work_path / "prepare.rejects.jsonl"
        kept.write_bytes((out / "rejects.jsonl").read_bytes())
        raise UserError(
            [
                *shard_problems,
                f"{rejects.count} of {num_rows} rows rejected ({fraction:.1%}) exceeds "
                f"prepare.max_reject_fraction={cfg.prepare.max_reject_fraction}; "
                f"reasons: {reasons}; see {kept}",
            ],
            "prepare: too many bad rows",
        )
    for problem in shard_problems:
        console.log(f"[yellow]warning:[/] {problem}; its samples are in rejects.jsonl")


def prepare_metrics(
    num_rows: int, num_accepted: int, rejects: RejectSink, tally: Tally, num_shards: int
) -> dict[str, float]:
    """prepare's metrics: the rows, their outcome by reason, and what the accepted hold."""
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
        # Images whose EXIF orientation is not 1: their stored pixels are used, as Qwen's
        # reference loader (qwen-vl-utils) and Megatron-Bridge use them (docs/data.md).
        "prepare/image_exif_oriented": c["exif_oriented"],
        "prepare/shards": num_shards,
        "prepare/videos": c["videos"],
        "prepare/video_bytes": c["video_bytes"],
        "prepare/video_frames": c["video_frames"],
        # The container caveats taken as counted fallbacks (each video once: stages/prepare.py).
        "prepare/video_frames_counted": c["frames_counted"],
        "prepare/video_variable_rate": c["variable_rate"],
        "prepare/video_rotated": c["rotated"],
        # Megatron-Bridge's pre-sampled frames (train.backend megatron)
        "prepare/bridge_frames": c["bridge_frames"],
        "prepare/bridge_frame_bytes": c["bridge_frame_bytes"],
    }
    metrics.update({f"prepare/rejected_{r}": rejects.by_reason.get(r, 0) for r in REJECT_REASONS})
    return {k: float(v) for k, v in metrics.items()}


def shards_checked(
    checked: Iterator[list[Accepted | Refused]],
) -> Iterator[list[Accepted | Refused]]:
    """The shards' outcomes; a shard that changed since it was indexed (``shard_records``'
    ValueError, raised in a worker) stops the stage as bad input (exit 2), saying so."""
    try:
        yield from checked
    except ValueError as exc:
        raise UserError([str(exc)], "prepare: the Energon dataset cannot be adopted") from None
