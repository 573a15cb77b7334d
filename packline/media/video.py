"""Video files: the header facts a length needs, the check prepare runs, frame decoding and
writing, through PyAV (a PyPI package that ships its own FFmpeg).

A video's token count depends on its frame count, frame rate and frame size only (the
processor samples frames from the count and rate, and resizes every frame of a clip to one
size). :func:`read_video_header` reads what a container claims about them without decoding
more than one frame; the cheap length rule takes the facts prepare recorded instead, which
:func:`probe_video` checks against the decoded frames.

Containers do not always tell the truth, so prepare runs :func:`probe_video`, which decodes
every frame once (as it does for images) and turns each known caveat into a recorded fact
rather than a wrong length:

- no frame count in the header (Matroska/WebM write none): the decoded frames are counted
  (``counted``);
- fewer frames decoded than the header announces (a truncated or damaged file): the decoded
  count is used (``counted``) and ``announced_frames`` keeps the header's;
- variable frame rate: the average rate is used, as HF's PyAV reader does
  (``variable_rate``); timestamps are then frame index / average rate;
- display rotation (phones): the frames are rotated upright, so ``width``/``height`` are the
  display size; the processor sees upright frames.

The :class:`VideoHeader` prepare records travels with the sample, so connect and the loader
compute the same length from it that the decoded frames give.
"""

from __future__ import annotations

import io
from dataclasses import asdict, dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np


class VideoError(ValueError):
    """Bytes that hold no decodable video stream (or a broken one)."""


