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
video itself, at the configured processor's own sampling (:func:`video_geometry`: its fps,
``min_frames``, ``max_frames``; the frames packline's own loader would give the processor),
decodes those frames upright and stores them losslessly as ``<key>.vid<k>.f<j>.png``, next
to the video file, which packline's own readers keep using. The choice is recorded: the JSON
document's ``"presampled"`` holds, per video, the sampled frame indices and the source fps;
the stage's summary holds the sampling and the metrics count the frames and their bytes
(``prepare/bridge_frames``, ``prepare/bridge_frame_bytes``). PNG frames take more room than
the video file (often many times more), hence only for that backend, whose setting is in
prepare's fingerprint.
"""

from __future__ import annotations

import io
import json
import shutil
import time
from collections import Counter
from pathlib import Path

import pandas as pd
import webdataset as wds
import yaml

from packline.conversations import ConversationRow, Rejected, VideoLimits, parse_row
from packline.progress import console, progress
from packline.qwen.vision import ImageGeometry, VideoGeometry
from schemas.config import PipelineConfig, TrainBackend
from schemas.errors import UserError
from schemas.tables import REJECT_REASONS, ManifestModel, RejectsModel, validate_table
from stages.base import StageResult, building, fingerprint, hash_tree, stage_dir, write_record

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
#: The file Megatron-Bridge's ``dataset.path`` names (a ``MetadatasetV2`` over the prepare dir).
BRIDGE_METADATASET = "bridge.yaml"
#: Bumped when the layout of prepare's outputs changes, so older outputs are rebuilt.
LAYOUT_VERSION = 3  # 3: videos (<key>.vid<k>.<ext>, "videos" headers, manifest video columns)
#: Geometry fields of ``processor.*`` that a video processor takes too (the pixel bounds of a
#: video are the whole clip's, not an image's: connect writes them into the image config only).
VIDEO_GEOMETRY_FIELDS = ("patch_size", "temporal_patch_size", "merge_size")


def image_geometry(cfg: PipelineConfig) -> ImageGeometry:
    """The resize rule of the configured processor (the built-in tiny one by default), with
    the geometry fields the config sets (``processor.min_pixels`` ...) in place of the dir's."""
    if cfg.processor.path:
        geometry = ImageGeometry.from_processor_dir(Path(cfg.processor.path).expanduser())
    else:
        geometry = ImageGeometry()
    return geometry.with_overrides(**cfg.processor.geometry_overrides())


def video_geometry(cfg: PipelineConfig) -> VideoGeometry:
    """The frame sampling and resize rule of the configured processor's video processor
    (``video_preprocessor_config.json``, or the ``video_processor`` entry of
    ``processor_config.json``; the video processor's defaults when the dir has neither), the
    built-in tiny one's by default, with the patch sizes the config sets."""
    if cfg.processor.path:
        path = Path(cfg.processor.path).expanduser()
        params: dict | None = None
        if (path / "video_preprocessor_config.json").is_file():
            params = json.loads((path / "video_preprocessor_config.json").read_text())
        elif (path / "processor_config.json").is_file():
            params = json.loads((path / "processor_config.json").read_text()).get("video_processor")
        geometry = VideoGeometry.from_config(params or {})
    else:
        geometry = _tiny_video_geometry()
    overrides = cfg.processor.geometry_overrides()
    return geometry.with_overrides(
        **{k: v for k, v in overrides.items() if k in VIDEO_GEOMETRY_FIELDS}
    )


