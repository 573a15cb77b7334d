"""Stage validate: every guardrail at once, on the laptop, before any GPU hour is spent.

A packed multimodal fine-tune fails late and expensively when one setting is off, and
Megatron-Bridge rejects such settings one at a time at start-up on the cluster. This stage
checks them all together, in seconds, and explains each: the setting, the rule it breaks,
what is wrong (with the values) and the fix.

Outputs in ``<work>/validate/``::

    report.json     errors and warnings (setting, rule, message, fix), every rule run with
                    its status, and the figures the rules computed
    pipeline.yaml   the resolved config that was validated

Rule groups, in order, all in one pass:

- ``config``: each section's types, ranges and enums (``schemas/config.py``);
- ``packing`` / ``megatron``: the cross-section guardrails on packline's settings
  (``schemas/guardrails.py``), which ``load_config`` already enforces, so a config breaking
  one stops before any stage runs;
- ``slurm``: what ``packline run --executor slurm`` refuses (``schemas/guardrails.py``);
- ``megatron`` (``train.backend: megatron``): the Megatron rules on the overrides Bridge will
  really get, packline's plus ``megatron.extra_overrides`` (applied last), the same rules
  ``run --executor slurm`` refuses (``packline/megatron/overrides.py``): paths, executor, GPUs
  into TP × CP, EP and data-parallel groups, LoRA names, every extra key a field of Bridge's
  config (``packline/megatron/fields.py``), Bridge's packing guardrails on the extra values,
  micro-batches (train, dataset, eval), DistTrain off, no legacy in-batch packing, and the
  alignment with the eval CP size and the SP the MoE provider turns on;
- ``data``: connect's tables against the config — overlength samples (aligned as the run
  pads them) and the overlength policy, images per sample, forecast fill at the configured
  buffer, loader-worker memory of the buffer, and the pandera cross-table checks of manifest
  and lengths; for ``train.backend: megatron``, Bridge's encoder limits (images, and image
  plus video tokens, per sample), the turns it renders media first, and its videos (connect's
  ``bridge_videos.json``: frames cut by ``max_num_frames`` or re-sampled by a processor dir
  that samples, and the timestamps it writes, positions over 24 fps);
- ``model``: the processor against the model config (special-token ids, vocabulary, vision
  geometry, vision → text width) and the LoRA targets against the model's modules and
  parameters. The model is built on the meta device from its config: no weight is read.

Any error raises :class:`~stages.base.UserError` (exit 2) listing all of them, after the
report is written; warnings never stop the run. The completion record, which the train
stage requires, is written only when there is no error.
"""

from __future__ import annotations

import difflib
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd
import torch
from omegaconf import OmegaConf

import packline
from packline.energon.packing import buffered_sample_bytes
from packline.fingerprints import stage_fingerprint
from packline.megatron.overrides import bridge_alignment, megatron_findings
from packline.packing.selection import align_up
from packline.progress import console
from packline.qwen.model import build_meta_model
from packline.qwen.processor import load_processor, processor_geometry, special_token_ids
from packline.train.setup import lora_target_matches, model_config
from packline.workdir import BRIDGE_VIDEOS
from schemas.config import OverlengthPolicy, PipelineConfig, TrainBackend, section_findings
from schemas.errors import UserError
from schemas.guardrails import (
    CONFIG_RULES,
    SLURM_RULES,
    Check,
    Finding,
    Issue,
    RuleBook,
    error,
    train_world,
    warning,
)
from schemas.tables import cross_table_problems
from stages.base import (
    StageResult,
    building,
    dataset_dir,
    processor_dir,
    read_record,
    require_record,
    stage_dir,
    write_record,
)

STAGE = "validate"
GIB = 1024**3
MIB = 1024**2
#: model_type of the HF configs packline trains
QWEN3_VL_TYPES = ("qwen3_vl", "qwen3_vl_moe")


@dataclass
class Inputs:
    """What the data and model rules read; rules add the figures they compute to ``facts``."""

    cfg: PipelineConfig
    manifest: pd.DataFrame
    lengths: pd.DataFrame
    processor: Any
    connect_current: bool
    alignment: int
    """The multiple each conversation is padded to, as the run pads it (for the Megatron
    backend: Bridge's, with the eval CP size and the SP its MoE provider turns on)."""
    model_config: Any = None
    model_config_problem: str | None = None
    bridge_videos: dict[str, Any] | None = None
    """connect's ``bridge_videos.json`` (backend megatron with videos): what Bridge's encoder
    makes of them."""
    facts: dict[str, Any] = field(default_factory=dict)
    _model: torch.nn.Module | None = None

    @property
    def model(self) -> torch.nn.Module:
        """The configured model on the meta device (built once, from its config only)."""
        if self._model is None:
            self._model = build_meta_model(self.model_config)
        return self._model

    @property
    def model_ok(self) -> bool:
        return self.model_config is not None and self.model_config_problem is None


