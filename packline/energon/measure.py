"""Measuring every sample of a prepared dataset: Energon's loader over one task's share, a
task encoder that gives each sample's exact and cheap lengths as the train backend renders
it, and the parts a killed measurement resumes from (:mod:`packline.energon.parts`). connect
calls :func:`measure_share` once per task, then :func:`lengths_table` over every task's
parts; :func:`bridge_video_summary` says what Megatron-Bridge's encoder makes of the videos.
"""

from __future__ import annotations

import io
import json
import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import pandas as pd
from megatron.energon import (
    Cooker,
    WorkerConfig,
    edataclass,
    get_savable_loader,
    get_train_dataset,
    get_val_dataset,
    stateless,
)

from packline.energon.bridge_sample_loader import frame_parts
from packline.energon.chatml import SOURCE_SUBFLAVOR
from packline.energon.loader import quiet_pin_memory
from packline.energon.parts import PartState, Task, TaskParts
from packline.energon.sample import (
    ConversationReader,
    ConversationSample,
    cook_chatml,
    cook_conversation,
)
from packline.progress import progress
from packline.qwen.vision import read_image_size
from schemas.errors import UserError

LENGTH_COLUMNS = [
    "key",
    "split",
    "text_tokens",
    "image_tokens",
    "num_images",
    "total_tokens",
    "loss_tokens",
    "image_grids",
    "images_moved",
    "video_tokens",
    "num_videos",
    "video_frames",
    "video_grids",
    "video_frame_counts",
]
VisualRule = Callable[[int, int], int]


@edataclass
class MeasuredSample(ConversationSample):
    """A prepared sample with what Megatron-Bridge reads of its videos besides."""

    #: Each video's pre-sampled frames as prepare stored them for Bridge (PNG bytes, in
    #: order; empty lists when the dataset was prepared for the local backend).
    video_frames: list[list[bytes]]
    #: Each video's sampled frame indices and source fps (the JSON's ``"presampled"``).
    presampled: list[dict[str, Any]]


def _measured(sample: ConversationSample, **extra: Any) -> MeasuredSample:
    fields = {f: getattr(sample, f) for f in sample.__dataclass_fields__}
    return MeasuredSample(**fields, **extra)


@stateless
def cook_measured(raw: dict[str, Any]) -> MeasuredSample:
    """Crude WebDataset dict → :class:`MeasuredSample` (pixels stay encoded)."""
    return _measured(
        cook_conversation(raw),
        video_frames=[[raw[k] for k in keys] for keys in frame_parts(raw)],
        presampled=json.loads(raw["json"]).get("presampled", []),
    )


@stateless
def cook_measured_chatml(raw: dict[str, Any]) -> MeasuredSample:
    """A sample of an Energon dataset adopted in place → :class:`MeasuredSample` (no video)."""
    return _measured(cook_chatml(raw), video_frames=[], presampled=[])


