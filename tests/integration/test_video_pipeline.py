"""Videos through the whole local flow: a user's folder of real video files and the built-in
set with video clips go through prepare, connect (every sample's cheap length equal to the
processor's), validate and training, where packing on and off give the same loss."""

from __future__ import annotations

import json
from itertools import islice

import pandas as pd
import torch

from packline.media.video import probe_video
from stages.connect import connect
from stages.prepare import prepare
from stages.validate import validate
from tests.conftest import make_config
from tests.integration.train_helpers import trainer_for
from tests.integration.video_folder import VIDEO_LIMITS, make_video_folder


def _same_step(cfg, tmp_path, *, min_videos: int = 1):
    """One optimizer step's rows, trained packed and unpacked: loss, targets, gradients."""
    packed = trainer_for(cfg, True, tmp_path / "p")
    unpacked = trainer_for(cfg, False, tmp_path / "u")
    rows = packed.step_rows()
    assert sum(r.num_videos for r in rows) >= min_videos, "the step holds no video"
    assert sum(r.num_conversations for r in rows) > len(rows)  # really several per row
    loss_p, n_p = packed.accumulate_gradients(packed.micro_batches(rows))
    micro_u = unpacked.micro_batches(rows)
    loss_u, n_u = unpacked.accumulate_gradients(micro_u)
    assert n_p == n_u
    assert abs(loss_p - loss_u) <= 1e-6, (loss_p, loss_u)
    gp = torch.cat([p.grad.flatten() for p in packed.params])
    gu = torch.cat([p.grad.flatten() for p in unpacked.params])
    cosine = torch.nn.functional.cosine_similarity(gp.double(), gu.double(), dim=0).item()
    assert cosine >= 0.99999, cosine
    return rows


def test_a_folder_of_videos_flows_from_prepare_to_a_training_step(tmp_path):
    vf = make_video_folder(tmp_path)
    cfg = make_config(
        tmp_path / "work",
        f"data.source={vf.folder}",
        *VIDEO_LIMITS,
        "prepare.max_reject_fraction=0.9",
        "prepare.val_fraction=0",
        "train.eval=false",  # no val rows (validate refuses an eval of nothing)
        "train.global_batch_size=2",
        "train.eval_samples=0",
        "packing.seq_length=1024",
    )
    prepare(cfg)
    result = connect(cfg)  # raises unless cheap == processor on every sample
    assert result.metrics["connect/cheap_mismatches"] == 0
    lengths = pd.read_parquet(result.out_dir / "lengths.parquet").set_index("key")
    assert set(lengths.index) == set(vf.good)
    for key, videos in vf.good.items():
        row = lengths.loc[key]
        assert row["num_videos"] == len(videos)
        counts = json.loads(row["video_frame_counts"])
        # The tiny processor samples 2 frames a second of the file's (average) rate, at
        # least 4 and at most the file's own frames: what the decoded files hold, not what
        # a header announces (the faststart mp4 cut short).
        for (path, frames), sampled in zip(videos, counts, strict=True):
            fps = probe_video(vf.folder / path).fps
            assert sampled == min(max(int(frames / fps * 2), 4), frames), (key, path)
        grids = json.loads(row["video_grids"])
        assert row["video_tokens"] == sum(t * h * w for t, h, w in grids) // 4
        assert row["video_frames"] == sum(counts)
    report = validate(cfg)
    assert report.metrics["validate/errors"] == 0
    _same_step(cfg, tmp_path, min_videos=2)


def test_the_built_in_set_with_video_trains_packed_and_unpacked_alike(tmp_path):
    cfg = make_config(
        tmp_path / "work",
        "data.num_train=40",
        "data.num_val=4",
        "data.video_share=0.5",
        "train.global_batch_size=2",
        "train.eval_samples=0",
    )
    prepare(cfg)
    connect(cfg)
    validate(cfg)
    rows = _same_step(cfg, tmp_path, min_videos=2)
    assert sum(r.num_video_frames for r in rows) > 0
    assert any(r.num_images for r in rows)  # video beside images in the same step


def test_video_rows_out_of_the_loader_are_the_same_lazy_and_eager(tmp_path):
    """The lazy encoder (exact length from headers, sampled frames decoded after selection)
    and the eager one (every frame decoded before) give the very same packed rows."""
    from packline.catalog import dataset_path, processor_dir
    from packline.energon.loader import train_loader
    from packline.energon.packing import PackingSettings, make_encoder

    cfg = make_config(
        tmp_path / "work", "data.num_train=24", "data.num_val=2", "data.video_share=0.6"
    )
    prepare(cfg)
    connect(cfg)
    settings = PackingSettings.from_config(cfg.packing, seed=cfg.train.seed)
    rows = {}
    for m in ("lazy", "eager"):
        loader = train_loader(
            dataset_path(cfg),
            make_encoder(m, processor_dir(cfg), settings),
            packing_buffer_size=8,
            num_workers=0,
        )
        rows[m] = [pack.batch for pack in islice(loader, 4)]
    assert sum(b.num_videos for b in rows["lazy"]) > 0
    for lazy, eager in zip(rows["lazy"], rows["eager"], strict=True):
        assert lazy.keys == eager.keys
        for name in ("input_ids", "labels", "position_ids", "cu_seqlens_padded"):
            assert torch.equal(getattr(lazy, name), getattr(eager, name)), name
        for name in ("pixel_values", "pixel_values_videos", "video_grid_thw"):
            a, b = getattr(lazy, name), getattr(eager, name)
            assert (a is None and b is None) or torch.equal(a, b), name