def load_inputs(cfg: PipelineConfig, alignment: int | None = None) -> Inputs:
    """Read prepare's manifest, connect's lengths and processor, and the model's config.
    ``alignment`` defaults to ``packing.alignment``."""
    connect_dir = stage_dir(cfg, "connect")
    processor = load_processor(processor_dir(cfg))
    record = read_record(cfg, "connect") or {}
    inputs = Inputs(
        cfg=cfg,
        manifest=pd.read_parquet(dataset_dir(cfg) / "manifest.parquet"),
        lengths=pd.read_parquet(connect_dir / "lengths.parquet"),
        processor=processor,
        connect_current=record.get("fingerprint") == stage_fingerprint(cfg, "connect"),
        alignment=cfg.packing.alignment if alignment is None else alignment,
    )
    if (bridge_videos := connect_dir / BRIDGE_VIDEOS).is_file():
        inputs.bridge_videos = json.loads(bridge_videos.read_text())
    model_dir = Path(cfg.model.path).expanduser() if cfg.model.path else None
    if model_dir is not None and not model_dir.is_dir():
        inputs.model_config_problem = "not a directory"
    elif model_dir is not None and not (model_dir / "config.json").is_file():
        inputs.model_config_problem = "it holds no config.json"
    if inputs.model_config_problem:
        return inputs
    try:
        inputs.model_config = model_config(cfg, processor)
    except (OSError, ValueError, KeyError) as exc:
        inputs.model_config_problem = str(exc).strip().splitlines()[0]
    else:
        model_type = getattr(inputs.model_config, "model_type", None)
        if model_type not in QWEN3_VL_TYPES:
            inputs.model_config_problem = (
                f"its config.json is a {model_type!r} model, not Qwen3-VL "
                f"({' or '.join(QWEN3_VL_TYPES)})"
            )
    return inputs


# --- data against config (connect's tables) -------------------------------------------------

DATA_RULES = RuleBook()


@DATA_RULES.rule("data.current", "data", "connect's outputs were made under this config")
def _current(x: Inputs) -> list[Issue]:
    if x.connect_current:
        return []
    return [
        warning(
            "connect",
            f"connect's outputs in {stage_dir(x.cfg, 'connect')} were made under other "
            "settings (its completion record does not match this config); the data checks "
            "read them as they are",
            "rerun the stale stages: packline run (or packline stage connect)",
        )
    ]


@DATA_RULES.rule(
    "data.tables",
    "data",
    "manifest and lengths hold the same keys, once each, with the same split and image count",
)
def _tables(x: Inputs) -> list[Issue]:
    out = []
    for table, problem in cross_table_problems(x.manifest, x.lengths):
        if table == "manifest.parquet":
            fix = "rebuild the dataset: packline run --from prepare"
        else:
            fix = "remeasure this prepared dataset: packline run --from connect"
        out.append(error(f"{table.split('.')[0]}.parquet", problem, fix))
    return out


def _aligned(x: Inputs) -> pd.Series:
    m = x.alignment
    return x.lengths["total_tokens"].map(lambda n: align_up(int(n), m))


@DATA_RULES.rule(
    "data.overlength",
    "data",
    "samples longer than packing.seq_length are dropped and counted, or fail the run, per "
    "packing.overlength",
)
def _overlength(x: Inputs) -> list[Issue]:
    p, m = x.cfg.packing, x.alignment
    aligned = _aligned(x)
    over = aligned > p.seq_length
    n, total = int(over.sum()), len(aligned)
    longest = int(x.lengths["total_tokens"].max()) if total else 0
    x.facts["alignment"] = m
    x.facts["overlength"] = {
        "samples": n,
        "by_split": {s: int(over[x.lengths["split"] == s].sum()) for s in ("train", "val")},
        "longest_tokens": longest,
        "seq_length": p.seq_length,
        "policy": p.overlength.value,
    }
    if n == 0:
        return []
    what = (
        f"{n} of {total} samples are longer than packing.seq_length {p.seq_length} "
        f"(aligned to m = {m}; the longest has {longest} tokens)"
    )
    keep = f"packing.seq_length={align_up(int(aligned.max()), m)}"
    if p.overlength is OverlengthPolicy.fail:
        return [
            error(
                "packing.overlength",
                f"{what} and packing.overlength is 'fail': the run would stop at the first",
                f"set {keep}, or packing.overlength=drop to drop and count them",
            )
        ]
    return [
        warning(
            "packing.seq_length",
            f"{what}: they will be dropped and counted as overlength ({n / total:.1%})",
            f"set {keep} to keep them",
        )
    ]