class LengthReader(ConversationReader):
    """Energon task encoder that measures each sample both ways (exact and cheap), rendered
    as the train backend will render it, and returns its row of a part
    (:data:`packline.energon.parts.PART_COLUMNS`).

    ``bridge=False`` (the local backend): images stay where their markers stand and the
    processor resizes them once. ``bridge=True`` (``train.backend: megatron``): each turn's
    images move before its text and each image first goes through qwen-vl-utils'
    ``fetch_image``, as Megatron-Bridge's Qwen-VL encoder does.

    Videos, local backend: the exact count gets every decoded frame of the file and its
    probed frame count and rate (the processor samples), the cheap one the probed header
    only. Backend megatron: what Bridge reads, each video's pre-sampled frames
    (``<key>.vid<k>.f<j>.png``), through Bridge's steps (:class:`~packline.qwen.vision.
    BridgeVideoRule`): exact, the first ``max_num_frames`` frames through qwen-vl-utils'
    ``fetch_video`` and the processor called as Bridge calls it (no fps, no metadata, the
    dir's ``do_sample_frames``); cheap, the rule from the recorded frame count and the
    header's size.

    ``verify_keys``: the samples the processor measures (None: every one); any other gets
    the cheap record as its lengths, and no pixel or frame of it is decoded. ``skip_keys``:
    samples already in a finished part; one that comes again is returned as ``{"key": ...,
    "skip": True}``, unmeasured (see :func:`measure_share`).
    """

    cookers = [
        Cooker(cook_measured_chatml, has_subflavors={SOURCE_SUBFLAVOR: "chatml"}),
        Cooker(cook_measured),
    ]

    def __init__(
        self,
        processor_dir: Path,
        visual_tokens: VisualRule | None = None,
        *,
        bridge: bool = False,
        max_num_frames: int | None = None,
        verify_keys: frozenset[str] | None = None,
        skip_keys: frozenset[str] = frozenset(),
    ):
        super().__init__()
        self.processor_dir = Path(processor_dir)
        self.visual_tokens = visual_tokens
        self.bridge = bridge
        if bridge and max_num_frames is None:
            raise ValueError("measuring as Megatron-Bridge needs its max_num_frames")
        self.max_num_frames = max_num_frames
        self.verify_keys = verify_keys
        self.skip_keys = skip_keys
        self._processor = None
        self._geometry = None
        self._bridge_videos = None

    @property
    def processor(self):
        if self._processor is None:  # loaded once per worker process
            from packline.qwen.processor import load_processor, processor_geometry
            from packline.qwen.vision import BridgeVideoRule

            self._processor = load_processor(self.processor_dir)
            geometry = processor_geometry(self._processor)
            self._geometry = geometry.with_overrides(qwen_vl_utils_resize=self.bridge)
            if self.bridge:
                self._bridge_videos = BridgeVideoRule.of(
                    self._processor, max_num_frames=self.max_num_frames
                )
        return self._processor

    def _bridge_plans(self, sample: MeasuredSample, headers: list) -> tuple[list, list]:
        """Bridge's view of the sample's videos without decoding a frame: the cheap plans,
        and per video the facts connect reports."""
        from packline.qwen.processor import processor_video_geometry

        rule = self._bridge_videos
        if len(sample.video_frames) != len(headers) or len(sample.presampled) != len(headers):
            raise ValueError(
                f"{sample.__key__}: {len(headers)} videos but the pre-sampled frames of "
                f"{len(sample.video_frames)} ({len(sample.presampled)} recorded): the dataset "
                "was not prepared for train.backend megatron (rerun prepare with it)"
            )
        local = processor_video_geometry(self.processor)
        plans, facts = [], []
        for parts, chosen, h in zip(sample.video_frames, sample.presampled, headers, strict=True):
            indices = chosen["indices"]
            if len(parts) != len(indices):
                raise ValueError(
                    f"{sample.__key__}: a video has {len(parts)} frame parts but "
                    f"{len(indices)} sampled indices recorded"
                )
            n, kept = len(indices), rule.kept(len(indices))
            plan = rule.plan(n, h.height, h.width)
            plans.append(plan)
            # the source frames behind each position Bridge's processor takes (the kept ones,
            # the last repeated to an even count): their real times, as packline renders them
            padded = indices[:kept] + indices[kept - 1 : kept] * (kept % 2)
            source = [padded[p] for p in rule.positions(n)]
            bridge_ts = rule.timestamps(n)
            real_ts = local.timestamps(h.num_frames, chosen["fps"], indices=source)
            facts.append(
                {
                    "frames": n,
                    "kept": kept,
                    "seen": plan.num_frames,
                    "timestamps": [f"<{t:.1f} seconds>" for t in bridge_ts],
                    "real": [f"<{t:.1f} seconds>" for t in real_ts],
                    "error": max(abs(a - b) for a, b in zip(bridge_ts, real_ts, strict=True)),
                }
            )
        return plans, facts

    def _bridge_frames(self, sample: MeasuredSample) -> list:
        """The exact inputs of Bridge's videos: each one's kept frames, decoded, through
        qwen-vl-utils."""
        from PIL import Image

        from packline.qwen.lengths import PresampledVideo
        from packline.qwen.vision import bridge_fetch_video

        out = []
        for parts in sample.video_frames:
            kept = self._bridge_videos.kept(len(parts))
            frames = [Image.open(io.BytesIO(b)).convert("RGB") for b in parts[:kept]]
            out.append(PresampledVideo(bridge_fetch_video(frames), kept))
        return out

    def encode_sample(self, sample: MeasuredSample) -> dict[str, Any]:
        from PIL import Image

        from packline.media.video import VideoHeader, decode_frames
        from packline.qwen.lengths import DecodedVideo, cheap_lengths, exact_lengths, media_first
        from packline.qwen.vision import bridge_fetch_image

        if sample.__key__ in self.skip_keys:
            return {"key": sample.__key__, "skip": True}
        processor = self.processor
        sizes = [read_image_size(b) for b in sample.images]
        rendered = media_first(sample.conversation)
        moved = rendered != sample.conversation
        conversation = rendered if self.bridge else sample.conversation
        headers = [VideoHeader.from_dict(h) for h in sample.video_headers]
        plans, facts = None, []
        if self.bridge:
            plans, facts = self._bridge_plans(sample, headers)
        cheap = cheap_lengths(
            processor,
            conversation,
            sizes,
            visual_tokens=self.visual_tokens or self._geometry.visual_tokens,
            video_headers=() if self.bridge else headers,
            video_plans=plans,
            turn_newline=self.bridge,
        )
        verified = self.verify_keys is None or sample.__key__ in self.verify_keys
        exact = cheap
        if verified:  # the real processor: every pixel and (local backend) every frame decoded
            images = [Image.open(io.BytesIO(b)) for b in sample.images]
            if self.bridge:
                images = [bridge_fetch_image(image) for image in images]
                videos = self._bridge_frames(sample)
            else:
                videos = [
                    DecodedVideo(decode_frames(data, range(h.num_frames), rotation=h.rotation), h)
                    for data, h in zip(sample.videos, headers, strict=True)
                ]
            exact = exact_lengths(
                processor, conversation, images, videos=videos, turn_newline=self.bridge
            )
        grids = [list(self._geometry.grid_thw(h, w)) for w, h in sizes]
        return {
            "key": sample.__key__,
            "verified": verified,
            "exact": json.dumps(_record(exact)),
            "cheap": json.dumps(_record(cheap)),
            "image_grids": json.dumps(grids),
            "images_moved": moved,
            "video_grids": json.dumps([list(g) for g in exact.video_grids]),
            "video_frame_counts": json.dumps(list(exact.video_frame_counts)),
            # per video, what Bridge's encoder makes of it
            "bridge_videos": json.dumps(facts),
        }


