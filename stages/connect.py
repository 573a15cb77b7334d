"""Stage connect: the processor meets the data — exact token lengths of every sample.

Outputs in ``<work>/connect/``::

    processor/              the processor dir every later stage loads (tiny one built here,
                            or a copy of ``processor.path``)
    lengths.parquet         key, split, text/image/total/loss tokens, images (exact)
    forecast.json           packing fill per buffer size and the lower bound
    length_histogram.png    distribution of conversation lengths vs seq_length
    bridge_videos.json      train.backend megatron with videos: what Bridge's encoder makes of
                            them (frames kept, re-sampled, its timestamps against the real
                            ones), the figures validate warns with

The real processor runs on every sample once, through Energon's loader. The cheap rule
(image size from the file header → the resize rule → visual tokens, plus tokenized text) is
computed too and must equal the processor's count for every sample: the packer's large
buffers rely on it being exact. Any mismatch fails the stage and is listed.
"""

from __future__ import annotations

import io
import json
import random
import shutil
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pandas as pd
from megatron.energon import (
    Cooker,
    WorkerConfig,
    edataclass,
    get_loader,
    get_train_dataset,
    get_val_dataset,
    stateless,
)

from packline.energon.bridge_sample_loader import frame_parts
from packline.energon.sample import ConversationReader, ConversationSample, cook_conversation
from packline.packing.forecast import simulate_packing
from packline.packing.selection import align_up
from packline.progress import console, progress
from packline.qwen.processor import TINY_LAYOUT_VERSION
from packline.qwen.vision import read_image_size
from schemas.config import Algorithm, PipelineConfig, TrainBackend
from schemas.errors import UserError
from schemas.guardrails import train_nproc_per_node, train_world
from schemas.tables import LengthsModel, validate_table
from stages.base import (
    PROCESSOR,
    StageResult,
    building,
    dataset_dir,
    fingerprint,
    hash_tree,
    processor_dir,
    require_record,
    stage_dir,
    write_record,
)
from stages.prepare import image_geometry

STAGE = "connect"
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
BRIDGE_VIDEOS = "bridge_videos.json"


@edataclass
class MeasuredSample(ConversationSample):
    """A prepared sample with what Megatron-Bridge reads of its videos besides."""

    #: Each video's pre-sampled frames as prepare stored them for Bridge (PNG bytes, in
    #: order; empty lists when the dataset was prepared for the local backend).
    video_frames: list[list[bytes]]
    #: Each video's sampled frame indices and source fps (the JSON's ``"presampled"``).
    presampled: list[dict[str, Any]]


@stateless
def cook_measured(raw: dict[str, Any]) -> MeasuredSample:
    """Crude WebDataset dict → :class:`MeasuredSample` (pixels stay encoded)."""
    sample = cook_conversation(raw)
    fields = {f: getattr(sample, f) for f in sample.__dataclass_fields__}
    return MeasuredSample(
        **fields,
        video_frames=[[raw[k] for k in keys] for keys in frame_parts(raw)],
        presampled=json.loads(raw["json"]).get("presampled", []),
    )