@DATA_RULES.rule(
    "data.train_fits", "data", "at least one training sample fits in packing.seq_length"
)
def _train_fits(x: Inputs) -> list[Issue]:
    seq = x.cfg.packing.seq_length
    train = _aligned(x)[x.lengths["split"] == "train"]
    if len(train) == 0 or (train <= seq).any():
        return []
    return [
        error(
            "packing.seq_length",
            f"none of the {len(train)} training samples fits in packing.seq_length {seq} "
            f"(the shortest needs {int(train.min())} tokens after alignment)",
            f"set packing.seq_length={int(train.max())} or more",
        )
    ]


@DATA_RULES.rule(
    "data.images_per_sample", "data", "no sample has more images than prepare.max_images"
)
def _images_per_sample(x: Inputs) -> list[Issue]:
    limit = x.cfg.prepare.max_images
    images = x.lengths["num_images"]
    x.facts["images_per_sample"] = {"max": int(images.max()) if len(images) else 0}
    n = int((images > limit).sum())
    if n == 0:
        return []
    return [
        error(
            "prepare.max_images",
            f"{n} samples have more than prepare.max_images {limit} images (up to "
            f"{int(images.max())}): the dataset was prepared under another limit",
            "rebuild the dataset with this limit: packline run --from prepare",
        )
    ]


@DATA_RULES.rule(
    "data.frames_per_video",
    "data",
    "no video has more sampled frames than prepare.max_frames_per_video",
)
def _frames_per_video(x: Inputs) -> list[Issue] | None:
    counts = [n for doc in x.lengths["video_frame_counts"] for n in json.loads(doc)]
    if not counts:
        return None
    limit = x.cfg.prepare.max_frames_per_video
    x.facts["frames_per_video"] = {"max": max(counts), "videos": len(counts)}
    n = sum(1 for c in counts if c > limit)
    if n == 0:
        return []
    return [
        error(
            "prepare.max_frames_per_video",
            f"{n} videos have more than prepare.max_frames_per_video {limit} sampled frames "
            f"(up to {max(counts)}): the dataset was prepared under another limit",
            "rebuild the dataset with this limit: packline run --from prepare",
        )
    ]


@DATA_RULES.rule(
    "data.visual_tokens_per_sample",
    "data",
    "no sample has more visual tokens (images and videos) than validate.max_visual_tokens",
)
def _visual_tokens_per_sample(x: Inputs) -> list[Issue]:
    visual = x.lengths["image_tokens"] + x.lengths["video_tokens"]
    limit = x.cfg.validate.max_visual_tokens
    x.facts["visual_tokens_per_sample"] = {
        "max": int(visual.max()) if len(visual) else 0,
        "video_max": int(x.lengths["video_tokens"].max()) if len(visual) else 0,
    }
    n = int((visual > limit).sum())
    if n == 0:
        return []
    return [
        warning(
            "validate.max_visual_tokens",
            f"{n} samples have more than validate.max_visual_tokens {limit} visual tokens (up "
            f"to {int(visual.max())}): the vision tower attends over each image and each pair "
            "of video frames at once, so its memory grows with the square of a frame's tokens",
            "lower the processor's pixel bounds (processor.max_pixels; a video processor's "
            "size.longest_edge bounds a whole clip) or its fps, or raise "
            "validate.max_visual_tokens",
        )
    ]


@DATA_RULES.rule(
    "megatron.encoder_limits",
    "megatron",
    "no sample exceeds the image and visual-token limits of Megatron-Bridge's encoder, which "
    "skips such samples without counting them",
)
def _encoder_limits(x: Inputs) -> list[Issue] | None:
    if x.cfg.train.backend is not TrainBackend.megatron:
        return None
    m = x.cfg.megatron
    out = []
    # Bridge counts a sample's image and video tokens together (main's native packing: from
    # the prepared grids, what connect measured)
    visual = x.lengths["image_tokens"] + x.lengths["video_tokens"]
    for setting, values, limit, what in (
        ("max_num_images", x.lengths["num_images"], m.max_num_images, "images"),
        ("max_visual_tokens", visual, m.max_visual_tokens, "visual tokens"),
    ):
        n = int((values > limit).sum())
        if n:
            out.append(
                warning(
                    f"megatron.{setting}",
                    f"{n} samples have more than megatron.{setting} {limit} {what} (up "
                    f"to {int(values.max())}): Megatron-Bridge's encoder skips them without "
                    "counting them",
                    f"set megatron.{setting}={int(values.max())}",
                )
            )
    return out