def _record(lengths) -> dict[str, int]:
    """A :class:`~packline.qwen.lengths.LengthRecord` as the table's count columns (its
    video grids go in their own JSON column)."""
    out = asdict(lengths)
    out.pop("video_grids")
    out["video_frame_counts"] = list(out["video_frame_counts"])
    return out


@dataclass(frozen=True)
class Measuring:
    """What every connect task measures with: the same for all tasks of a run."""

    dataset: Path
    """What Energon opens (:func:`stages.base.dataset_path`)."""
    processor: Path
    splits: tuple[str, ...]
    """The splits prepare's manifest holds, in order."""
    num_workers: int
    part_size: int
    verify_keys: frozenset[str] | None
    """The samples the processor measures (None: every one)."""
    visual_tokens: VisualRule | None = None
    bridge: bool = False
    max_num_frames: int | None = None

    def encoder(self, skip_keys: frozenset[str] = frozenset()) -> LengthReader:
        return LengthReader(
            self.processor,
            self.visual_tokens,
            bridge=self.bridge,
            max_num_frames=self.max_num_frames,
            verify_keys=self.verify_keys,
            skip_keys=skip_keys,
        )


def share_loader(m: Measuring, split: str, task: Task, encoder: LengthReader):
    """A savable loader of task ``task``'s share of ``split``: Energon's
    ``WorkerConfig(rank, world_size, num_workers)`` split of the samples (the union of the
    ranks' shares is every sample once), read once in order (no repeat, no shuffle buffer,
    no cap on the samples read in a row from a shard), one sample per batch.

    Each worker keeps a checkpoint after every sample (not every 60 s, Energon's default):
    a restored state then starts at the sample after the part's last, instead of encoding,
    i.e. measuring, the samples since an older checkpoint once more to skip them."""
    wc = WorkerConfig(rank=task.rank, world_size=task.world, num_workers=m.num_workers)
    common = dict(batch_size=1, task_encoder=encoder, worker_config=wc)
    if split == "train":
        ds = get_train_dataset(
            m.dataset,
            split_part=split,
            shuffle_buffer_size=None,
            max_samples_per_sequence=None,
            repeat=False,
            **common,
        )
    else:
        ds = get_val_dataset(m.dataset, split_part=split, **common)
    return get_savable_loader(ds, checkpoint_every_sec=0, checkpoint_every_min_n_samples=1)


