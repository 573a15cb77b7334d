"""Videos as Megatron-Bridge's Qwen-VL encoder takes them: the pixel-free rule
(:class:`~packline.qwen.vision.BridgeVideoRule`) against Bridge's own steps on pixels
(qwen-vl-utils' ``fetch_video`` on the frame list, then the processor called as Bridge calls
it: no fps, no metadata), with the processor dir sampling or not and a ``max_num_frames``
that cuts or not; the processor dir's ``do_sample_frames`` leaves packline's own path alone;
the sample loader Bridge runs. Bridge's own encoder reads the same videos in
``tests/integration/test_bridge_reads_prepare.py``."""

from __future__ import annotations

import json

import numpy as np
import pytest
from PIL import Image

from packline.energon import bridge_sample_loader
from packline.media.video import VideoHeader
from packline.qwen.lengths import (
    DecodedVideo,
    PresampledVideo,
    cheap_lengths,
    exact_lengths,
    media_first,
)
from packline.qwen.processor import copy_tiny_processor, load_processor
from packline.qwen.vision import BridgeVideoRule, bridge_fetch_video, set_video_sampling

# (pre-sampled frames, height, width): odd and even counts, one frame, small frames that
# qwen-vl-utils upscales, frames over its per-frame bound, a wide and a tall aspect, a count
# over max_num_frames 8.
SHAPES = [(1, 64, 96), (5, 64, 96), (6, 64, 96), (13, 64, 96), (8, 480, 640), (7, 38, 500)]
CONVERSATION = [
    {"role": "user", "content": [{"type": "text", "text": "Which way?"}, {"type": "video"}]},
    {"role": "assistant", "content": [{"type": "text", "text": "Right."}]},
]


@pytest.fixture(scope="module")
def processor_dir(tmp_path_factory):
    return copy_tiny_processor(tmp_path_factory.mktemp("bridge-video") / "processor")


def _frames(num: int, height: int, width: int) -> list[Image.Image]:
    rng = np.random.default_rng(num * 1000 + height + width)
    return [
        Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))
        for _ in range(num)
    ]


@pytest.mark.parametrize("sample", [False, True], ids=["kept", "resampled"])
@pytest.mark.parametrize("max_num_frames", [60, 8])
def test_bridge_rule_equals_bridges_steps_on_pixels(processor_dir, sample, max_num_frames):
    processor = load_processor(processor_dir)
    processor.video_processor.do_sample_frames = sample
    rule = BridgeVideoRule.of(processor, max_num_frames=max_num_frames)
    conversation = media_first(CONVERSATION)  # as Bridge renders it
    for num, height, width in SHAPES:
        kept = _frames(num, height, width)[:max_num_frames]  # encode_sample keeps the first
        video = PresampledVideo(bridge_fetch_video(kept), len(kept))
        exact = exact_lengths(processor, conversation, [], videos=[video], turn_newline=True)
        plan = rule.plan(num, height, width)
        cheap = cheap_lengths(processor, conversation, [], video_plans=[plan], turn_newline=True)
        assert cheap == exact, (num, height, width)
        assert exact.video_frame_counts == (plan.num_frames,)
    # sampling off keeps every frame; on, an assumed 24 fps leaves 4 of 13 (min_frames)
    thirteen = rule.plan(13, 64, 96)
    assert thirteen.num_frames == (4 if sample else min(13, max_num_frames))


def test_bridge_timestamps_are_positions_over_24_fps(processor_dir):
    rule = BridgeVideoRule.of(load_processor(processor_dir), max_num_frames=60)
    # sampling off (what connect writes for Bridge): qwen-vl-utils pads 7 frames to 8 (a copy
    # of the last at position 7), so the groups are positions (0, 1), (2, 3), (4, 5), (6, 7)
    rule = BridgeVideoRule(geometry=rule.geometry, do_sample_frames=False, max_num_frames=60)
    assert [round(t, 4) for t in rule.timestamps(7)] == [0.0208, 0.1042, 0.1875, 0.2708]
    assert rule.plan(7, 64, 96).placeholder.startswith("<0.0 seconds><|vision_start|>")


def test_a_processor_dir_that_samples_no_frames_leaves_packlines_path_alone(
    processor_dir, tmp_path
):
    """packline's own calls say do_sample_frames: the dir's value (false for Bridge) does
    not change what the local path samples and counts."""
    rng = np.random.default_rng(0)
    frames = rng.integers(0, 256, (10, 64, 96, 3), dtype=np.uint8)
    header = VideoHeader(num_frames=10, fps=4.0, width=96, height=64, duration=2.5)
    video = DecodedVideo(frames, header)
    sampling = exact_lengths(load_processor(processor_dir), CONVERSATION, [], videos=[video])
    off = copy_tiny_processor(tmp_path / "off")
    set_video_sampling(off, do_sample_frames=False)
    processor = load_processor(off)
    assert processor.video_processor.do_sample_frames is False
    assert exact_lengths(processor, CONVERSATION, [], videos=[video]) == sampling
    assert cheap_lengths(processor, CONVERSATION, [], video_headers=[header]) == sampling
    assert sampling.video_frame_counts == (5,)  # 2 fps of 4


def test_set_video_sampling_writes_the_combined_config_too(tmp_path):
    (tmp_path / "processor_config.json").write_text(json.dumps({"video_processor": {"fps": 2}}))
    set_video_sampling(tmp_path, do_sample_frames=False)
    saved = json.loads((tmp_path / "processor_config.json").read_text())
    assert saved["video_processor"] == {"fps": 2, "do_sample_frames": False}
    with pytest.raises(ValueError, match="no video processor config"):
        set_video_sampling(tmp_path / "none", do_sample_frames=False)


def test_bridge_sample_loader_gives_each_video_its_frames_in_order():
    raw = {
        "__key__": "k",
        "json": {"conversation": [], "videos": [{}, {}]},
        "img0.png": "image",
        "vid0.f010.png": "v0-10",
        "vid0.f002.png": "v0-2",
        "vid1.f000.png": "v1-0",
        "vid0.mp4": b"not for Bridge",
    }
    assert not bridge_sample_loader.part_filter("vid0.mp4")
    out = bridge_sample_loader.sample_loader(raw)
    assert out["imgs"] == ["image"]
    assert out["videos"] == [["v0-2", "v0-10"], ["v1-0"]]
    assert bridge_sample_loader.sample_loader({"json": b'{"conversation": []}'})["videos"] is None
    # a dataset prepared for the local backend has no frames: said, not a crash inside Bridge
    with pytest.raises(ValueError, match="prepare writes for train.backend megatron only"):
        bridge_sample_loader.sample_loader({"json": {"videos": [{}]}, "vid0.mp4": b""})