@DATA_RULES.rule(
    "megatron.video_frames",
    "megatron",
    "Megatron-Bridge's encoder keeps every frame prepare pre-sampled of each video: none is "
    "cut by its max_num_frames or re-sampled by a processor dir that samples frames",
)
def _video_frames(x: Inputs) -> list[Issue] | None:
    from packline.megatron.overrides import MAX_NUM_FRAMES, extra_overrides

    b = x.bridge_videos
    if x.cfg.train.backend is not TrainBackend.megatron or not b:
        return None
    x.facts["bridge_videos"] = {
        k: b[k] for k in ("videos", "max_num_frames", "do_sample_frames", "max_presampled_frames")
    } | {k: b[k]["videos"] for k in ("truncated", "resampled")}
    out = []
    cut, limit, most = b["truncated"], b["max_num_frames"], b["max_presampled_frames"]
    if cut["videos"]:
        extra = MAX_NUM_FRAMES in extra_overrides(x.cfg)
        out.append(
            warning(
                "megatron.extra_overrides" if extra else "prepare.max_frames_per_video",
                f"{cut['videos']} of {b['videos']} videos ({cut['samples']} samples, e.g. "
                f"{', '.join(cut['examples'])}) have more pre-sampled frames than "
                f"Megatron-Bridge's max_num_frames {limit} (up to {most}): its encoder keeps "
                f"the first {limit} of each, {cut['frames_dropped']} frames are dropped "
                "(connect measured the videos cut)",
                f"remove {MAX_NUM_FRAMES} from megatron.extra_overrides (packline sends "
                f"prepare.max_frames_per_video) or set it to {most}"
                if extra
                else f"set prepare.max_frames_per_video={limit} and rerun prepare",
            )
        )
    again = b["resampled"]
    if b["do_sample_frames"] or x.processor.video_processor.do_sample_frames:
        out.append(
            warning(
                "connect",
                f"the processor dir Megatron-Bridge loads ({processor_dir(x.cfg)}) samples "
                "video frames (do_sample_frames true): Bridge hands it each video's "
                "pre-sampled frames without a frame rate, so it samples them again as if they "
                f"were 24 fps: {again['videos']} of {b['videos']} videos lose "
                f"{again['frames_dropped']} frames (e.g. {', '.join(again['examples'])})",
                "rerun connect (packline run --from connect), which writes do_sample_frames "
                "false into its processor dir for train.backend megatron",
            )
        )
    return out


@DATA_RULES.rule(
    "megatron.video_timestamps",
    "megatron",
    "the frame timestamps Megatron-Bridge's encoder writes into the text are counted against "
    "the videos' real times (it passes no frame rate: positions over 24 fps)",
)
def _video_timestamps(x: Inputs) -> list[Issue] | None:
    b = x.bridge_videos
    if x.cfg.train.backend is not TrainBackend.megatron or not b:
        return None
    ts = b["timestamps"]
    x.facts["bridge_timestamps"] = {
        k: ts[k] for k in ("videos", "groups", "groups_differing", "max_error_seconds")
    }
    if not ts["videos"]:
        return []
    worst = ts["worst"]
    pairs = [f"{a} for {r}" for a, r in zip(worst["bridge"], worst["real"], strict=True)]
    shown = ", ".join(pairs if len(pairs) <= 3 else [*pairs[:2], "...", pairs[-1]])
    return [
        warning(
            "train.backend",
            "Megatron-Bridge hands the processor no frame rate, so the timestamp before each "
            "group of two frames is its position over 24 fps, not the clip's time: "
            f"{ts['videos']} of {b['videos']} videos get other timestamps than their real "
            f"ones ({ts['groups_differing']} of {ts['groups']} groups, up to "
            f"{ts['max_error_seconds']:.1f} s off; {worst['key']}: {shown}); connect "
            "measured Bridge's text",
            "none in Bridge's encoder (it takes no video metadata): train with train.backend "
            "local for the real timestamps, or accept that the model learns Bridge's",
        )
    ]


@DATA_RULES.rule(
    "megatron.media_first",
    "megatron",
    "the samples whose images Megatron-Bridge's encoder moves before their turn's text are "
    "counted (it renders every turn media first; connect measured them that way)",
)
def _media_first(x: Inputs) -> list[Issue] | None:
    if x.cfg.train.backend is not TrainBackend.megatron:
        return None
    moved = x.lengths[x.lengths["images_moved"]]
    x.facts["images_moved"] = len(moved)
    if moved.empty:
        return []
    return [
        warning(
            "train.backend",
            "Megatron-Bridge's encoder puts each turn's images and videos before its text: "
            f"{len(moved)} of {len(x.lengths)} samples have one after text in their turn (e.g. "
            f"{', '.join(moved['key'].head(3))}), so text such as 'Image 1: <image> Image 2: "
            "<image>' loses its sense there; connect measured them as Bridge renders them",
            "place the images and videos before the text in those turns, or train with "
            "train.backend local, which keeps them where the markers stand",
        )
    ]