class LengthReader(ConversationReader):
    """Energon task encoder that measures each sample both ways (exact and cheap), rendered
    as the train backend will render it.

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
    """

    cookers = [Cooker(cook_measured)]

    def __init__(
        self,
        processor_dir: Path,
        visual_tokens: VisualRule | None = None,
        *,
        bridge: bool = False,
        max_num_frames: int | None = None,
    ):
        super().__init__()
        self.processor_dir = Path(processor_dir)
        self.visual_tokens = visual_tokens
        self.bridge = bridge
        if bridge and max_num_frames is None:
            raise ValueError("measuring as Megatron-Bridge needs its max_num_frames")
        self.max_num_frames = max_num_frames
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

    def _bridge_videos_of(self, sample: MeasuredSample, headers: list) -> tuple[list, list, list]:
        """Bridge's view of the sample's videos: the exact inputs (each video's kept frames
        through qwen-vl-utils), the cheap plans, and per video the facts connect reports."""
        from PIL import Image

        from packline.qwen.lengths import PresampledVideo
        from packline.qwen.processor import processor_video_geometry
        from packline.qwen.vision import bridge_fetch_video

        rule = self._bridge_videos
        if len(sample.video_frames) != len(headers) or len(sample.presampled) != len(headers):
            raise ValueError(
                f"{sample.__key__}: {len(headers)} videos but the pre-sampled frames of "
                f"{len(sample.video_frames)} ({len(sample.presampled)} recorded): the dataset "
                "was not prepared for train.backend megatron (rerun prepare with it)"
            )
        local = processor_video_geometry(self.processor)
        exact, plans, facts = [], [], []
        for parts, chosen, h in zip(sample.video_frames, sample.presampled, headers, strict=True):
            indices = chosen["indices"]
            if len(parts) != len(indices):
                raise ValueError(
                    f"{sample.__key__}: a video has {len(parts)} frame parts but "
                    f"{len(indices)} sampled indices recorded"
                )
            n, kept = len(indices), rule.kept(len(indices))
            frames = [Image.open(io.BytesIO(b)).convert("RGB") for b in parts[:kept]]
            exact.append(PresampledVideo(bridge_fetch_video(frames), kept))
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
        return exact, plans, facts

    def encode_sample(self, sample: MeasuredSample) -> dict[str, Any]:
        from PIL import Image

        from packline.qwen.lengths import DecodedVideo, cheap_lengths, exact_lengths, media_first
        from packline.qwen.vision import bridge_fetch_image
        from packline.video import VideoHeader, decode_frames

        processor = self.processor
        sizes = [read_image_size(b) for b in sample.images]
        images = [Image.open(io.BytesIO(b)) for b in sample.images]
        rendered = media_first(sample.conversation)
        moved = rendered != sample.conversation
        conversation = sample.conversation
        headers = [VideoHeader.from_dict(h) for h in sample.video_headers]
        plans, facts = None, []
        if self.bridge:
            conversation = rendered
            images = [bridge_fetch_image(image) for image in images]
            videos, plans, facts = self._bridge_videos_of(sample, headers)
        else:
            videos = [
                DecodedVideo(decode_frames(data, range(h.num_frames), rotation=h.rotation), h)
                for data, h in zip(sample.videos, headers, strict=True)
            ]
        exact = exact_lengths(
            processor, conversation, images, videos=videos, turn_newline=self.bridge
        )
        cheap = cheap_lengths(
            processor,
            conversation,
            sizes,
            visual_tokens=self.visual_tokens or self._geometry.visual_tokens,
            video_headers=() if self.bridge else headers,
            video_plans=plans,
            turn_newline=self.bridge,
        )
        grids = [list(self._geometry.grid_thw(h, w)) for w, h in sizes]
        return {
            "key": sample.__key__,
            "exact": _record(exact),
            "cheap": _record(cheap),
            "image_grids": json.dumps(grids),
            "images_moved": moved,
            "video_grids": json.dumps([list(g) for g in exact.video_grids]),
            "video_frame_counts": json.dumps(list(exact.video_frame_counts)),
            "bridge_videos": facts,  # per video, what Bridge's encoder makes of it
        }


def _record(lengths) -> dict[str, int]:
    """A :class:`~packline.qwen.lengths.LengthRecord` as the table's count columns (its
    video grids go in their own JSON column)."""
    out = asdict(lengths)
    out.pop("video_grids")
    out["video_frame_counts"] = list(out["video_frame_counts"])
    return out


def renders_for_bridge(cfg: PipelineConfig) -> bool:
    """Whether connect measures as Megatron-Bridge renders (``train.backend: megatron``)."""
    return cfg.train.backend == TrainBackend.megatron


def bridge_max_num_frames(cfg: PipelineConfig) -> int:
    """The ``max_num_frames`` Bridge's encoder gets (see
    :func:`stages.megatron_overrides.max_num_frames`)."""
    from stages.megatron_overrides import max_num_frames

    return max_num_frames(cfg)


def bridge_video_summary(
    records: list[tuple[str, dict[str, Any]]], *, max_num_frames: int, do_sample_frames: bool
) -> dict[str, Any]:
    """What Bridge's encoder makes of the videos (``bridge_videos.json``): the frames it
    keeps of each video's pre-sampled ones (``max_num_frames``), those its processor drops by
    re-sampling (``do_sample_frames``), and its timestamps (frame positions over 24 fps)
    against the real times of the frames behind them."""
    from qwen_vl_utils import vision_process

    videos = [(rec["key"], v) for _, rec in records for v in rec.get("bridge_videos", [])]

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


def processor_source(cfg: PipelineConfig) -> Path | None:
    return Path(cfg.processor.path).expanduser().resolve() if cfg.processor.path else None