def measure_share(m: Measuring, parts: TaskParts, *, attempt: str) -> dict[str, Any]:
    """Measure task ``parts.task``'s share of every split, writing a part after every
    ``m.part_size`` samples and one closing each split; resume after the last finished part
    of an earlier run. Returns what the task's ``.done`` file records (also written).

    A resumed loader continues after the part's last sample, with one exception Energon 7.4
    has: a worker that had read its whole share before the part ended restores as a fresh
    epoch and reads that share again. Those samples are all in finished parts; the encoder
    (``skip_keys``) returns them unmeasured and they are dropped here, counted as
    ``replayed``."""
    quiet_pin_memory()
    t0 = time.perf_counter()
    task = parts.task
    finished = parts.clean()
    info: dict[str, Any] = {
        "rank": task.rank,
        "world": task.world,
        "attempt": attempt,
        "parts_resumed": len(finished),
        "samples_resumed": sum(state.samples for _, state in finished),
    }
    last: dict[str, PartState] = {}
    seen: dict[str, set[str]] = {split: set() for split in m.splits}
    for path, state in finished:
        last[state.split] = state
        seen[state.split].update(pd.read_parquet(path, columns=["key"])["key"])
    k, tally = len(finished), Counter()
    name = "connect lengths" + (f" (task {task.rank} of {task.world})" if task.world > 1 else "")
    with progress() as bar:
        for split in m.splits:
            if split in last and last[split].split_done:
                continue
            loader = share_loader(m, split, task, m.encoder(frozenset(seen[split])))
            if split in last:
                loader.restore_state_rank(last[split].loader)
            shown = bar.add_task(f"{name}: {split}", total=max(len(loader) - len(seen[split]), 0))
            rows: list[dict[str, Any]] = []
            for batch in loader:
                for row in batch:
                    if row.get("skip"):
                        tally["replayed"] += 1
                        continue
                    rows.append({**row, "split": split})
                    bar.advance(shown)
                if len(rows) >= m.part_size:
                    state = PartState(split, len(rows), False, loader.save_state_rank())
                    k, rows = _write_part(parts, k, rows, state, tally), []
            k = _write_part(parts, k, rows, PartState(split, len(rows), True, None), tally)
            del loader  # its worker processes end here, not at the next split
    info.update(
        {
            "parts": k,
            "samples": info["samples_resumed"] + tally["measured"],
            "samples_measured": tally["measured"],
            "verified_measured": tally["verified"],
            "replayed": tally["replayed"],
            "seconds": round(time.perf_counter() - t0, 3),
        }
    )
    parts.mark_done(info)
    return info


