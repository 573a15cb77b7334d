"""Videos: the header facts (PyAV), the cheap length rule against the real processor, and
the lazy encoder (sampled frames only) against the eager one (every frame, the processor
samples). Every clip is a real file written by :func:`packline.media.video.write_video`."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from packline.media.video import (
    VideoError,
    VideoHeader,
    decode_frames,
    probe_video,
    read_video_header,
    write_video,
)
from packline.qwen.encode import ConversationEncoder
from packline.qwen.lengths import DecodedVideo, cheap_lengths, exact_lengths
from packline.qwen.processor import copy_tiny_processor, load_processor
from packline.qwen.vision import VideoGeometry
from tests.integration.video_folder import decodable_frames

# (frames, height, width, fps, rotation, suffix): odd and even counts, fewer frames than
# min_frames, a 90° display rotation, containers with and without a frame count, a rate
# the 2-fps sampling divides unevenly, and a clip large enough to hit the pixel budget.
CLIPS = [
    (10, 64, 96, 4.0, 0, ".mp4"),
    (9, 64, 96, 4.0, 0, ".mp4"),
    (3, 64, 96, 4.0, 0, ".mp4"),
    (2, 64, 64, 2.0, 0, ".mp4"),
    (12, 64, 96, 4.0, 90, ".mp4"),
    (11, 96, 128, 4.0, 0, ".mkv"),
    (14, 64, 96, 6.0, 0, ".webm"),
    (25, 72, 136, 7.5, 0, ".mp4"),
    (40, 480, 640, 8.0, 0, ".mp4"),
]


def _frames(num: int, height: int, width: int, seed: int = 0) -> np.ndarray:
    """A bar moving right over noise: frames that differ, so a wrong index shows."""
    rng = np.random.default_rng(seed)
    frames = rng.integers(0, 60, (num, height, width, 3), dtype=np.uint8)
    for i in range(num):
        x = (i * 7) % max(1, width - 12)
        frames[i, :, x : x + 12] = 230
    return frames


@pytest.fixture(scope="module")
def clips(tmp_path_factory):
    out = tmp_path_factory.mktemp("clips")
    made = {}
    for i, (num, height, width, fps, rotation, suffix) in enumerate(CLIPS):
        codec = "libvpx" if suffix == ".webm" else "libx264"
        path = write_video(
            out / f"clip{i}{suffix}",
            _frames(num, height, width, seed=i),
            fps,
            codec=codec,
            rotation=rotation,
        )
        made[CLIPS[i]] = path.read_bytes()
    return made


@pytest.fixture(scope="module")
def processor_dir(tmp_path_factory):
    return copy_tiny_processor(tmp_path_factory.mktemp("proc") / "processor")


@pytest.fixture(scope="module")
def encoder(processor_dir):
    return ConversationEncoder(processor_dir)


def _conversation(num_videos: int, num_images: int = 0) -> list[dict]:
    media = [{"type": "image"}] * num_images + [{"type": "video"}] * num_videos
    return [
        {"role": "system", "content": "You are a helpful assistant."},
        {
            "role": "user",
            "content": [*media, {"type": "text", "text": "Which way does the bar move?"}],
        },
        {"role": "assistant", "content": [{"type": "text", "text": "It moves right."}]},
        {"role": "user", "content": [{"type": "text", "text": "How fast?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Seven pixels a frame."}]},
    ]


# -- packline.media.video ----------------------------------------------------------------------


def test_writer_is_deterministic(tmp_path):
    frames = _frames(9, 64, 96)
    a = write_video(tmp_path / "a.mp4", frames, 4.0).read_bytes()
    b = write_video(tmp_path / "b.mp4", frames, 4.0).read_bytes()
    assert a == b


def test_header_and_probe_agree_where_the_header_counts_frames(clips):
    data = clips[(10, 64, 96, 4.0, 0, ".mp4")]
    header = read_video_header(data)
    assert header == probe_video(data)
    assert (header.num_frames, header.fps, header.width, header.height) == (10, 4.0, 96, 64)
    assert header.duration == pytest.approx(2.5)
    assert not header.counted


def test_probe_counts_the_frames_a_container_does_not_announce(clips):
    data = clips[(11, 96, 128, 4.0, 0, ".mkv")]
    assert read_video_header(data).num_frames == 0  # Matroska writes no frame count
    probed = probe_video(data)
    assert probed.num_frames == 11 and probed.counted and probed.announced_frames == 0


def test_rotation_gives_the_display_size_and_upright_frames(clips):
    data = clips[(12, 64, 96, 4.0, 90, ".mp4")]
    header = probe_video(data)
    assert (header.rotation, header.width, header.height) == (90, 64, 96)
    frames = decode_frames(data, [0, 5])
    assert frames.shape == (2, 96, 64, 3)


def test_decode_keeps_only_the_asked_frames_in_order(clips):
    data = clips[(10, 64, 96, 4.0, 0, ".mp4")]
    every = decode_frames(data, range(10))
    some = decode_frames(data, [0, 2, 4, 4, 9])
    assert some.shape == (5, 64, 96, 3)
    assert np.array_equal(some, every[[0, 2, 4, 4, 9]])
    with pytest.raises(VideoError, match="frame 12 asked for"):
        decode_frames(data, [0, 12])


def test_unreadable_bytes_raise_video_error(clips):
    with pytest.raises(VideoError):
        probe_video(b"not a video at all")
    whole = clips[(10, 64, 96, 4.0, 0, ".mp4")]
    with pytest.raises(VideoError):
        probe_video(whole[: len(whole) // 2])  # the index (moov) is at the end: cut away


def test_a_damaged_stream_keeps_its_decoded_count_never_the_announced_one(clips):
    whole = clips[(11, 96, 128, 4.0, 0, ".mkv")]
    cut = whole[: int(len(whole) * 0.6)]  # Matroska: the frames before the cut decode
    header = probe_video(cut)
    decoded = decodable_frames(cut)  # PyAV's own count, outside packline.media.video
    assert header.num_frames == decoded < 11
    assert header.counted


def test_a_variable_frame_rate_is_counted_and_sampled_at_its_average_rate(processor_dir, tmp_path):
    """Frame times 0, 0.25, 0.4, 0.9, ... s: prepare's probe marks the rate variable, and
    the length follows the average rate (10 frames in 2.9 s), as the processor's own
    sampling and timestamps do; the cheap count still equals the processor's."""
    times = [0.0, 0.25, 0.4, 0.9, 1.0, 1.5, 1.6, 2.25, 2.5, 3.0]
    data = write_video(tmp_path / "vfr.mp4", _frames(10, 64, 96), 4.0, times=times).read_bytes()
    header = probe_video(data)
    assert header.variable_rate and not read_video_header(data).variable_rate
    assert header.num_frames == 10 and header.fps == pytest.approx(10 / 2.9)
    processor = load_processor(processor_dir)
    decoded = DecodedVideo(decode_frames(data, range(10)), header)
    exact = exact_lengths(processor, _conversation(1), [], videos=[decoded])
    assert cheap_lengths(processor, _conversation(1), [], video_headers=[header]) == exact
    assert exact.video_frame_counts == (int(10 / header.fps * 2),)  # 5 frames at 2 fps