def fingerprint_inputs(cfg: PipelineConfig) -> str:
    from stages import prepare

    src = processor_source(cfg)
    return fingerprint(
        prepare.fingerprint_inputs(cfg),
        cfg.section_hash("processor"),
        hash_tree(src, content=True) if src else f"tiny-{TINY_LAYOUT_VERSION}",
        {
            "seq_length": cfg.packing.seq_length,
            "alignment": cfg.packing.alignment,
            "algorithm": cfg.packing.algorithm.value,
            "buffers": list(cfg.packing.forecast_buffer_sizes),
            "seed": cfg.train.seed,
            "bridge": renders_for_bridge(cfg),
            # Bridge keeps the first max_num_frames frames of a video: measured so
            **({"max_num_frames": bridge_max_num_frames(cfg)} if renders_for_bridge(cfg) else {}),
        },
    )


def materialize_processor(cfg: PipelineConfig, out: Path) -> Path:
    """Put the processor dir under ``out/processor``: a copy of the user's, or the tiny one,
    with the geometry the config sets (``processor.min_pixels`` ...) written into it, so that
    every later reader of the dir (connect itself, the local trainer, Bridge) resizes alike.

    For ``train.backend: megatron`` its video processor also gets ``do_sample_frames:
    false``: Bridge calls the processor without it (and without a frame rate), so the dir's
    value decides, and Qwen3-VL's own ``true`` would re-sample prepare's pre-sampled frames
    under an assumed 24 fps, keeping a few of them (4 of 12 at 2 fps). packline's own calls
    say ``do_sample_frames`` explicitly, so the local path does not read it."""
    from packline.qwen.processor import copy_tiny_processor, load_processor, processor_geometry
    from packline.qwen.vision import set_processor_geometry, set_video_sampling

    dest = out / PROCESSOR
    src = processor_source(cfg)
    if src is None:
        copy_tiny_processor(dest)  # from the cache: the bytes a fresh build writes
    else:
        shutil.copytree(src, dest)
    if overrides := cfg.processor.geometry_overrides():
        set_processor_geometry(dest, **overrides)
    if renders_for_bridge(cfg):
        set_video_sampling(dest, do_sample_frames=False)
    processor = load_processor(dest)  # fails here, with the loader's message
    loaded = processor_geometry(processor)
    wanted = image_geometry(cfg)
    if loaded != wanted:
        raise UserError(
            [f"{dest} resizes with {loaded}, the config asks for {wanted}"],
            "connect: the processor dir does not take the configured geometry",
        )
    if renders_for_bridge(cfg) and processor.video_processor.do_sample_frames:
        raise UserError(
            [f"{dest} still samples video frames (do_sample_frames) after connect set it off"],
            "connect: the processor dir does not take Megatron-Bridge's video settings",
        )
    return dest


def measure_lengths(
    dataset_dir: Path,
    processor_dir: Path,
    *,
    num_workers: int,
    visual_tokens: VisualRule | None = None,
    expected: int | None = None,
    bridge: bool = False,
    max_num_frames: int | None = None,
) -> list[tuple[str, dict[str, Any]]]:
    """(split, record) for every sample of the prepared dataset, through Energon, rendered
    as Megatron-Bridge renders it when ``bridge`` (see :class:`LengthReader`)."""
    # Energon's loader asks for pinned memory; on a CPU-only machine torch warns each time.
    warnings.filterwarnings("ignore", message=".*pin_memory.*no accelerator.*")
    records: list[tuple[str, dict[str, Any]]] = []
    encoder = LengthReader(
        processor_dir, visual_tokens, bridge=bridge, max_num_frames=max_num_frames
    )
    common = dict(batch_size=1, task_encoder=encoder)
    with progress() as bar:
        task = bar.add_task("connect lengths", total=expected)
        for split in ("train", "val"):
            if not any(dataset_dir.glob(f"{split}-*.tar")):
                continue
            wc = WorkerConfig(rank=0, world_size=1, num_workers=num_workers)
            if split == "train":
                ds = get_train_dataset(
                    dataset_dir,
                    split_part="train",
                    worker_config=wc,
                    shuffle_buffer_size=None,
                    max_samples_per_sequence=None,
                    repeat=False,
                    **common,
                )
            else:
                ds = get_val_dataset(dataset_dir, split_part="val", worker_config=wc, **common)
            for batch in get_loader(ds):
                for rec in batch:
                    records.append((split, rec))
                    bar.advance(task)
    return records