@dataclass(frozen=True, kw_only=True)
class VideoHeader:
    """What a length needs to know about one video."""

    num_frames: int
    """Frames the stream holds: the header's count, or the decoded count (``counted``)."""
    fps: float
    """Average frame rate (frames per second)."""
    width: int
    """Display width in pixels (after rotation)."""
    height: int
    """Display height in pixels (after rotation)."""
    duration: float
    """Seconds, ``num_frames / fps``."""
    rotation: int = 0
    """Display rotation in degrees counter-clockwise (0, 90, 180, 270)."""
    counted: bool = False
    """True when ``num_frames`` comes from decoding, not from the header."""
    announced_frames: int | None = None
    """The header's frame count when it differs from ``num_frames`` (None: no difference)."""
    variable_rate: bool = False
    """True when the frame durations vary (``fps`` is then the average)."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> VideoHeader:
        return cls(**doc)


def _open(data: bytes | str | Path):
    import av

    source = io.BytesIO(data) if isinstance(data, (bytes, bytearray)) else str(data)
    try:
        container = av.open(source, mode="r")
    except Exception as exc:  # av.error.InvalidDataError, FileNotFoundError, ...
        raise VideoError(f"not a video container: {exc}") from None
    if not container.streams.video:
        container.close()
        raise VideoError("the container holds no video stream")
    return container


def _rate(stream) -> float:
    rate = stream.average_rate or stream.guessed_rate or stream.base_rate
    if not rate:
        raise VideoError("the video stream has no frame rate")
    return float(Fraction(rate))


def _rotation(frame) -> int:
    return int(round(getattr(frame, "rotation", 0) or 0)) % 360


def _upright_size(width: int, height: int, rotation: int) -> tuple[int, int]:
    return (height, width) if rotation in (90, 270) else (width, height)


def read_video_header(data: bytes | str | Path) -> VideoHeader:
    """Frame count, rate and display size from the container, decoding at most the first
    frame (for its rotation). ``num_frames`` is 0 when the container announces none; use
    :func:`probe_video` for a count that is always right."""
    with _open(data) as container:
        stream = container.streams.video[0]
        fps = _rate(stream)
        try:
            first = next(container.decode(stream))
        except (StopIteration, Exception) as exc:
            raise VideoError(f"no frame decodes: {exc}") from None
        rotation = _rotation(first)
        width, height = _upright_size(first.width, first.height, rotation)
        frames = int(stream.frames or 0)
    return VideoHeader(
        num_frames=frames,
        fps=fps,
        width=width,
        height=height,
        duration=frames / fps,
        rotation=rotation,
    )


def probe_video(data: bytes | str | Path) -> VideoHeader:
    """Decode every frame once and return the facts the frames give (see the module
    docstring). Raises :class:`VideoError` when no frame decodes or the frame size changes
    within the stream."""
    with _open(data) as container:
        stream = container.streams.video[0]
        fps = _rate(stream)
        announced = int(stream.frames or 0)
        decoded = 0
        size = None
        rotation = 0
        pts: list[int] = []
        try:
            for frame in container.decode(stream):
                if size is None:
                    size, rotation = (frame.width, frame.height), _rotation(frame)
                elif (frame.width, frame.height) != size:
                    raise VideoError(
                        f"the frame size changes from {size[0]}x{size[1]} to "
                        f"{frame.width}x{frame.height} at frame {decoded}"
                    )
                if frame.pts is not None:
                    pts.append(int(frame.pts))
                decoded += 1
        except VideoError:
            raise
        except Exception as exc:  # a damaged stream: keep what decoded, unless nothing did
            if decoded == 0:
                raise VideoError(f"no frame decodes: {exc}") from None
    if decoded == 0 or size is None:
        raise VideoError("the video stream holds no decodable frame")
    steps = np.diff(np.asarray(sorted(pts))) if len(pts) > 2 else np.zeros(0)
    width, height = _upright_size(*size, rotation)
    return VideoHeader(
        num_frames=decoded,
        fps=fps,
        width=width,
        height=height,
        duration=decoded / fps,
        rotation=rotation,
        counted=announced != decoded,
        announced_frames=announced if announced != decoded else None,
        variable_rate=bool(len(steps) and steps.min() != steps.max()),
    )


def decode_frames(
    data: bytes | str | Path, indices: list[int] | np.ndarray, *, rotation: int | None = None
) -> np.ndarray:
    """The frames at ``indices`` (sorted, repeats allowed) as one ``(n, H, W, 3)`` uint8 RGB
    array, upright. Frames are decoded in stream order up to the last index (a codec decodes
    the frames a picture refers to), and only the chosen ones are converted and kept.
    ``rotation`` defaults to what the frames say."""
    wanted = [int(i) for i in indices]
    if not wanted:
        raise ValueError("no frame index given")
    if wanted != sorted(wanted) or wanted[0] < 0:
        raise ValueError(f"frame indices must be sorted and non-negative, got {wanted[:8]}...")
    last = wanted[-1]
    kept: dict[int, np.ndarray] = {}
    needed = set(wanted)
    with _open(data) as container:
        stream = container.streams.video[0]
        for i, frame in enumerate(container.decode(stream)):
            if i in needed:
                turn = _rotation(frame) if rotation is None else rotation
                rgb = frame.to_ndarray(format="rgb24")
                kept[i] = np.ascontiguousarray(np.rot90(rgb, k=turn // 90)) if turn else rgb
            if i >= last:
                break
    if last not in kept:
        raise VideoError(f"frame {last} asked for, but the stream ended at {len(kept)} kept")
    return np.stack([kept[i] for i in wanted])


def write_video(
    path: str | Path,
    frames: np.ndarray,
    fps: float,
    *,
    codec: str = "libx264",
    container: str | None = None,
    rotation: int = 0,
    crf: int = 18,
    faststart: bool = False,
    times: list[float] | None = None,
) -> Path:
    """Encode ``frames`` ((T, H, W, 3) uint8 RGB, H and W even) into a video file, one
    encoder thread and no x264 macroblock tree so the same frames give the same bytes.
    ``container`` defaults from the suffix (``.mp4``, ``.mkv``, ``.webm``); ``rotation``
    writes a display rotation (what phones record); ``faststart`` puts an mp4's index
    before the frames, as streaming sites serve files (one cut short then still opens and
    announces all its frames); ``times`` (seconds, one per frame, increasing) writes a
    variable frame rate instead of ``fps``'s constant one. Returns ``path``."""
    import av

    frames = np.asarray(frames, dtype=np.uint8)
    if frames.ndim != 4 or frames.shape[-1] != 3:
        raise ValueError(f"frames must be (T, H, W, 3), got {frames.shape}")
    path = Path(path)
    fmt = container or {".mkv": "matroska", ".webm": "webm"}.get(path.suffix, "mp4")
    rate = Fraction(fps).limit_denominator(1001)
    container_options = {"movflags": "faststart"} if faststart else {}
    with av.open(str(path), mode="w", format=fmt, options=container_options) as out:
        options = {"threads": "1"}
        if codec == "libx264":
            # No macroblock tree: with it, x264's SIMD code gives the same frames differently
            # sized files from run to run (measured: 5 encodings of one clip in 100 runs); without
            # it, one. One thread is not enough.
            options.update(crf=str(crf), preset="medium", **{"x264-params": "no-mbtree=1"})
        stream = out.add_stream(codec, rate=rate, options=options)
        stream.height, stream.width = frames.shape[1:3]
        stream.pix_fmt = "yuv420p"
        stream.thread_count = 1
        if rotation:
            stream.set_display_rotation(rotation)
        if times is not None:
            if len(times) != len(frames):
                raise ValueError(f"{len(times)} times for {len(frames)} frames")
            stream.codec_context.time_base = Fraction(1, 1000)
        for i, array in enumerate(frames):
            frame = av.VideoFrame.from_ndarray(array, format="rgb24")
            if times is not None:
                frame.pts, frame.time_base = round(1000 * times[i]), Fraction(1, 1000)
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return path