@DATA_RULES.rule(
    "packing.forecast_fill",
    "packing",
    "the forecast fill at packing.packing_buffer_size reaches validate.min_forecast_fill",
)
def _forecast_fill(x: Inputs) -> list[Issue] | None:
    from packline.packing.forecast import forecast_fill, forecast_settings

    cfg = x.cfg
    if not cfg.trains_packed:
        return None
    p = cfg.packing
    buffer = p.packing_buffer_size
    aligned = [int(a) for a in _aligned(x)[x.lengths["split"] == "train"]]
    larger = sorted(b for b in p.forecast_buffer_sizes if b > buffer)
    settings = forecast_settings(cfg)
    algorithm = settings.pop("algorithm")
    forecast = forecast_fill(
        aligned, p.seq_length, [buffer, *larger], algorithm, cfg.train.seed, **settings
    )
    fills = {int(b): v["fill"] for b, v in forecast["buffers"].items()}
    fill, bound = fills[buffer], forecast["lower_bound"]["fill"]
    x.facts["forecast_fill"] = {
        "buffer": buffer,
        "fill": fill,
        "lower_bound": bound,
        "by_buffer": {str(b): f for b, f in fills.items()},
    }
    floor = cfg.validate.min_forecast_fill
    if fill >= floor:
        return []
    better = next((b for b in larger if fills[b] >= floor), None)
    if better is not None:
        fix = f"set packing.packing_buffer_size={better} (forecast fill {fills[better]:.3f})"
    else:
        fix = "raise packing.packing_buffer_size or packing.seq_length, or accept the padding"
    return [
        warning(
            "packing.packing_buffer_size",
            f"the forecast fill at packing.packing_buffer_size {buffer} is {fill:.3f}, below "
            f"validate.min_forecast_fill {floor:g} (lower bound {bound:.3f})",
            fix,
        )
    ]


def buffered_bytes(x: Inputs) -> dict[str, list[int]]:
    """Bytes each training sample holds in a worker's packing buffer, per encoder mode."""
    geometry = processor_geometry(x.processor)
    patch_dim = 3 * geometry.temporal_patch_size * geometry.patch_size**2  # RGB patch values
    train = x.lengths[x.lengths["split"] == "train"]
    manifest = x.manifest.drop_duplicates("key").set_index("key")
    image_bytes = manifest["image_bytes"]
    video_bytes = manifest["video_bytes"] if "video_bytes" in manifest else {}
    out: dict[str, list[int]] = {"lazy": [], "eager": []}
    for key, tokens, num_images, grids, num_videos, video_grids in zip(
        train["key"],
        train["total_tokens"],
        train["num_images"],
        train["image_grids"],
        train["num_videos"],
        train["video_grids"],
        strict=True,
    ):
        args = dict(
            num_tokens=int(tokens),
            num_images=int(num_images),
            image_bytes=int(image_bytes.get(key, 0)),
            num_patches=sum(t * h * w for t, h, w in json.loads(grids)),
            patch_dim=patch_dim,
            num_videos=int(num_videos),
            video_bytes=int(video_bytes.get(key, 0)),
            # A video patch spans temporal_patch_size sampled frames (an odd count padded).
            num_video_patches=sum(t * h * w for t, h, w in json.loads(video_grids)),
        )
        for mode in out:
            out[mode].append(buffered_sample_bytes(mode, **args))
    return out


@DATA_RULES.rule(
    "packing.worker_memory",
    "packing",
    "one loader worker's packing buffer stays under validate.worker_memory_warn_gib",
)
def _worker_memory(x: Inputs) -> list[Issue] | None:
    cfg = x.cfg
    if not cfg.trains_packed:
        return None
    per_sample = buffered_bytes(x)
    buffer, mode = cfg.packing.packing_buffer_size, cfg.packing.encoder.value
    mean = {m: (sum(v) / len(v) if v else 0.0) for m, v in per_sample.items()}
    per_worker = {m: buffer * mean[m] for m in mean}
    workers = max(cfg.train.num_workers, 1)
    x.facts["worker_memory"] = {
        "mode": mode,
        "buffer": buffer,
        "workers": workers,
        "mean_sample_mib": {m: v / MIB for m, v in mean.items()},
        "largest_sample_mib": {m: max(v, default=0) / MIB for m, v in per_sample.items()},
        "per_worker_gib": {m: v / GIB for m, v in per_worker.items()},
        "all_workers_gib": {m: workers * v / GIB for m, v in per_worker.items()},
    }
    limit = cfg.validate.worker_memory_warn_gib
    if per_worker[mode] <= limit * GIB:
        return []
    fitting = max(1, math.floor(limit * GIB / mean[mode]))
    held = (
        "pixel tensors of images and sampled video frames"
        if mode == "eager"
        else "token ids and encoded images and videos"
    )
    fix = f"lower packing.packing_buffer_size to {fitting}"
    if mode == "eager":
        fix = (
            f"set packing.encoder=lazy (about {per_worker['lazy'] / GIB:.2f} GiB at this "
            f"buffer), or {fix}"
        )
    return [
        warning(
            "packing.packing_buffer_size",
            f"packing.encoder {mode} holds about {per_worker[mode] / GIB:.2f} GiB per loader "
            f"worker ({buffer} buffered samples x {mean[mode] / MIB:.2f} MiB of {held} on "
            f"average), above validate.worker_memory_warn_gib {limit:g}",
            fix,
        )
    ]