def test_header_round_trips_through_json(clips):
    header = probe_video(clips[(12, 64, 96, 4.0, 90, ".mp4")])
    assert VideoHeader.from_dict(json.loads(json.dumps(header.to_dict()))) == header


# -- cheap length == processor length --------------------------------------------------------


@pytest.mark.parametrize("clip", CLIPS, ids=lambda c: f"{c[0]}f{c[1]}x{c[2]}@{c[3]}{c[5]}")
def test_cheap_video_length_equals_the_processor(processor_dir, clips, clip):
    processor = load_processor(processor_dir)
    data = clips[clip]
    header = probe_video(data)
    conversation = _conversation(1)
    if header.num_frames < 2:
        pytest.skip("covered by the too-short test")
    decoded = DecodedVideo(decode_frames(data, range(header.num_frames)), header)
    exact = exact_lengths(processor, conversation, [], videos=[decoded])
    cheap = cheap_lengths(processor, conversation, [], video_headers=[header])
    assert cheap == exact
    assert exact.num_videos == 1 and exact.video_tokens > 0
    assert exact.total_tokens == exact.text_tokens + exact.video_tokens


@pytest.mark.parametrize(
    "size,cap",
    [({"shortest_edge": 4096, "longest_edge": 25165824}, False), (None, True)],
    ids=["hub-size", "per-frame-cap"],
)
def test_cheap_length_follows_other_video_geometries(processor_dir, clips, size, cap):
    """Other bounds and the reference per-frame cap: the rule reads them from the loaded
    video processor and still equals the processor."""
    processor = load_processor(processor_dir)
    if size:
        processor.video_processor.size = size
    processor.video_processor.cap_pixels_per_frame = cap
    for clip in [c for c in CLIPS if c[0] >= 2]:
        data = clips[clip]
        header = probe_video(data)
        decoded = DecodedVideo(decode_frames(data, range(header.num_frames)), header)
        conversation = _conversation(1)
        exact = exact_lengths(processor, conversation, [], videos=[decoded])
        assert cheap_lengths(processor, conversation, [], video_headers=[header]) == exact


