"""Image geometry of the Qwen2-VL / Qwen3-VL image processor, without decoding pixels.

The processor resizes every image with ``smart_resize`` to a multiple of
``patch_size * merge_size`` within ``[min_pixels, max_pixels]``, cuts it into
``patch_size``-square patches and merges ``merge_size**2`` patches into one LLM token.
Knowing the image's width and height (read from the file header) is therefore enough to
know its exact number of visual tokens — the cheap path the packer relies on.

Megatron-Bridge's Qwen-VL path resizes twice: ``qwen_vl_utils.process_vision_info`` first
fits each image to its own 28-pixel grid (``fetch_image`` with its default patch size 14 and
its default pixel bounds), then the HF processor resizes that result to the processor's grid.
:attr:`ImageGeometry.qwen_vl_utils_resize` models that first step with qwen-vl-utils' own
``smart_resize`` and constants; :func:`bridge_fetch_image` runs it on pixels. A video reaches
Bridge as pre-sampled frames: :class:`BridgeVideoRule` models its steps on them (first frames
kept, qwen-vl-utils' two resizes, the processor with no frame rate) and
:func:`bridge_fetch_video` runs qwen-vl-utils' on pixels.
"""

from __future__ import annotations

import io
import json
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
from PIL import Image
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize
from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor
from transformers.models.qwen3_vl.video_processing_qwen3_vl import (
    smart_resize as video_smart_resize,
)
from transformers.video_utils import VideoMetadata

from schemas.facts import TINY_IMAGE, image_geometry_fields, image_processor_params


@dataclass(frozen=True, kw_only=True)
class ImageGeometry:
    """The parameters of the image processor that decide an image's token count."""

    # The defaults are the built-in tiny processor's (schemas.facts.TINY_IMAGE).
    patch_size: int = TINY_IMAGE["patch_size"]
    """Side of one ViT patch in pixels (Qwen3-VL: 16)."""
    merge_size: int = TINY_IMAGE["merge_size"]
    """Patches merged per side into one LLM token (2 → 4 patches per token)."""
    temporal_patch_size: int = TINY_IMAGE["temporal_patch_size"]
    """Frames per temporal patch; a still image is duplicated to fill it (t = 1)."""
    min_pixels: int = TINY_IMAGE["min_pixels"]
    """Images are upscaled to at least this many pixels."""
    max_pixels: int = TINY_IMAGE["max_pixels"]
    """Images are downscaled to at most this many pixels (here: 1,024 visual tokens)."""
    qwen_vl_utils_resize: bool = False
    """Resize first as Megatron-Bridge's Qwen path does (qwen-vl-utils' ``fetch_image``: a
    28-pixel grid within its default bounds), then by this geometry."""

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    @classmethod
    def from_processor_dir(cls, path: str | Path) -> ImageGeometry:
        """Read the geometry from a saved HF processor dir (``preprocessor_config.json`` or
        the ``image_processor`` entry of ``processor_config.json``)."""
        params = image_processor_params(path)
        if not params:
            raise ValueError(
                f"{path} holds no image processor config (preprocessor_config.json or "
                "processor_config.json with an 'image_processor' entry)"
            )
        return cls(**image_geometry_fields(params))

    def with_overrides(self, **overrides: int | bool) -> ImageGeometry:
        """This geometry with some fields replaced (e.g. a config's ``processor.*``)."""
        return replace(self, **overrides)

    def resized(self, height: int, width: int) -> tuple[int, int]:
        """(height, width) after the processor's resize rule; ``ValueError`` if it refuses
        the image (aspect ratio over 200, or an empty image)."""
        if height <= 0 or width <= 0:
            raise ValueError(f"image has no pixels ({width}x{height})")
        if self.qwen_vl_utils_resize:
            height, width = _qwen_vl_utils_size(height, width)
        return smart_resize(
            height,
            width,
            factor=self.factor,
            min_pixels=self.min_pixels,
            max_pixels=self.max_pixels,
        )

    def grid_thw(self, height: int, width: int) -> tuple[int, int, int]:
        """The processor's ``image_grid_thw`` row for one still image."""
        h, w = self.resized(height, width)
        return 1, h // self.patch_size, w // self.patch_size

    def visual_tokens(self, height: int, width: int) -> int:
        """Number of ``<|image_pad|>`` tokens the processor emits for one still image."""
        t, gh, gw = self.grid_thw(height, width)
        return t * gh * gw // (self.merge_size**2)