def _write_part(
    parts: TaskParts, k: int, rows: list[dict[str, Any]], state: PartState, tally: Counter
) -> int:
    """Write part ``k`` and count it; the next part's number."""
    parts.write(k, rows, state)
    tally["measured"] += len(rows)
    tally["verified"] += sum(bool(row["verified"]) for row in rows)
    return k + 1


def verify_keys(keys: list[str], sample: int | None, seed: int) -> frozenset[str] | None:
    """The samples the processor measures: every one (None) when ``sample`` is None
    (``connect.verify: all``), else a seeded sample of that many of the manifest's keys
    (``seed``: ``train.seed``): the same for every task.

    >>> sorted(verify_keys(["a", "b", "c", "d"], 2, seed=0))
    ['b', 'd']
    """
    if sample is None:
        return None
    return frozenset(random.Random(seed).sample(sorted(keys), min(sample, len(keys))))


def _mismatch(key: str, exact: dict[str, Any], cheap: dict[str, Any]) -> str:
    return (
        f"{key}: the processor counts {exact['total_tokens']} tokens "
        f"({exact['image_tokens']} image, {exact['loss_tokens']} loss), the "
        f"cheap rule {cheap['total_tokens']} ({cheap['image_tokens']} image, "
        f"{cheap['loss_tokens']} loss)"
    )


def lengths_table(records: pd.DataFrame, manifest: pd.DataFrame) -> pd.DataFrame:
    """The parts' rows of every task (``records``) as connect's lengths table, one row per
    manifest key, sorted by split and key. The processor must agree with the cheap rule on
    every sample it measured, and every manifest key must have come out of the loader:
    otherwise a UserError lists them."""
    twice = sorted(set(records["key"][records["key"].duplicated()]))
    if twice:  # an internal invariant: Energon's shares are disjoint, resumes skip done keys
        raise RuntimeError(f"connect: {len(twice)} samples measured twice, e.g. {twice[:5]}")
    exact = [json.loads(x) for x in records["exact"]]
    cheap = [json.loads(x) for x in records["cheap"]]
    verified = records["verified"].astype(bool).tolist()
    mismatches = [
        _mismatch(key, e, c)
        for key, e, c, v in zip(records["key"], exact, cheap, verified, strict=True)
        if v and e != c
    ]
    if mismatches:
        raise UserError(
            mismatches[:50]
            + ([f"... and {len(mismatches) - 50} more"] if len(mismatches) > 50 else []),
            f"connect: the cheap length rule disagrees with the processor on "
            f"{len(mismatches)} of {sum(verified)} samples",
        )
    missing = sorted(set(manifest["key"]) - set(records["key"]))
    if missing:
        raise UserError(
            [f"{len(missing)} manifest keys never came out of the loader, e.g. {missing[:5]}"],
            "connect: samples lost between prepare and connect",
        )
    df = pd.DataFrame(
        [
            {
                "key": key,
                "split": split,
                **e,
                "image_grids": grids,
                "images_moved": bool(moved),
                "video_grids": video_grids,
                "video_frame_counts": counts,
            }
            for key, split, e, grids, moved, video_grids, counts in zip(
                records["key"],
                records["split"],
                exact,
                records["image_grids"],
                records["images_moved"],
                records["video_grids"],
                records["video_frame_counts"],
                strict=True,
            )
        ],
        columns=LENGTH_COLUMNS,
    )
    return df[LENGTH_COLUMNS].sort_values(["split", "key"], kind="stable").reset_index(drop=True)


# --- what Megatron-Bridge's encoder makes of the videos (train.backend megatron) --------------


