"""A conversation folder with video rows, written as real video files (PyAV) in a tmp dir:
good rows of each container caveat prepare counts, and one row of each bad kind.

Made for a prepare run with ``prepare.max_videos=2``, ``prepare.max_frames_per_video=8``
and ``prepare.max_video_seconds=20`` (:data:`VIDEO_LIMITS`); with the tiny processor's
sampling (2 frames per second, at least 4, at most the clip's own count).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from PIL import Image

from packline.media.video import write_video

#: The overrides the folder's bad rows are made for.
VIDEO_LIMITS = (
    "prepare.max_videos=2",
    "prepare.max_frames_per_video=8",
    "prepare.max_video_seconds=20",
)
HEIGHT, WIDTH = 48, 64


def moving_square(num_frames: int, height: int = HEIGHT, width: int = WIDTH) -> np.ndarray:
    """``(T, H, W, 3)`` uint8 frames: a white square moving right over a noisy blue
    background (the noise keeps the encoded frames from being all alike), deterministic."""
    rng = np.random.default_rng(num_frames * 1000 + height + width)
    frames = np.zeros((num_frames, height, width, 3), dtype=np.uint8)
    frames[..., 2] = 160
    frames[..., 1] = rng.integers(0, 64, (num_frames, height, width), dtype=np.uint8)
    for t in range(num_frames):
        x = (4 * t) % (width - 8)
        frames[t, 8:16, x : x + 8] = 255
    return frames


def decodable_frames(data: bytes) -> int:
    """Frames PyAV decodes from ``data`` before the stream ends or breaks."""
    import io

    import av

    count = 0
    with av.open(io.BytesIO(data)) as container:
        try:
            for _ in container.decode(container.streams.video[0]):
                count += 1
        except Exception:  # a damaged tail: keep what decoded
            pass
    return count


def _row(rid: str, videos: list[str], text: str = "<video>\nWhich way?", **extra) -> str:
    conv = [{"role": "user", "content": text}, {"role": "assistant", "content": "right"}]
    return json.dumps({"id": rid, "videos": videos, "conversations": conv, **extra})


@dataclass
class VideoFolder:
    folder: Path
    #: good row id → (its videos' paths, the frames each file holds)
    good: dict[str, list[tuple[str, int]]] = field(default_factory=dict)
    #: bad row id → (reject reason, a piece its detail must hold)
    bad: dict[str, tuple[str, str]] = field(default_factory=dict)
    #: the faststart mp4 cut in the middle: (path, frames its header announces)
    truncated: tuple[str, int] = ("", 0)


def make_video_folder(root: Path) -> VideoFolder:
    """Good video rows (mp4, Matroska and WebM without a frame count, an odd count, a clip
    under ``min_frames``, a rotated one, one cut short, one mixed with an image, one in HF
    part form) and one row of each bad video kind."""
    folder = root / "videos"
    clips = folder / "clips"
    clips.mkdir(parents=True)
    vf = VideoFolder(folder=folder)

    def clip(name: str, num_frames: int, fps: float = 4.0, **kwargs) -> str:
        write_video(clips / name, moving_square(num_frames), fps, **kwargs)
        return f"clips/{name}"

    lines: list[str] = []
    good = {
        "v_mp4": [(clip("ten.mp4", 10), 10)],
        "v_mkv": [(clip("ten.mkv", 10), 10)],  # Matroska: no frame count in the header
        "v_webm": [(clip("eight.webm", 8, codec="libvpx-vp9"), 8)],
        "v_odd": [(clip("seven.mp4", 7, fps=2.0), 7)],  # 7 frames sampled: odd, padded later
        "v_short": [(clip("three.mp4", 3), 3)],  # under min_frames 4: all 3 are sampled
        "v_rot": [(clip("rotated.mp4", 6, rotation=90), 6)],
        # A variable frame rate (irregular frame times): sampled at its average rate, counted.
        "v_vfr": [(clip("vfr.mp4", 8, times=[0, 0.2, 0.25, 0.6, 0.9, 1.3, 1.5, 2.0]), 8)],
    }
    for rid, videos in good.items():
        if rid == "v_mkv":  # no marker: the video goes before the user's text
            lines.append(_row(rid, [p for p, _ in videos], "Which way does it move?"))
        else:
            lines.append(_row(rid, [p for p, _ in videos]))

    # Cut in the middle, a faststart mp4 still announces its 20 frames: counted, not trusted.
    whole = write_video(clips / "whole.mp4", moving_square(20), 4.0, faststart=True).read_bytes()
    cut = whole[: len(whole) // 2]
    (clips / "cut.mp4").write_bytes(cut)
    vf.truncated = ("clips/cut.mp4", 20)
    good["v_cut"] = [("clips/cut.mp4", decodable_frames(cut))]
    lines.append(_row("v_cut", ["clips/cut.mp4"]))

    # An image and a video in one row, the video first.
    (folder / "img").mkdir()
    Image.new("RGB", (64, 64), "red").save(folder / "img" / "red.png")
    good["v_mixed"] = [(clip("mixed.mp4", 10), 10)]
    lines.append(
        json.dumps(
            {
                "id": "v_mixed",
                "images": ["img/red.png"],
                "videos": ["clips/mixed.mp4"],
                "conversations": [
                    {"role": "user", "content": "<video>\nIs the square <image> this colour?"},
                    {"role": "assistant", "content": "no"},
                ],
            }
        )
    )
    # HF part lists: {"type": "video"} parts read back as markers; two videos.
    good["v_parts"] = [("clips/ten.mp4", 10), ("clips/seven.mp4", 7)]
    lines.append(
        json.dumps(
            {
                "id": "v_parts",
                "videos": ["clips/ten.mp4", "clips/seven.mp4"],
                "conversations": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "video"},
                            {"type": "text", "text": "and"},
                            {"type": "video"},
                            {"type": "text", "text": ": same way?"},
                        ],
                    },
                    {"role": "assistant", "content": [{"type": "text", "text": "yes"}]},
                ],
            }
        )
    )
    vf.good = good

    (root / "outside.mp4").write_bytes((clips / "ten.mp4").read_bytes())
    (clips / "noise.mp4").write_bytes(np.random.default_rng(0).bytes(4096))
    plain = (clips / "ten.mp4").read_bytes()  # moov at the end: half of it has no index
    (clips / "half.mp4").write_bytes(plain[: len(plain) // 2])
    bad = {
        "b_missing": ("missing_video", ["clips/nope.mp4"], "'clips/nope.mp4' does not exist"),
        "b_absolute": ("video_path_unsafe", [str(clips / "ten.mp4")], "is absolute"),
        "b_escape": ("video_path_unsafe", ["../outside.mp4"], "escapes the data folder"),
        "b_noise": ("video_unreadable", ["clips/noise.mp4"], "not a video container"),
        "b_half": ("video_unreadable", ["clips/half.mp4"], "'clips/half.mp4'"),
        "b_one": (
            "video_too_short",
            [clip("one.mp4", 1)],
            "samples 1 frame(s), it needs at least 2",
        ),
        "b_many": (
            "too_many_videos",
            ["clips/ten.mp4"] * 3,
            "3 videos, prepare.max_videos is 2",
        ),
        "b_frames": (  # 6 s at 4 fps: 12 frames sampled at 2 fps
            "too_many_frames",
            [clip("frames.mp4", 24)],
            "samples 12 frames (at 2 fps), prepare.max_frames_per_video is 8",
        ),
        "b_long": (  # 8 frames at 0.25 fps: 32 s
            "video_too_long",
            [clip("slow.mp4", 8, fps=0.25)],
            "lasts 32.0 s, prepare.max_video_seconds is 20",
        ),
        "b_markers": ("marker_count_mismatch", ["clips/ten.mp4"], "2 <video> markers for 1"),
    }
    for rid, (reason, videos, detail) in bad.items():
        text = {"b_many": "<video><video><video> same?", "b_markers": "<video> or <video>?"}
        lines.append(_row(rid, videos, text.get(rid, "<video>\nWhich way?")))
        vf.bad[rid] = (reason, detail)
    (folder / "conversations.jsonl").write_text("\n".join(lines) + "\n")
    return vf