def data_parallel_ranks(cfg: PipelineConfig) -> int:
    """Data-parallel ranks the train backend reads data with (Energon's
    ``WorkerConfig.world_size``; each has ``train.num_workers`` loader workers):

    - backend megatron: the SLURM train job's GPUs, ``nodes × (nproc_per_node or
      gpus_per_node)``, over TP × CP × PP (Bridge gives Energon the pure DP group; EP and
      sequence parallel split no data);
    - backend local: the train run's ranks (every process of the SLURM train job, else
      ``train.nproc_per_node``) over ``train.parallel.pipeline_parallel`` (the stages of a
      pipeline read the same rows; EP splits no data)."""
    pp = cfg.train.parallel.pipeline_parallel
    if cfg.train.backend is TrainBackend.megatron:
        s = cfg.executor.slurm
        job = s.nodes * train_nproc_per_node(cfg)
        p = cfg.packing
        return max(job // (p.tensor_parallel * p.context_parallel * pp), 1)
    return max(train_world(cfg) // pp, 1)


def forecast_settings(cfg: PipelineConfig) -> dict[str, Any]:
    """How the forecast simulates ``cfg``'s packer (``simulate_packing``'s keywords): the
    train backend, its selection — plain ``ffd`` for backend megatron, as Bridge runs
    whatever ``packing.algorithm`` says (validate refuses any other there), else
    ``packing.algorithm`` — and its loader streams, ranks × ``train.num_workers``."""
    megatron = cfg.train.backend is TrainBackend.megatron
    return {
        "backend": cfg.train.backend.value,
        "algorithm": "ffd" if megatron else cfg.packing.algorithm.value,
        "num_ranks": data_parallel_ranks(cfg),
        "num_workers": cfg.train.num_workers,
    }


def stream_order(num_samples: int, seed: int) -> list[int]:
    """The forecast's sample stream: table positions in a seeded shuffle (Energon's
    shuffled reading order, approximately)."""
    order = list(range(num_samples))
    random.Random(seed).shuffle(order)
    return order


def forecast_fill(
    lengths: list[int],
    capacity: int,
    buffer_sizes: list[int],
    algorithm: Algorithm | str,
    seed: int,
    *,
    backend: str = "local",
    num_ranks: int = 1,
    num_workers: int = 0,
) -> dict[str, Any]:
    """Fill of packing ``lengths`` (already aligned; any over ``capacity`` are handled as
    ``backend`` does: see ``packline.packing.forecast``) in a seeded stream order, one
    buffer of B samples per loader stream at a time, for each B; and the lower bound
    Σlen/(⌈Σlen/C⌉·C) over the samples that fit."""
    algorithm = algorithm.value if isinstance(algorithm, Algorithm) else algorithm
    stream = [lengths[i] for i in stream_order(len(lengths), seed)]
    fits = [n for n in stream if n <= capacity]
    total = sum(fits)
    out: dict[str, Any] = {
        "capacity": capacity,
        "samples": len(fits),
        "tokens": total,
        "backend": backend,
        "algorithm": algorithm,
        "num_ranks": num_ranks,
        "num_workers": num_workers,
    }
    per_buffer = {}
    for b in buffer_sizes:
        simulated = simulate_packing(
            stream,
            capacity=capacity,
            buffer_size=b,
            algorithm=algorithm,
            backend=backend,
            num_ranks=num_ranks,
            num_workers=num_workers,
        )
        per_buffer[str(b)] = {"packs": simulated.packs, "fill": simulated.fill}
    out["buffers"] = per_buffer
    min_packs = -(-total // capacity)
    out["lower_bound"] = {
        "packs": min_packs,
        "fill": total / (min_packs * capacity) if min_packs else 0.0,
    }
    out["unpacked"] = {
        "rows": len(fits),
        "fill": total / (len(fits) * capacity) if fits else 0.0,
    }
    return out


def forecast_flops(
    cfg: PipelineConfig, processor_dir: Path, train: pd.DataFrame
) -> dict[str, float]:
    """FLOPs and tokens of one training epoch with packing on (the packs
    :func:`forecast_fill` forecasts at the configured buffer, same stream) and off
    (``train.unpacked_micro_batch_size`` conversations padded to the longest), before any
    training. Useful FLOPs are the same both ways; what packing saves is the padding."""
    from packline.counters import flops_model_for
    from packline.qwen.processor import load_processor

    model = flops_model_for(cfg, load_processor(processor_dir))
    p = cfg.packing
    rows = [
        (
            int(n),
            [tuple(g) for g in json.loads(grids)],
            int(loss),
            [tuple(g) for g in json.loads(vg)],
        )
        for n, grids, loss, vg in zip(
            train["total_tokens"],
            train["image_grids"],
            train["loss_tokens"],
            train["video_grids"],
            strict=True,
        )
    ]
    ordered = [rows[i] for i in stream_order(len(rows), cfg.train.seed)]
    simulated = simulate_packing(
        [align_up(n, p.alignment) for n, *_ in ordered],
        capacity=p.seq_length,
        buffer_size=p.packing_buffer_size,
        **forecast_settings(cfg),
    )
    stream = [row for row in ordered if align_up(row[0], p.alignment) <= p.seq_length]
    useful = sum(model.useful([n], grids, n, loss, video_grids=vg) for n, grids, loss, vg in stream)

    packed_exec = packed_rows = packed_real = 0
    for g in (g for r in simulated.rounds for g in r.groups):
        segments = [simulated.lengths[i] for i in g]  # aligned
        if p.pad_to_max_length:
            segments[-1] += p.seq_length - sum(segments)
        grids = [grid for i in g for grid in ordered[i][1]]
        video_grids = [grid for i in g for grid in ordered[i][3]]
        packed_exec += model.executed(segments, grids, video_grids=video_grids)
        packed_rows += 1
        packed_real += sum(ordered[i][0] for i in g)

    k = cfg.train.unpacked_micro_batch_size
    unpacked_exec = unpacked_rows = unpacked_capacity = 0
    for start in range(0, len(stream), k):
        chunk = stream[start : start + k]
        longest = max(n for n, *_ in chunk)
        grids = [grid for _, gs, _, _ in chunk for grid in gs]
        video_grids = [grid for *_, vgs in chunk for grid in vgs]
        unpacked_exec += model.executed([longest] * len(chunk), grids, video_grids=video_grids)
        unpacked_rows += len(chunk)
        unpacked_capacity += longest * len(chunk)

    packed_capacity = packed_rows * p.seq_length
    return {
        "epoch_useful": float(useful),
        "epoch_executed_packed": float(packed_exec),
        "epoch_executed_unpacked": float(unpacked_exec),
        "epoch_nominal_packed": float(model.nominal(packed_capacity)),
        "epoch_nominal_unpacked": float(model.nominal(unpacked_capacity)),
        "padding_share_packed": 1 - useful / packed_exec if packed_exec else 0.0,
        "padding_share_unpacked": 1 - useful / unpacked_exec if unpacked_exec else 0.0,
        "saving": 1 - packed_exec / unpacked_exec if unpacked_exec else 0.0,
        "rows_packed": float(packed_rows),
        "rows_unpacked": float(unpacked_rows),
        "tokens_real": float(packed_real),
        "tokens_capacity_packed": float(packed_capacity),
        "tokens_capacity_unpacked": float(unpacked_capacity),
    }


def _histogram(df: pd.DataFrame, seq_length: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=100)
    bins = 50
    ax.hist(
        [df["text_tokens"], df["total_tokens"]],
        bins=bins,
        label=["text tokens", "total tokens (text + image)"],
        alpha=0.75,
    )
    ax.axvline(seq_length, color="crimson", linestyle="--", label=f"seq_length {seq_length}")
    ax.set_xlabel("tokens per conversation")
    ax.set_ylabel("conversations")
    ax.set_title(f"Conversation lengths ({len(df):,} samples)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def connect_processor(
    cfg: PipelineConfig, fp: str | None = None, *, visual_tokens: VisualRule | None = None
) -> StageResult:
    """Measure every sample with the real processor and check the cheap rule against it."""
    t0 = time.perf_counter()
    fp = fp or fingerprint_inputs(cfg)
    require_record(cfg, "prepare", by="connect")
    dataset = dataset_dir(cfg)
    manifest = pd.read_parquet(dataset / "manifest.parquet")
    with building(cfg, STAGE) as out:
        processor = materialize_processor(cfg, out)
        records = measure_lengths(
            dataset,
            processor,
            num_workers=cfg.prepare.num_workers,
            visual_tokens=visual_tokens,
            expected=len(manifest),
            bridge=renders_for_bridge(cfg),
            max_num_frames=bridge_max_num_frames(cfg) if renders_for_bridge(cfg) else None,
        )
        mismatches = [
            f"{rec['key']}: the processor counts {rec['exact']['total_tokens']} tokens "
            f"({rec['exact']['image_tokens']} image, {rec['exact']['loss_tokens']} loss), the "
            f"cheap rule {rec['cheap']['total_tokens']} ({rec['cheap']['image_tokens']} image, "
            f"{rec['cheap']['loss_tokens']} loss)"
            for _, rec in records
            if rec["exact"] != rec["cheap"]
        ]
        if mismatches:
            raise UserError(
                mismatches[:50]
                + ([f"... and {len(mismatches) - 50} more"] if len(mismatches) > 50 else []),
                f"connect: the cheap length rule disagrees with the processor on "
                f"{len(mismatches)} of {len(records)} samples",
            )
        df = pd.DataFrame(
            [
                {
                    "key": rec["key"],
                    "split": split,
                    **rec["exact"],
                    "image_grids": rec["image_grids"],
                    "images_moved": rec["images_moved"],
                    "video_grids": rec["video_grids"],
                    "video_frame_counts": rec["video_frame_counts"],
                }
                for split, rec in records
            ]
        )
        df = df[LENGTH_COLUMNS]
        df = df.sort_values(["split", "key"], kind="stable").reset_index(drop=True)
        validate_table(LengthsModel, df, "lengths.parquet").to_parquet(
            out / "lengths.parquet", index=False
        )
        missing = sorted(set(manifest["key"]) - set(df["key"]))
        if missing:
            raise UserError(
                [f"{len(missing)} manifest keys never came out of the loader, e.g. {missing[:5]}"],
                "connect: samples lost between prepare and connect",
            )

        m = cfg.packing.alignment
        train = df[df["split"] == "train"]
        aligned = [align_up(int(n), m) for n in train["total_tokens"]]
        settings = forecast_settings(cfg)
        forecast = forecast_fill(
            aligned,
            cfg.packing.seq_length,
            list(cfg.packing.forecast_buffer_sizes),
            settings.pop("algorithm"),
            cfg.train.seed,
            **settings,
        )
        forecast["overlength"] = len(aligned) - forecast["samples"]
        forecast["alignment"] = m
        forecast["flops"] = forecast_flops(cfg, processor, train)
        (out / "forecast.json").write_text(json.dumps(forecast, indent=2))
        _histogram(df, cfg.packing.seq_length, out / "length_histogram.png")
        bridge_videos = None
        if renders_for_bridge(cfg) and int(df["num_videos"].sum()):
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
        "connect/fill_lower_bound": forecast["lower_bound"]["fill"],
        "connect/fill_unpacked": forecast["unpacked"]["fill"],
        "connect/ms_per_sample": 1000 * seconds / max(len(df), 1),
    }
    metrics.update({f"flops/{k}": v for k, v in forecast["flops"].items()})
    for b, v in forecast["buffers"].items():
        metrics[f"connect/forecast_fill_b{b}"] = v["fill"]
        metrics[f"connect/forecast_packs_b{b}"] = v["packs"]
    if bridge_videos is not None:  # what Bridge's encoder makes of the videos (validate warns)
        metrics.update(
            {
                "connect/bridge_videos_truncated": bridge_videos["truncated"]["videos"],
                "connect/bridge_frames_truncated": bridge_videos["truncated"]["frames_dropped"],
                "connect/bridge_videos_resampled": bridge_videos["resampled"]["videos"],
                "connect/bridge_frames_resampled_away": bridge_videos["resampled"][
                    "frames_dropped"
                ],
                "connect/bridge_videos_timestamps_differ": bridge_videos["timestamps"]["videos"],
            }
        )
    console.log(
        "connect: forecast fill "
        + ", ".join(f"B={b}: {v['fill']:.3f}" for b, v in forecast["buffers"].items())
        + f"; lower bound {forecast['lower_bound']['fill']:.3f}"
    )
    result = StageResult(
        stage=STAGE,
        out_dir=out_dir,
        fingerprint=fp,
        skipped=False,
        metrics={k: float(v) for k, v in metrics.items()},
        summary={
            "processor_dir": str(processor_dir(cfg)),
            "artifacts": [
                str(out_dir / "forecast.json"),
                str(out_dir / "length_histogram.png"),
                *([str(out_dir / BRIDGE_VIDEOS)] if bridge_videos is not None else []),
            ],
        },
        seconds=seconds,
    )
    write_record(cfg, result)
    return result