def bridge_video_summary(
    records: pd.DataFrame, *, max_num_frames: int, do_sample_frames: bool
) -> dict[str, Any]:
    """What Bridge's encoder makes of the videos (``bridge_videos.json``) of ``records``
    (parts' rows: ``key`` and ``bridge_videos``, JSON): the frames it keeps of each video's
    pre-sampled ones (``max_num_frames``), those its processor drops by re-sampling
    (``do_sample_frames``), and its timestamps (frame positions over 24 fps) against the real
    times of the frames behind them."""
    from qwen_vl_utils import vision_process

    videos = [
        (key, v)
        for key, facts in zip(records["key"], records["bridge_videos"], strict=True)
        for v in json.loads(facts)
    ]

    def part(rows: list[tuple[str, dict]]) -> dict[str, Any]:
        return {
            "videos": len(rows),
            "samples": len({key for key, _ in rows}),
            "examples": sorted({key for key, _ in rows})[:3],
        }

    truncated = [(k, v) for k, v in videos if v["kept"] < v["frames"]]
    resampled = [(k, v) for k, v in videos if v["seen"] < v["kept"]]
    differing = [(k, v) for k, v in videos if v["timestamps"] != v["real"]]
    worst = max(videos, key=lambda kv: kv[1]["error"], default=None)
    groups = [(a, b) for _, v in videos for a, b in zip(v["timestamps"], v["real"], strict=True)]
    return {
        "max_num_frames": max_num_frames,
        "do_sample_frames": do_sample_frames,
        # qwen-vl-utils bounds a long clip's frames by MODEL_SEQ_LEN (an environment variable,
        # read where it is imported): measured with this one, Bridge's process must have it
        "model_seq_len": vision_process.MODEL_SEQ_LEN,
        "videos": len(videos),
        "samples": len({key for key, _ in videos}),
        "presampled_frames": sum(v["frames"] for _, v in videos),
        "max_presampled_frames": max((v["frames"] for _, v in videos), default=0),
        "truncated": {
            **part(truncated),
            "frames_dropped": sum(v["frames"] - v["kept"] for _, v in truncated),
        },
        "resampled": {
            **part(resampled),
            "frames_dropped": sum(v["kept"] - v["seen"] for _, v in resampled),
        },
        "timestamps": {
            **part(differing),
            "groups": len(groups),
            "groups_differing": sum(a != b for a, b in groups),
            "max_error_seconds": worst[1]["error"] if worst else 0.0,
            "worst": None
            if worst is None
            else {
                "key": worst[0],
                "bridge": worst[1]["timestamps"],
                "real": worst[1]["real"],
            },
        },
    }


def bridge_video_metrics(summary: dict[str, Any]) -> dict[str, float]:
    """connect's metrics of :func:`bridge_video_summary` (validate warns with the same)."""
    return {
        "connect/bridge_videos_truncated": summary["truncated"]["videos"],
        "connect/bridge_frames_truncated": summary["truncated"]["frames_dropped"],
        "connect/bridge_videos_resampled": summary["resampled"]["videos"],
        "connect/bridge_frames_resampled_away": summary["resampled"]["frames_dropped"],
        "connect/bridge_videos_timestamps_differ": summary["timestamps"]["videos"],
    }


def verify_line(verify: dict[str, Any]) -> str:
    """The console line that says what the processor checked (the record's ``verify``).

    >>> verify_line({"mode": "all", "samples": 2200, "of": 2200, "seed": None})
    'connect: the processor measured all 2,200 samples and agrees with the cheap rule on each'
    """
    if verify["mode"] == "all":
        return (
            f"connect: the processor measured all {verify['of']:,} samples and agrees with "
            "the cheap rule on each"
        )
    return (
        f"connect: the processor measured a seeded sample of {verify['samples']:,} of "
        f"{verify['of']:,} samples (seed {verify['seed']}) and agrees with the cheap rule on "
        f"each; the other {verify['of'] - verify['samples']:,} have the cheap rule's lengths"
    )
