"""The data against the config: connect's tables checked as the run will read them (the
``data`` rules of validate)."""

from __future__ import annotations

import json
import math

import pandas as pd

from packline.backends import backend
from packline.energon.packing import buffered_sample_bytes
from packline.megatron.overrides import (
    MAX_NUM_FRAMES,
    extra_overrides,
)
from packline.packing.selection import align_up
from packline.qwen.processor import processor_geometry
from packline.rules.inputs import GIB, MIB, Inputs
from schemas.config import (
    OverlengthPolicy,
)
from schemas.rules import (
    Finding,
    RuleBook,
    error,
    warning,
)
from schemas.tables import cross_table_problems

# --- data against config (connect's tables) -------------------------------------------------

DATA_RULES = RuleBook()


@DATA_RULES.rule("data.current", "data", "connect's outputs were made under this config")
def _current(x: Inputs) -> list[Finding]:
    if x.connect_current:
        return []
    return [
        warning(
            "connect",
            f"connect's outputs in {x.connect_dir} were made under other "
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
def _tables(x: Inputs) -> list[Finding]:
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
def _overlength(x: Inputs) -> list[Finding]:
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
def _train_fits(x: Inputs) -> list[Finding]:
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


#: How a source gets validation rows, by what prepare read (the fix of ``data.val_rows``).
_VAL_ROWS_FIX = (
    'give rows "split": "val" (a folder or LLaVA file: or leave split out of some rows, '
    "prepare.val_fraction sends that share of them to val), or a val split part to an Energon "
    "dataset's .nv-meta/split.yaml"
)


@DATA_RULES.rule(
    "data.val_rows",
    "data",
    "the val split holds a sample that fits in packing.seq_length, when train.eval is on",
)
def _val_rows(x: Inputs) -> list[Finding]:
    seq = x.cfg.packing.seq_length
    aligned = _aligned(x)
    in_val = x.lengths["split"] == "val"
    fits = int((aligned[in_val] <= seq).sum())
    if fits:
        return []
    what = (
        "the data set has no validation rows"
        if not in_val.any()
        else f"none of the {int(in_val.sum())} validation samples fits in packing.seq_length {seq}"
    )
    if not x.cfg.train.eval:
        return [
            warning(
                "train.eval",
                f"{what}: the run trains without eval (train.eval is false) and reports no "
                "eval loss or accuracy",
                _VAL_ROWS_FIX,
            )
        ]
    return [
        error(
            "train.eval",
            f"{what}, and train.eval is on: the eval at the start of training would have "
            "nothing to read",
            f"{_VAL_ROWS_FIX}; or set train.eval=false to train without eval",
        )
    ]


@DATA_RULES.rule(
    "data.images_per_sample", "data", "no sample has more images than prepare.max_images"
)
def _images_per_sample(x: Inputs) -> list[Finding]:
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
def _frames_per_video(x: Inputs) -> list[Finding] | None:
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
def _visual_tokens_per_sample(x: Inputs) -> list[Finding]:
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
def _encoder_limits(x: Inputs) -> list[Finding] | None:
    if not backend(x.cfg).renders_for_bridge:
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
def _video_frames(x: Inputs) -> list[Finding] | None:

    b = x.bridge_videos
    if not backend(x.cfg).renders_for_bridge or not b:
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
                f"the processor dir Megatron-Bridge loads ({x.processor_dir}) samples "
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
def _video_timestamps(x: Inputs) -> list[Finding] | None:
    b = x.bridge_videos
    if not backend(x.cfg).renders_for_bridge or not b:
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
def _media_first(x: Inputs) -> list[Finding] | None:
    if not backend(x.cfg).renders_for_bridge:
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
def _forecast_fill(x: Inputs) -> list[Finding] | None:
    from packline.forecast import forecast_settings
    from packline.packing.forecast import forecast_fill

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
def _worker_memory(x: Inputs) -> list[Finding] | None:
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