def test_two_videos_and_an_image_in_one_conversation(processor_dir, clips):
    from PIL import Image

    processor = load_processor(processor_dir)
    first, second = clips[CLIPS[0]], clips[CLIPS[5]]
    headers = [probe_video(first), probe_video(second)]
    decoded = [
        DecodedVideo(decode_frames(d, range(h.num_frames)), h)
        for d, h in zip([first, second], headers, strict=True)
    ]
    conversation = _conversation(2, num_images=1)
    image = Image.new("RGB", (300, 200), (200, 30, 30))
    exact = exact_lengths(processor, conversation, [image], videos=decoded)
    cheap = cheap_lengths(processor, conversation, [(300, 200)], video_headers=headers)
    assert cheap == exact
    assert (exact.num_images, exact.num_videos, exact.image_tokens) == (1, 2, 54)


def test_a_one_frame_video_is_refused_as_the_processor_refuses_it(processor_dir, tmp_path):
    processor = load_processor(processor_dir)
    data = write_video(tmp_path / "one.mp4", _frames(1, 64, 64), 4.0).read_bytes()
    header = probe_video(data)
    decoded = DecodedVideo(decode_frames(data, [0]), header)
    with pytest.raises(ValueError, match="must be larger than temporal_factor"):
        exact_lengths(processor, _conversation(1), [], videos=[decoded])
    with pytest.raises(ValueError, match="must be larger than temporal_factor"):
        cheap_lengths(processor, _conversation(1), [], video_headers=[header])


def test_the_span_of_a_video_is_its_groups_and_timestamps(processor_dir, clips):
    """10 frames at 4 fps, 2-fps sampling: frames 0,2,4,7,9 → 3 groups (the last padded),
    timestamps 0.2, 1.4 and 2.2 s (the mean of each group's two frame times)."""
    processor = load_processor(processor_dir)
    header = probe_video(clips[CLIPS[0]])
    geometry = VideoGeometry.of(processor.video_processor)
    assert geometry.sample_indices(10, 4.0).tolist() == [0, 2, 4, 7, 9]
    text = geometry.placeholder(header.num_frames, header.fps, header.height, header.width)
    assert [part.split(">")[0] for part in text.split("<")[1:] if "seconds" in part] == [
        "0.2 seconds",
        "1.4 seconds",
        "2.2 seconds",
    ]
    assert text.count("<|vision_start|>") == text.count("<|vision_end|>") == 3
    assert text.count("<|video_pad|>") == 3 * (4 * 6) // 4


# -- lazy encoder == eager encoder -------------------------------------------------------


def test_lazy_video_encoding_equals_the_eager_processor(encoder, clips):
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (128, 96), (10, 200, 30)).save(buf, format="PNG")
    image = buf.getvalue()
    for clip in [c for c in CLIPS if c[0] >= 2]:
        data = clips[clip]
        header = probe_video(data)
        conversation = _conversation(1, num_images=1)
        tok = encoder.tokenize("k", conversation, [image], [data], [header])
        lazy = encoder.finish(tok)
        eager = encoder.encode_eager("k", conversation, [image], [data], [header.to_dict()])
        assert torch.equal(lazy.input_ids, eager.input_ids), clip
        assert torch.equal(lazy.target_mask, eager.target_mask), clip
        assert torch.equal(lazy.mrope, eager.mrope), clip
        assert torch.equal(lazy.video_grid_thw, eager.video_grid_thw), clip
        assert torch.equal(lazy.pixel_values_videos, eager.pixel_values_videos), clip
        assert torch.equal(lazy.pixel_values, eager.pixel_values), clip
        assert (
            lazy.video_frames
            == eager.video_frames
            == len(encoder.video_geometry.sample_indices(header.num_frames, header.fps))
        )


def test_video_positions_restart_per_temporal_group(encoder, clips):
    """Each temporal group is its own block of M-RoPE positions: constant temporal index
    within a group, height/width offsets from the group's start, and the text after a group
    continuing from the group's largest spatial position, as the model's rope index does."""
    data = clips[CLIPS[0]]
    header = probe_video(data)
    conv = encoder.finish(encoder.tokenize("k", _conversation(1), [], [data], [header]))
    ids = conv.input_ids
    is_video = ids == encoder.video_token_id
    starts = torch.nonzero(is_video & ~torch.roll(is_video, 1)).view(-1).tolist()
    assert len(starts) == 3  # frames 0,2 | 4,7 | 9,9
    t, gh, gw = conv.video_grid_thw[0].tolist()
    per_group = gh * gw // 4
    for start in starts:
        block = conv.mrope[:, start : start + per_group]
        assert (block[0] == block[0, 0]).all()
        assert block[1].max() - block[1].min() == gh // 2 - 1
        assert block[2].max() - block[2].min() == gw // 2 - 1
        after = conv.mrope[:, start + per_group]
        assert (after == block[0, 0] + max(gh, gw) // 2).all()