#: Where each geometry field lives in a processor dir's image and video processor configs.
_GEOMETRY_KEYS = {
    "patch_size": ("patch_size",),
    "temporal_patch_size": ("temporal_patch_size",),
    "merge_size": ("merge_size",),
    "min_pixels": ("size.shortest_edge", "min_pixels"),
    "max_pixels": ("size.longest_edge", "max_pixels"),
}


def set_processor_geometry(path: str | Path, **overrides: int) -> None:
    """Write geometry fields (``min_pixels=...``) into a saved processor dir's image
    processor config (``preprocessor_config.json``) and, for the patch sizes, its video
    processor config (``video_preprocessor_config.json``) when it has one; pixel bounds set
    both ``size`` and any legacy ``min_pixels``/``max_pixels`` key the file already holds."""
    path = Path(path)
    if unknown := set(overrides) - set(_GEOMETRY_KEYS):
        raise ValueError(f"not geometry fields: {sorted(unknown)}")
    files = [path / "preprocessor_config.json", path / "video_preprocessor_config.json"]
    if not files[0].is_file():
        raise ValueError(f"{path} has no preprocessor_config.json to write the geometry into")
    for file in files:
        if not file.is_file():
            continue
        params = json.loads(file.read_text())
        is_video = file.name.startswith("video")
        for name, value in overrides.items():
            if is_video and name in ("min_pixels", "max_pixels"):
                continue  # video bounds are per clip, not per image
            for key in _GEOMETRY_KEYS[name]:
                head, _, tail = key.partition(".")
                if tail:
                    params.setdefault(head, {})[tail] = int(value)
                elif key in params or key == _GEOMETRY_KEYS[name][0]:
                    params[key] = int(value)
        file.write_text(json.dumps(params, indent=2, sort_keys=True) + "\n")


def set_video_sampling(path: str | Path, *, do_sample_frames: bool) -> None:
    """Write ``do_sample_frames`` into a saved processor dir's video processor config
    (``video_preprocessor_config.json``, or the ``video_processor`` entry of
    ``processor_config.json``): whether the processor samples frames when a call does not
    say (packline's calls always say; Megatron-Bridge's never do)."""
    path = Path(path)
    video = path / "video_preprocessor_config.json"
    if video.is_file():
        params = json.loads(video.read_text())
        params["do_sample_frames"] = bool(do_sample_frames)
        video.write_text(json.dumps(params, indent=2, sort_keys=True) + "\n")
        return
    combined = path / "processor_config.json"
    params = json.loads(combined.read_text()) if combined.is_file() else {}
    if not isinstance(params.get("video_processor"), dict):
        raise ValueError(
            f"{path} has no video processor config (video_preprocessor_config.json or "
            "processor_config.json with a 'video_processor' entry) to set do_sample_frames in"
        )
    params["video_processor"]["do_sample_frames"] = bool(do_sample_frames)
    combined.write_text(json.dumps(params, indent=2, sort_keys=True) + "\n")