# --- model against data (processor vs model config; LoRA targets) ---------------------------

MODEL_RULES = RuleBook()


@MODEL_RULES.rule("model.config", "model", "the model's config loads as a Qwen3-VL config")
def _model_config(x: Inputs) -> list[Issue]:
    if x.model_config_problem is None:
        x.facts["model"] = {
            "type": x.model_config.model_type,
            "source": x.cfg.model.path or f"tiny (moe={x.cfg.model.moe})",
        }
        return []
    return [
        error(
            "model.path",
            f"model.path {x.cfg.model.path!r}: {x.model_config_problem}",
            "point model.path at a local Hugging Face Qwen3-VL checkpoint dir (its "
            "config.json is all validate reads)",
        )
    ]


@MODEL_RULES.rule(
    "model.moe", "model", "model.moe says what model.path's checkpoint is (dense or MoE)"
)
def _moe_flag(x: Inputs) -> list[Issue] | None:
    if not x.model_ok or not x.cfg.model.path:
        return None
    is_moe = x.model_config.model_type == "qwen3_vl_moe"
    if is_moe == x.cfg.model.moe:
        return []
    what = "an MoE (qwen3_vl_moe)" if is_moe else "a dense (qwen3_vl)"
    fix = (
        "set model.moe=true"
        if is_moe
        else "set model.path=null to build the tiny MoE at random, or point model.path at an "
        "MoE checkpoint"
    )
    return [
        error(
            "model.moe",
            f"model.moe is {str(x.cfg.model.moe).lower()} but model.path {x.cfg.model.path!r} "
            f"holds {what} model: the MoE settings (experts, EP, the router's loss) would "
            "not apply to what trains",
            fix,
        )
    ]


#: processor token → model config attribute that must hold the same id
TOKEN_ID_FIELDS = (
    ("image_token_id", "<|image_pad|>"),
    ("video_token_id", "<|video_pad|>"),
    ("vision_start_token_id", "<|vision_start|>"),
    ("vision_end_token_id", "<|vision_end|>"),
)


@MODEL_RULES.rule(
    "model.token_ids",
    "model",
    "the processor's special-token ids equal the model config's",
)
def _token_ids(x: Inputs) -> list[Issue] | None:
    if not x.model_ok:
        return None
    ids = special_token_ids(x.processor)
    out, seen = [], {}
    for name, token in TOKEN_ID_FIELDS:
        ours, theirs = ids[name], getattr(x.model_config, name, None)
        seen[name] = {"processor": ours, "model": theirs}
        if theirs is not None and int(theirs) != int(ours):
            out.append(
                error(
                    "processor.path",
                    f"the processor's {name} is {ours} ({token}) but the model config's is "
                    f"{theirs}: the model would not find the processor's {token} tokens",
                    "use the processor and the model of the same checkpoint (processor.path, "
                    "model.path)",
                )
            )
    x.facts["token_ids"] = seen
    return out


@MODEL_RULES.rule(
    "model.vocab", "model", "every processor token id is inside the model's vocabulary"
)
def _vocab(x: Inputs) -> list[Issue] | None:
    if not x.model_ok:
        return None
    ours, theirs = len(x.processor.tokenizer), int(x.model_config.text_config.vocab_size)
    x.facts["vocab"] = {"processor": ours, "model": theirs}
    if ours <= theirs:
        return []
    return [
        error(
            "processor.path",
            f"the processor has {ours} token ids but the model's text_config.vocab_size is "
            f"{theirs}: ids from {theirs} on index past the embedding",
            "use the processor and the model of the same checkpoint (processor.path, model.path)",
        )
    ]


@MODEL_RULES.rule(
    "model.vision_geometry",
    "model",
    "the processor's patch, temporal patch and merge sizes equal the vision tower's",
)
def _vision_geometry(x: Inputs) -> list[Issue] | None:
    if not x.model_ok:
        return None
    g = processor_geometry(x.processor)
    vision = x.model_config.vision_config
    out, seen = [], {}
    for ours_name, ours, theirs_name in (
        ("patch_size", g.patch_size, "patch_size"),
        ("temporal_patch_size", g.temporal_patch_size, "temporal_patch_size"),
        ("merge_size", g.merge_size, "spatial_merge_size"),
    ):
        theirs = int(getattr(vision, theirs_name))
        seen[ours_name] = {"processor": ours, "model": theirs}
        if ours != theirs:
            out.append(
                error(
                    "processor.path",
                    f"the processor's {ours_name} is {ours} but the model's "
                    f"vision_config.{theirs_name} is {theirs}: image patches would not match "
                    "the vision tower",
                    "use the processor and the model of the same checkpoint (processor.path, "
                    "model.path)",
                )
            )
    x.facts["vision_geometry"] = seen
    return out