def _tiny_video_geometry() -> VideoGeometry:
    """The built-in tiny processor's video geometry (its video processor alone: no tokenizer
    is built)."""
    from packline.qwen.processor import tiny_video_processor

    return VideoGeometry.of(tiny_video_processor())


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
    """The folder to read: the user's, or the built-in set generated once into the work dir."""
    if cfg.data.source != "synthetic":
        return Path(cfg.data.source).expanduser().resolve()
    out = synthetic_source_dir(cfg)
    if (out / SOURCE_DONE).is_file():
        return out
    from packline.synthetic import write_shapes_dataset

    tmp = out.with_name(out.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    total = cfg.data.num_train + cfg.data.num_val
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
    (tmp / SOURCE_DONE).write_text("ok\n")
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return out


def writes_bridge_frames(cfg: PipelineConfig) -> bool:
    """Whether prepare writes each video's pre-sampled frames for Megatron-Bridge (see the
    module docstring): for ``train.backend: megatron``."""
    return cfg.train.backend is TrainBackend.megatron


def fingerprint_inputs(cfg: PipelineConfig) -> str:
    """Config sections prepare depends on, plus the source folder's files when user-given
    (and whether Bridge's frames are written)."""
    source = None
    if cfg.data.source != "synthetic":
        source = hash_tree(Path(cfg.data.source).expanduser().resolve())
    geometry = image_geometry(cfg)
    videos = video_geometry(cfg)
    bridge = ["bridge-frames"] if writes_bridge_frames(cfg) else []
    return fingerprint(
        cfg.section_hash("data", "prepare"), geometry, videos, source, LAYOUT_VERSION, *bridge
    )


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


def _write_shards(
    rows: list[ConversationRow],
    out: Path,
    split: str,
    per_shard: int,
    frames: VideoGeometry | None,
    tally: Counter,
) -> list[str]:
    """Write the rows' shards; ``frames``: the sampling of each video's frames for
    Megatron-Bridge, None to write none (``tally`` counts them and their bytes)."""
    names = []
    for start in range(0, len(rows), per_shard):
        name = f"{split}-{start // per_shard:06d}.tar"
        names.append(name)
        # Fixed mtime: the same rows give byte-identical shards.
        with wds.TarWriter(str(out / name), mtime=0) as sink:
            for row in rows[start : start + per_shard]:
                entry: dict[str, object] = {"__key__": row.key, "json": row.sample_json()}
                for k, img in enumerate(row.images):
                    entry[f"img{k}.{img.ext}"] = img.data
                for k, video in enumerate(row.videos):
                    entry[f"vid{k}.{video.ext}"] = video.data
                if frames is not None and row.videos:
                    parts, presampled = _bridge_frames(row, frames)
                    doc = json.loads(row.sample_json())
                    doc["presampled"] = presampled
                    entry["json"] = json.dumps(doc, ensure_ascii=False, sort_keys=True).encode()
                    entry.update(parts)
                    tally["frames"] += len(parts)
                    tally["bytes"] += sum(map(len, parts.values()))
                    tally["max_per_video"] = max(
                        tally["max_per_video"], *(len(p["indices"]) for p in presampled)
                    )
                sink.write(entry)
    return names


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


def prepare_dataset(cfg: PipelineConfig, fp: str | None = None) -> StageResult:
    """Read, check and shard the conversations; index them for Energon."""
    t0 = time.perf_counter()
    fp = fp or fingerprint_inputs(cfg)
    source = resolve_source(cfg)
    jsonl = source / "conversations.jsonl"
    if not jsonl.is_file():
        raise UserError([f"{jsonl} does not exist"], "prepare: no conversations")
    geometry = image_geometry(cfg)
    videos = video_limits(cfg)
    lines = jsonl.read_text(encoding="utf-8", errors="replace").splitlines()
    accepted: dict[str, list[ConversationRow]] = {"train": [], "val": []}
    rejects: list[dict[str, object]] = []
    seen_ids: set[str] = set()
    seen_keys: set[str] = set()
    num_rows = 0
    with progress() as bar:
        task = bar.add_task("prepare rows", total=len(lines))
        for lineno, line in enumerate(lines, start=1):
            bar.advance(task)
            if not line.strip():
                continue
            num_rows += 1
            try:
                row = parse_row(
                    line,
                    source,
                    geometry=geometry,
                    max_images=cfg.prepare.max_images,
                    val_fraction=cfg.prepare.val_fraction,
                    videos=videos,
                )
                if row.id in seen_ids or row.key in seen_keys:
                    raise Rejected("duplicate_id", f"id {row.id!r} already seen", row.id)
            except Rejected as rej:
                rejects.append(
                    {"line": lineno, "id": rej.id, "reason": rej.reason, "detail": rej.detail}
                )
                continue
            seen_ids.add(row.id)
            seen_keys.add(row.key)
            accepted[row.split or "train"].append(row)

    num_accepted = sum(len(v) for v in accepted.values())
    reject_fraction = len(rejects) / num_rows if num_rows else 0.0
    by_reason = Counter(str(r["reason"]) for r in rejects)
    with building(cfg, STAGE) as out:
        frames = video_geometry(cfg) if writes_bridge_frames(cfg) else None
        tally: Counter = Counter()
        shards = {
            split: _write_shards(rows, out, split, cfg.prepare.samples_per_shard, frames, tally)
            for split, rows in accepted.items()
        }
        validate_table(
            RejectsModel,
            pd.DataFrame(rejects, columns=["line", "id", "reason", "detail"]).astype(
                {"line": "int64", "reason": "str", "detail": "str"}
            ),
            "rejects.jsonl",
        )
        with (out / "rejects.jsonl").open("w") as f:
            for r in rejects:
                f.write(json.dumps(r) + "\n")
        if num_accepted == 0:
            raise UserError(
                [f"none of the {num_rows} rows of {jsonl} is usable; reasons: {dict(by_reason)}"],
                "prepare: no usable rows",
            )
        if reject_fraction > cfg.prepare.max_reject_fraction:
            _keep_rejects(cfg, out / "rejects.jsonl")
            raise UserError(
                [
                    f"{len(rejects)} of {num_rows} rows rejected ({reject_fraction:.1%}) exceeds "
                    f"prepare.max_reject_fraction={cfg.prepare.max_reject_fraction}; "
                    f"reasons: {dict(by_reason)}; see {cfg.work_path / 'prepare.rejects.jsonl'}",
                ],
                "prepare: too many bad rows",
            )
        shard_of = {
            row.key: name
            for split, names in shards.items()
            for i, name in enumerate(names)
            for row in accepted[split][
                i * cfg.prepare.samples_per_shard : (i + 1) * cfg.prepare.samples_per_shard
            ]
        }
        manifest = pd.DataFrame(
            [
                {
                    "key": row.key,
                    "id": row.id,
                    "split": split,
                    "shard": shard_of[row.key],
                    "num_images": len(row.images),
                    "num_turns": len(row.conversation),
                    "num_assistant_turns": row.num_assistant_turns,
                    "text_chars": row.text_chars,
                    "image_bytes": sum(len(i.data) for i in row.images),
                    "num_videos": len(row.videos),
                    "video_bytes": sum(len(v.data) for v in row.videos),
                    "video_frames": sum(v.header.num_frames for v in row.videos),
                }
                for split, rows in accepted.items()
                for row in rows
            ]
        )
        validate_table(ManifestModel, manifest, "manifest.parquet").to_parquet(
            out / "manifest.parquet", index=False
        )
        console.log(f"prepare: indexing {sum(map(len, shards.values()))} shards with Energon")
        _energon_prepare(out, shards, cfg.prepare.num_workers)

    out_dir = stage_dir(cfg, STAGE)
    all_videos = [v for rows in accepted.values() for row in rows for v in row.videos]
    metrics = {
        "prepare/rows_total": num_rows,
        "prepare/rows_accepted": num_accepted,
        "prepare/rows_rejected": len(rejects),
        "prepare/reject_fraction": reject_fraction,
        "prepare/train_samples": len(accepted["train"]),
        "prepare/val_samples": len(accepted["val"]),
        "prepare/images": int(manifest["num_images"].sum()),
        "prepare/image_bytes": int(manifest["image_bytes"].sum()),
        "prepare/shards": sum(len(v) for v in shards.values()),
        "prepare/videos": int(manifest["num_videos"].sum()),
        "prepare/video_bytes": int(manifest["video_bytes"].sum()),
        "prepare/video_frames": int(manifest["video_frames"].sum()),
        # The container caveats taken as counted fallbacks (each video once, see the docstring).
        "prepare/video_frames_counted": sum(v.header.counted for v in all_videos),
        "prepare/video_variable_rate": sum(v.header.variable_rate for v in all_videos),
        "prepare/video_rotated": sum(v.header.rotation != 0 for v in all_videos),
        # Megatron-Bridge's pre-sampled frames (train.backend megatron; see the docstring)
        "prepare/bridge_frames": tally["frames"],
        "prepare/bridge_frame_bytes": tally["bytes"],
    }
    metrics.update({f"prepare/rejected_{r}": by_reason.get(r, 0) for r in REJECT_REASONS})
    result = StageResult(
        stage=STAGE,
        out_dir=out_dir,
        fingerprint=fp,
        skipped=False,
        metrics={k: float(v) for k, v in metrics.items()},
        summary={
            "source": str(source),
            "rejects_by_reason": dict(by_reason),
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
                "frames": tally["frames"],
                "bytes": tally["bytes"],
                "max_per_video": tally["max_per_video"],
            },
            "artifacts": [
                str(out_dir / "rejects.jsonl"),
                str(out_dir / ".nv-meta" / "dataset.yaml"),
            ],
        },
        seconds=time.perf_counter() - t0,
    )
    write_record(cfg, result)
    return result


def _keep_rejects(cfg: PipelineConfig, path: Path) -> None:
    """Copy the rejects next to the work dir so a failed stage still shows them."""
    (cfg.work_path / "prepare.rejects.jsonl").write_bytes(path.read_bytes())