@dataclass(frozen=True, kw_only=True)
class VideoGeometry:
    """The parameters of the Qwen3-VL video processor that decide a video's token count.

    A video's span in the text follows from its frame count, frame rate and frame size
    (:class:`packline.media.video.VideoHeader`), with no pixel decoded:

    1. frames sampled at ``fps`` (at least ``min_frames``, at most ``max_frames`` and the
       clip's own count), evenly spaced: :meth:`sample_indices`, the processor's own
       ``sample_frames``;
    2. one size for every frame of the clip, from the whole clip's pixel budget
       (``num_frames · h · w`` within ``[min_pixels, max_pixels]``): :meth:`resized`;
    3. grid ``[ceil(T / temporal_patch_size), h / patch, w / patch]`` (an odd count is padded
       by repeating the last frame): :meth:`grid_thw`;
    4. per temporal group, the text ``<{t:.1f} seconds>`` (its mean timestamp) then
       ``<|vision_start|>``, ``h·w / merge²`` ``<|video_pad|>`` and ``<|vision_end|>``, inside
       the template's own outer vision start/end: :meth:`placeholder`, the processor's own
       ``replace_video_token``.

    Worked example (the tiny processor's geometry, a 10-frame 96×64 clip at 4 fps)::

        >>> g = VideoGeometry(min_pixels=64 * 64, max_pixels=1024 * 32 * 32)
        >>> g.sample_indices(10, 4.0).tolist()
        [0, 2, 4, 7, 9]
        >>> g.grid_thw(5, 64, 96)
        (3, 4, 6)
        >>> g.placeholder(10, 4.0, 64, 96).count("<|video_pad|>")
        18
        >>> g.placeholder(10, 4.0, 64, 96)[:29]
        '<0.2 seconds><|vision_start|>'
    """

    patch_size: int = 16
    merge_size: int = 2
    temporal_patch_size: int = 2
    min_pixels: int = 128 * 32 * 32
    """Lower bound of the whole clip's pixels (``size.shortest_edge``)."""
    max_pixels: int = 768 * 32 * 32
    """Upper bound of the whole clip's pixels (``size.longest_edge``)."""
    fps: float = 2.0
    """Frames sampled per second of video."""
    min_frames: int = 4
    max_frames: int = 768
    cap_pixels_per_frame: bool = False
    """The reference (qwen-vl-utils) per-frame cap: at most ``max_video_tokens`` merged
    patches, or the budget's even share, per frame."""
    max_video_tokens: int = 768

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    @classmethod
    def from_config(cls, params: dict) -> VideoGeometry:
        """From a video processor config (``video_preprocessor_config.json``'s dict)."""
        size = params.get("size") or {}
        defaults = cls()
        return cls(
            patch_size=int(params.get("patch_size", defaults.patch_size)),
            merge_size=int(params.get("merge_size", defaults.merge_size)),
            temporal_patch_size=int(
                params.get("temporal_patch_size", defaults.temporal_patch_size)
            ),
            min_pixels=int(size.get("shortest_edge", defaults.min_pixels)),
            max_pixels=int(size.get("longest_edge", defaults.max_pixels)),
            fps=float(params.get("fps") or defaults.fps),
            min_frames=int(params.get("min_frames", defaults.min_frames)),
            max_frames=int(params.get("max_frames", defaults.max_frames)),
            cap_pixels_per_frame=bool(params.get("cap_pixels_per_frame") or False),
            max_video_tokens=int(params.get("max_video_tokens", defaults.max_video_tokens)),
        )

    @classmethod
    def of(cls, video_processor: Qwen3VLVideoProcessor) -> VideoGeometry:
        """The geometry of a loaded video processor."""
        return cls.from_config(
            {
                "patch_size": video_processor.patch_size,
                "merge_size": video_processor.merge_size,
                "temporal_patch_size": video_processor.temporal_patch_size,
                "size": dict(video_processor.size),
                "fps": video_processor.fps,
                "min_frames": video_processor.min_frames,
                "max_frames": video_processor.max_frames,
                "cap_pixels_per_frame": video_processor.cap_pixels_per_frame,
                "max_video_tokens": video_processor.max_video_tokens,
            }
        )

    def with_overrides(self, **overrides) -> VideoGeometry:
        return replace(self, **overrides)

    def sample_indices(self, num_frames: int, fps: float) -> np.ndarray:
        """Indices of the frames the processor samples from a clip of ``num_frames`` at
        ``fps`` (its own ``sample_frames``)."""
        if num_frames < 1:
            raise ValueError(f"a video needs at least one frame, got {num_frames}")
        sampler = SimpleNamespace(
            fps=self.fps, min_frames=self.min_frames, max_frames=self.max_frames
        )
        metadata = VideoMetadata(total_num_frames=int(num_frames), fps=float(fps))
        return Qwen3VLVideoProcessor.sample_frames(sampler, metadata, fps=self.fps)

    def num_sampled(self, num_frames: int, fps: float) -> int:
        return len(self.sample_indices(num_frames, fps))

    def resized(self, num_frames: int, height: int, width: int) -> tuple[int, int]:
        """(height, width) of every frame of a clip of ``num_frames`` SAMPLED frames;
        ``ValueError`` when the processor refuses it (fewer than ``temporal_patch_size``
        frames, aspect ratio over 200)."""
        if height <= 0 or width <= 0:
            raise ValueError(f"video frames have no pixels ({width}x{height})")
        max_pixels = self.max_pixels
        if self.cap_pixels_per_frame:  # as Qwen3VLVideoProcessor.resize
            frame_cap = self.max_video_tokens * self.factor**2
            per_frame = max(
                min(frame_cap, self.max_pixels // num_frames), int(self.min_pixels * 1.05)
            )
            max_pixels = per_frame * num_frames
        return video_smart_resize(
            num_frames,
            height,
            width,
            temporal_factor=self.temporal_patch_size,
            factor=self.factor,
            min_pixels=self.min_pixels,
            max_pixels=max_pixels,
        )

    def grid_thw(self, num_frames: int, height: int, width: int) -> tuple[int, int, int]:
        """The processor's ``video_grid_thw`` row for ``num_frames`` sampled frames."""
        h, w = self.resized(num_frames, height, width)
        t = -(-num_frames // self.temporal_patch_size)
        return t, h // self.patch_size, w // self.patch_size

    def plan(
        self,
        num_frames: int,
        fps: float,
        height: int,
        width: int,
        *,
        indices: Sequence[int] | None = None,
        frames_seen: int | None = None,
    ) -> VideoPlan:
        """What the processor makes of a clip of ``num_frames`` at ``fps`` (the FILE's):
        the frames it samples, or the ``indices`` it took (see :meth:`placeholder`);
        ``frames_seen`` (default: their count) is the plan's ``num_frames``."""
        if indices is None:
            indices = self.sample_indices(num_frames, fps)
        t, gh, gw = self.grid_thw(len(indices), height, width)
        return VideoPlan(
            placeholder=self.placeholder(num_frames, fps, height, width, indices=indices),
            grid_thw=(t, gh, gw),
            num_frames=len(indices) if frames_seen is None else frames_seen,
            num_tokens=t * gh * gw // self.merge_size**2,
        )

    def timestamps(
        self, num_frames: int, fps: float, *, indices: Sequence[int] | None = None
    ) -> list[float]:
        """Seconds the processor writes before each temporal group (``<{t:.1f} seconds>``):
        the mean of the group's first and last frame index over ``fps`` (its own
        ``_calculate_timestamps``). ``indices`` are the frames it took from the clip; by
        default the ones it samples (:meth:`sample_indices`)."""
        if indices is None:
            indices = self.sample_indices(num_frames, fps)
        return Qwen3VLProcessor._calculate_timestamps(
            None, np.asarray(indices), float(fps), self.temporal_patch_size
        )

    def placeholder(
        self,
        num_frames: int,
        fps: float,
        height: int,
        width: int,
        *,
        indices: Sequence[int] | None = None,
    ) -> str:
        """The text the processor puts in place of the clip's one ``<|video_pad|>``
        (``num_frames`` and ``fps`` are the FILE's; sampling happens here, unless
        ``indices`` say which of its frames the processor took: the ones handed to it
        without sampling, for example)."""
        if indices is None:
            indices = self.sample_indices(num_frames, fps)
        indices = np.asarray(indices)
        grid = self.grid_thw(len(indices), height, width)
        metadata = VideoMetadata(
            total_num_frames=int(num_frames), fps=float(fps), frames_indices=indices
        )
        renderer = SimpleNamespace(
            video_processor=self,
            video_token="<|video_pad|>",
            vision_start_token="<|vision_start|>",
            vision_end_token="<|vision_end|>",
            _calculate_timestamps=lambda *a: Qwen3VLProcessor._calculate_timestamps(None, *a),
        )
        inputs = {"video_grid_thw": [np.asarray(grid)], "video_metadata": [metadata]}
        return Qwen3VLProcessor.replace_video_token(renderer, inputs, 0)


@dataclass(frozen=True)
class VideoPlan:
    """What the processor makes of one video, computed without pixels."""

    placeholder: str
    """The text in place of the video's one ``<|video_pad|>``: per temporal group its
    timestamp, ``<|vision_start|>``, its pads and ``<|vision_end|>``."""
    grid_thw: tuple[int, int, int]
    """Its ``video_grid_thw`` row."""
    num_frames: int
    """Frames of the video the vision tower sees (before an odd count is padded by
    repeating the last frame)."""
    num_tokens: int
    """Its ``<|video_pad|>`` tokens, ``t·h·w / merge²``."""


#: The frame rate the HF Qwen3-VL processor assumes for a video handed to it without metadata,
#: as Megatron-Bridge hands them: its ``sample_frames`` and its timestamps both default to 24.
ASSUMED_VIDEO_FPS = 24.0


@dataclass(frozen=True, kw_only=True)
class BridgeVideoRule:
    """What Megatron-Bridge's Qwen-VL encoder makes of one video given as ``N`` pre-sampled
    upright frames of ``H×W`` (its ``videos`` field), without pixels. Its steps, in order:

    1. the first ``max_num_frames`` frames are kept (``encode_sample``);
    2. qwen-vl-utils' ``fetch_video`` on the frame list (``process_vision_info`` with no
       arguments): each frame through ``fetch_image`` with the video's 28-pixel factor as
       its patch size (a 56-pixel grid within the image bounds), the list padded to an even
       count by repeating the last frame, then the whole clip resized to the 28-pixel grid
       within qwen-vl-utils' per-frame video bounds (at least 128 tokens of 28², at most 768
       or the ``MODEL_SEQ_LEN`` share): small frames are upscaled;
    3. the HF processor, called with no ``fps``, metadata or ``do_sample_frames``: the
       processor dir's ``do_sample_frames`` decides whether it samples again (at its ``fps``,
       from an assumed :data:`ASSUMED_VIDEO_FPS`) or keeps every frame; it resizes with its
       whole-clip budget (:meth:`VideoGeometry.grid_thw`) and writes each group's timestamp
       as the frames' POSITIONS over 24 fps, not the clip's real seconds
       (:meth:`VideoGeometry.placeholder` with those inputs).

    Worked example (the tiny processor, sampling off, 6 frames of 96×64)::

        >>> rule = BridgeVideoRule(geometry=VideoGeometry(min_pixels=64 * 64,
        ...     max_pixels=1024 * 32 * 32), do_sample_frames=False, max_num_frames=60)
        >>> rule.clip(6, 64, 96)  # upscaled by qwen-vl-utils
        (6, 280, 392)
        >>> plan = rule.plan(6, 64, 96)
        >>> plan.grid_thw, plan.placeholder[:13]
        ((3, 18, 24), '<0.0 seconds>')
        >>> [round(t, 3) for t in rule.timestamps(6)]
        [0.021, 0.104, 0.188]
    """

    geometry: VideoGeometry
    """The processor dir's video processor (sampling, whole-clip bounds, patch sizes)."""
    do_sample_frames: bool
    """The processor dir's ``do_sample_frames`` (Bridge's call passes none)."""
    max_num_frames: int
    """Bridge's ``task_encoder.max_num_frames``: the first frames of a video it keeps."""

    @classmethod
    def of(cls, processor: Qwen3VLProcessor, *, max_num_frames: int) -> BridgeVideoRule:
        """The rule of a loaded processor dir, as Bridge loads it."""
        video_processor = processor.video_processor
        return cls(
            geometry=VideoGeometry.of(video_processor),
            do_sample_frames=bool(video_processor.do_sample_frames),
            max_num_frames=int(max_num_frames),
        )

    def kept(self, num_frames: int) -> int:
        """Pre-sampled frames Bridge keeps of ``num_frames``."""
        return min(int(num_frames), self.max_num_frames)

    def clip(self, num_frames: int, height: int, width: int) -> tuple[int, int, int]:
        """(frames, height, width) of the clip qwen-vl-utils hands the processor."""
        return _qwen_vl_utils_video(self.kept(num_frames), height, width)

    def positions(self, num_frames: int) -> np.ndarray:
        """Positions, in the clip qwen-vl-utils makes of ``num_frames`` pre-sampled frames
        (the kept ones, padded to an even count), of the frames the processor takes."""
        frames = _qwen_vl_utils_frames(self.kept(num_frames))
        if self.do_sample_frames:
            return self.geometry.sample_indices(frames, ASSUMED_VIDEO_FPS)
        return np.arange(frames)

    def timestamps(self, num_frames: int) -> list[float]:
        """The seconds Bridge's processor writes before each temporal group: positions over
        24 fps."""
        frames = _qwen_vl_utils_frames(self.kept(num_frames))
        return self.geometry.timestamps(
            frames, ASSUMED_VIDEO_FPS, indices=self.positions(num_frames)
        )

    def plan(self, num_frames: int, height: int, width: int) -> VideoPlan:
        """What Bridge's processor makes of ``num_frames`` pre-sampled frames of
        ``height×width``."""
        frames, h, w = self.clip(num_frames, height, width)
        indices = self.positions(num_frames)
        # sampling off: the kept frames (qwen-vl-utils' even padding repeats the last one)
        seen = len(indices) if self.do_sample_frames else self.kept(num_frames)
        return self.geometry.plan(
            frames, ASSUMED_VIDEO_FPS, h, w, indices=indices, frames_seen=seen
        )


def _qwen_vl_utils_frames(num_frames: int) -> int:
    """Frames of the clip ``qwen_vl_utils.fetch_video`` makes of a list of ``num_frames``."""
    from qwen_vl_utils import vision_process as qvu

    return qvu.ceil_by_factor(num_frames, qvu.FRAME_FACTOR)


def _qwen_vl_utils_video(num_frames: int, height: int, width: int) -> tuple[int, int, int]:
    """(frames, height, width) of the clip ``qwen_vl_utils.fetch_video`` makes of a list of
    ``num_frames`` frames of ``height×width``, as Bridge's Qwen path calls it (patch size 14);
    its own constants and ``smart_resize``, as in its list branch."""
    from qwen_vl_utils import vision_process as qvu

    factor = 14 * qvu.SPATIAL_MERGE_SIZE  # fetch_video's image_factor
    height, width = _qwen_vl_utils_size(height, width, patch_size=factor)  # each frame
    frames = _qwen_vl_utils_frames(num_frames)
    min_pixels = qvu.VIDEO_MIN_TOKEN_NUM * factor**2
    total_pixels = qvu.MODEL_SEQ_LEN * factor**2 * 0.9
    max_pixels = max(
        min(qvu.VIDEO_MAX_TOKEN_NUM * factor**2, total_pixels / frames * qvu.FRAME_FACTOR),
        int(min_pixels * 1.05),
    )
    height, width = qvu.smart_resize(
        height, width, factor=factor, min_pixels=min_pixels, max_pixels=max_pixels
    )
    return frames, height, width


def _qwen_vl_utils_size(height: int, width: int, *, patch_size: int = 14) -> tuple[int, int]:
    """(height, width) ``qwen_vl_utils.fetch_image`` resizes an image to, with the arguments
    Bridge's Qwen path gives it (none: patch size 14, the default bounds; a video's frames
    get the video's factor, 28, as their patch size)."""
    from qwen_vl_utils import vision_process as qvu

    factor = patch_size * qvu.SPATIAL_MERGE_SIZE
    return qvu.smart_resize(
        height,
        width,
        factor=factor,
        min_pixels=qvu.IMAGE_MIN_TOKEN_NUM * factor**2,
        max_pixels=qvu.IMAGE_MAX_TOKEN_NUM * factor**2,
    )


def bridge_fetch_image(image: Image.Image) -> Image.Image:
    """The image Megatron-Bridge's Qwen path hands the processor: ``qwen_vl_utils``'s own
    ``fetch_image`` (RGB, resized to its 28-pixel grid), as ``process_vision_info`` calls it."""
    from qwen_vl_utils import fetch_image

    return fetch_image({"type": "image", "image": image})


def bridge_fetch_video(frames: Sequence[Image.Image]) -> torch.Tensor:
    """The video Megatron-Bridge's Qwen path hands the processor for a list of frames:
    ``qwen_vl_utils``'s own ``fetch_video`` (each frame resized, the list padded to an even
    count, the clip resized: :class:`BridgeVideoRule`), as ``process_vision_info`` calls it;
    ``(frames, 3, H, W)`` float in 0-255."""
    from qwen_vl_utils import fetch_video

    return fetch_video({"type": "video", "video": list(frames)})


def read_image_size(data: bytes) -> tuple[int, int]:
    """(width, height) from an encoded image's header; the pixels are not decoded.

    Raises ``ValueError`` when the bytes are not an image PIL can identify (its message
    holds no object address, so the same bytes give the same message in any process).

    >>> read_image_size(b"not an image")
    Traceback (most recent call last):
    ...
    ValueError: unreadable image: cannot identify the image format
    """
    from PIL import UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as img:
            return img.size
    except UnidentifiedImageError as exc:  # its message holds the BytesIO's repr
        raise ValueError("unreadable image: cannot identify the image format") from exc
    except Exception as exc:  # OSError, SyntaxError... on a damaged header
        raise ValueError(f"unreadable image: {exc}") from exc