@MODEL_RULES.rule(
    "model.vision_text_width",
    "model",
    "the vision tower's output width equals the language model's hidden size",
)
def _vision_text_width(x: Inputs) -> list[Issue] | None:
    if not x.model_ok:
        return None
    out_width = int(x.model_config.vision_config.out_hidden_size)
    hidden = int(x.model_config.text_config.hidden_size)
    if out_width == hidden:
        return []
    return [
        error(
            "model.path",
            f"the model's vision_config.out_hidden_size is {out_width} but its "
            f"text_config.hidden_size is {hidden}: merged image features cannot enter the "
            "language model",
            "use a consistent Qwen3-VL config.json",
        )
    ]


@MODEL_RULES.rule(
    "model.parallel",
    "model",
    "train.parallel splits the model's decoder layers into whole stages and its experts evenly",
)
def _model_parallel(x: Inputs) -> list[Issue] | None:
    if not x.model_ok or x.cfg.train.backend is not TrainBackend.local:
        return None  # Bridge splits the model itself (megatron rules)
    from schemas.layout import ParallelLayout

    text = getattr(x.model_config, "text_config", x.model_config)
    par = x.cfg.train.parallel
    layout = ParallelLayout.from_config(par, train_world(x.cfg))
    found = layout.model_problems(
        num_layers=text.num_hidden_layers, num_experts=getattr(text, "num_experts", None)
    )
    x.facts["parallel"] = {
        "ranks": layout.world,
        "pipeline_parallel": layout.pipeline,
        "expert_parallel": layout.expert,
        "data_parallel": layout.data,
        "fsdp": layout.fsdp,
    }
    # the rest of the layout's problems are config rules (train.parallel / slurm.parallel)
    return [
        error(
            "train.parallel",
            f"train.parallel: {problem} ({x.cfg.model.path or 'the tiny model'}: "
            f"{text.num_hidden_layers} layers, {getattr(text, 'num_experts', 0) or 'no'} experts)",
            "change train.parallel.pipeline_parallel / expert_parallel",
        )
        for problem in found
    ]


@MODEL_RULES.rule(
    "lora.targets",
    "lora",
    "every LoRA target matches at least one module (or parameter) of the model",
)
def _lora_targets(x: Inputs) -> list[Issue] | None:
    if not x.model_ok:
        return None
    lora = x.cfg.lora
    model = x.model
    matches = lora_target_matches(model, list(lora.target_modules), list(lora.target_parameters))
    x.facts["lora_targets"] = {f"{m.kind}:{m.target}": len(m.matched) for m in matches}
    experts = [n for n, p in model.named_parameters() if p.dim() == 3]
    expert_suffixes = sorted({".".join(n.split(".")[-3:]) for n in experts})
    leaves = sorted({n.rsplit(".", 1)[-1] for n, mod in model.named_modules() if _wraps(mod)})
    out = []
    for m in matches:
        if m.matched:
            continue
        if m.kind == "parameter":
            hint = f" (3-D parameters: {', '.join(expert_suffixes)})" if experts else ""
            out.append(
                error(
                    "lora.target_parameters",
                    f"lora.target_parameters entry {m.target!r} matches no parameter of the model",
                    f"remove it, or name a parameter by its path{hint}",
                )
            )
        elif m.unsupported:
            example = m.unsupported[0]
            kind = type(model.get_submodule(example)).__name__
            out.append(
                error(
                    "lora.target_modules",
                    f"lora.target_modules entry {m.target!r} matches only modules LoRA cannot "
                    f"wrap ({kind}, e.g. {example})",
                    "target the linear layers inside it by name",
                )
            )
        elif experts and _names_an_mlp_projection(m.target, experts):
            out.append(
                error(
                    "lora.target_modules",
                    f"lora.target_modules entry {m.target!r} matches no module of the model: "
                    "its MoE experts are 3-D parameters, which target_modules never match, so "
                    "the adapter would silently not train them",
                    f"remove {m.target!r} from lora.target_modules and set "
                    f"lora.target_parameters=[{','.join(expert_suffixes)}]",
                )
            )
        else:
            close = difflib.get_close_matches(m.target, leaves, n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            out.append(
                error(
                    "lora.target_modules",
                    f"lora.target_modules entry {m.target!r} matches no module of the model",
                    f"remove it, or name a linear layer of the model{hint}",
                )
            )
    return out


#: names of dense-MLP projections, which MoE models keep only as 3-D expert parameters
MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj", "gate_up_proj", "w1", "w2", "w3")


def _names_an_mlp_projection(target: str, expert_params: list[str]) -> bool:
    leaf = target.rsplit(".", 1)[-1]
    return leaf in MLP_PROJECTIONS or any(p.endswith(leaf) for p in expert_params)


def _wraps(module: torch.nn.Module) -> bool:
    from packline.train.setup import LORA_MODULE_TYPES

    return isinstance(module, LORA_MODULE_TYPES)


# --- the stage ------------------------------------------------------------------------------


def collect(
    cfg: PipelineConfig, inputs: Inputs, megatron: tuple[list[Finding], list[Check]]
) -> tuple[list[Finding], list[Check]]:
    """Every rule, in order: config sections, guardrails, SLURM, Megatron, data, model."""
    findings: list[Finding] = []
    checks: list[Check] = []
    for found, ran in (
        section_findings(cfg),
        CONFIG_RULES.run(cfg),
        SLURM_RULES.run(cfg),
        megatron,
        DATA_RULES.run(inputs),
        MODEL_RULES.run(inputs),
    ):
        findings += found
        checks += ran
    return findings, checks


def findings_table(findings: list[Finding], num_rules: int):
    """The readable summary: one row per error and warning."""
    from rich.markup import escape
    from rich.table import Table

    errors = sum(f.severity == "error" for f in findings)
    table = Table(
        title=f"validate: {errors} error(s), {len(findings) - errors} warning(s) "
        f"from {num_rules} rules",
        title_justify="left",
        show_lines=True,
    )
    for col in ("", "setting", "rule", "problem", "fix"):
        table.add_column(col, overflow="fold")
    for f in sorted(findings, key=lambda f: f.severity != "error"):
        level = "[red]error[/]" if f.severity == "error" else "[yellow]warning[/]"
        table.add_row(level, *(escape(t) for t in (f.setting, f.requires, f.message, f.fix)))
    return table


def validate_config(cfg: PipelineConfig, fp: str | None = None) -> StageResult:
    """Check the config, connect's data and the model against each other, all at once."""
    t0 = time.perf_counter()
    fp = fp or stage_fingerprint(cfg, STAGE)
    require_record(cfg, "connect", by="validate")
    megatron_found, megatron_ran, run = megatron_findings(cfg)
    inputs = load_inputs(cfg, bridge_alignment(run) if run is not None else None)
    findings, checks = collect(cfg, inputs, (megatron_found, megatron_ran))
    errors = [f for f in findings if f.severity == "error"]
    warnings = [f for f in findings if f.severity == "warning"]
    # connect's FLOPs forecast of one epoch, packing on vs off: shown again here, the last
    # look before training, as the `flops/*` metrics connect logged.
    forecast_path = stage_dir(cfg, "connect") / "forecast.json"
    flops = (
        json.loads(forecast_path.read_text()).get("flops", {}) if forecast_path.is_file() else {}
    )
    inputs.facts["flops_forecast"] = flops
    report = {
        "ok": not errors,
        "errors": [f.to_dict() for f in errors],
        "warnings": [f.to_dict() for f in warnings],
        "checks": [c.to_dict() for c in checks],
        "facts": inputs.facts,
        "packline_version": packline.__version__,
    }
    with building(cfg, STAGE) as out:
        (out / "report.json").write_text(json.dumps(report, indent=2))
        (out / "pipeline.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create(cfg.to_dict())))
    out_dir = stage_dir(cfg, STAGE)
    if findings:
        console.print(findings_table(findings, len(checks)))
    else:
        console.log(f"[green]validate: all {len(checks)} rules hold[/]")
    if errors:
        raise UserError(
            [f.text for f in errors],
            f"validate: {len(errors)} error(s) (and {len(warnings)} warning(s)); report: "
            f"{out_dir / 'report.json'}",
        )
    facts = inputs.facts
    metrics: dict[str, float] = {
        "validate/rules": len(checks),
        "validate/errors": 0,
        "validate/warnings": len(warnings),
        "validate/overlength": facts.get("overlength", {}).get("samples", 0),
    }
    if "forecast_fill" in facts:
        metrics["validate/forecast_fill"] = facts["forecast_fill"]["fill"]
    if "worker_memory" in facts:
        wm = facts["worker_memory"]
        metrics["validate/worker_memory_gib"] = wm["per_worker_gib"][wm["mode"]]
    metrics.update({f"flops/{k}": v for k, v in flops.items()})
    result = StageResult(
        stage=STAGE,
        out_dir=out_dir,
        fingerprint=fp,
        skipped=False,
        metrics={k: float(v) for k, v in metrics.items()},
        summary={
            "warnings": [f.text for f in warnings],
            "artifacts": [str(out_dir / "report.json"), str(out_dir / "pipeline.yaml")],
        },
        seconds=time.perf_counter() - t0,
    )
    write_record(cfg, result)
    return result
