"""Token counts of one conversation: exact (the real processor) and cheap (no pixels).

Conversations are HF messages, ``[{"role": "system" | "user" | "assistant", "content":
[{"type": "image"}, {"type": "video"}, {"type": "text", "text": "..."}, ...] | "..."}]``;
the i-th image part takes the i-th image, the i-th video part the i-th video. Both functions
count the same things, so the cheap count can be checked against the exact one sample by
sample:

- ``text_tokens``: every token that is neither an ``<|image_pad|>`` nor a ``<|video_pad|>``
  (chat markup included, and a video's timestamp text and per-group vision start/end);
- ``image_tokens``: the ``<|image_pad|>`` tokens, one per merged group of patches;
- ``video_tokens``: the ``<|video_pad|>`` tokens, one per merged group of patches of each
  temporal group (two sampled frames);
- ``loss_tokens``: each assistant reply's tokens and its ``<|im_end|>`` (what training
  learns from), found from the token ids by :func:`assistant_mask` — so any ChatML
  template works, a real Qwen3-VL one without ``{% generation %}`` markers included.

A video is given as its :class:`~packline.media.video.VideoHeader` (the cheap rule) or as every
decoded frame plus that header (the exact one: the processor samples the frames itself).
Both are deterministic, as Energon's buffer restore re-runs them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image
from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
from transformers.video_utils import VideoMetadata

from packline.media.video import VideoHeader
from packline.qwen.processor import processor_geometry, processor_video_geometry
from packline.qwen.vision import VideoGeometry, VideoPlan

Conversation = list[dict]
"""HF chat messages, see the module docstring."""


@dataclass(frozen=True)
class LengthRecord:
    """Token counts of one conversation."""

    text_tokens: int
    """Tokens that are neither ``<|image_pad|>`` nor ``<|video_pad|>``: chat markup, vision
    start/end and video timestamps included."""
    image_tokens: int
    """``<|image_pad|>`` tokens: Σ over images of t·h·w / merge²."""
    num_images: int
    """Images in the conversation."""
    total_tokens: int
    """``text_tokens + image_tokens + video_tokens``: the length in a packed row."""
    loss_tokens: int
    """Tokens trained on: each assistant reply's content tokens plus its ``<|im_end|>``."""
    video_tokens: int = 0
    """``<|video_pad|>`` tokens: Σ over videos of t·h·w / merge²."""
    num_videos: int = 0
    """Videos in the conversation."""
    video_frames: int = 0
    """Frames sampled from the videos (what the vision tower sees, before an odd count is
    padded by repeating the last frame)."""
    video_grids: tuple[tuple[int, int, int], ...] = ()
    """Each video's ``video_grid_thw`` row, in order."""
    video_frame_counts: tuple[int, ...] = ()
    """Each video's sampled frames, in order (their sum is ``video_frames``)."""


@dataclass(frozen=True)
class DecodedVideo:
    """One video for the exact count: every frame of the file, decoded, and its header."""

    frames: np.ndarray
    """(num_frames, H, W, 3) uint8, upright."""
    header: VideoHeader


@dataclass(frozen=True)
class PresampledVideo:
    """One video as Megatron-Bridge's Qwen-VL encoder hands it to the processor: frames
    sampled beforehand and resized by qwen-vl-utils
    (:func:`packline.qwen.vision.bridge_fetch_video`), with no metadata, so the processor's
    own ``do_sample_frames`` decides whether it samples again (from an assumed 24 fps) and
    its timestamps are frame positions over 24 fps."""

    frames: torch.Tensor
    """(frames, 3, H, W) float in 0-255: what qwen-vl-utils returns (an even count)."""
    num_frames: int
    """The pre-sampled frames it was made of (before qwen-vl-utils' even padding)."""


def video_placeholder_ids(tokenizer, plan: VideoPlan) -> list[int]:
    """Token ids the processor puts in place of one video's ``<|video_pad|>``: per temporal
    group its timestamp text, ``<|vision_start|>``, the pads and ``<|vision_end|>``
    (:attr:`VideoPlan.placeholder`). The text sits between special tokens, so it tokenizes
    the same alone as in context."""
    return tokenizer.encode(plan.placeholder, add_special_tokens=False)


def expand_placeholders(
    input_ids: Sequence[int],
    *,
    image_token_id: int,
    image_counts: Sequence[int],
    video_token_id: int,
    video_ids: Sequence[Sequence[int]],
    what: str = "the conversation",
) -> list[int]:
    """The template's ids with each ``<|image_pad|>`` repeated to its image's token count
    and each ``<|video_pad|>`` replaced by its video's ids, in order: the text the processor
    produces, without pixels. Raises ``ValueError`` when the number of placeholders differs
    from the number of images or videos (e.g. a pad token written in the text).

    >>> expand_placeholders([7, 1, 8, 2, 9], image_token_id=1, image_counts=[3],
    ...                     video_token_id=2, video_ids=[[5, 2, 2, 6]])
    [7, 1, 1, 1, 8, 5, 2, 2, 6, 9]
    """
    images, videos = iter(image_counts), iter(video_ids)
    out: list[int] = []
    found_images = found_videos = 0
    for tok in input_ids:
        if tok == image_token_id:
            found_images += 1
            out.extend([tok] * next(images, 1))
        elif tok == video_token_id:
            found_videos += 1
            out.extend(next(videos, [tok]))
        else:
            out.append(tok)
    if found_images != len(image_counts) or found_videos != len(video_ids):
        raise ValueError(
            f"{what} renders {found_images} image and {found_videos} video placeholders for "
            f"{len(image_counts)} images and {len(video_ids)} videos: does its text contain "
            "<|image_pad|> or <|video_pad|>?"
        )
    return out


def run_processor(
    processor: Qwen3VLProcessor,
    conversation: Conversation,
    images: Sequence[Image.Image],
    videos: Sequence[DecodedVideo] | Sequence[PresampledVideo],
    return_tensors: str,
    *,
    add_generation_prompt: bool = False,
    **kwargs,
):
    """The real processor over the rendered chat template, its images and its videos (each
    video as all its frames plus the file's frame count and rate: the processor samples; or
    each a :class:`PresampledVideo`, passed as Megatron-Bridge passes them: frames only)."""
    text = processor.apply_chat_template(
        conversation, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    call: dict = {"text": [text], "return_tensors": return_tensors, **kwargs}
    if images:
        call["images"] = list(images)
    if videos:
        call["videos"] = [v.frames for v in videos]
    if videos and not all(isinstance(v, PresampledVideo) for v in videos):
        call["videos_kwargs"] = {
            "video_metadata": [
                {"total_num_frames": v.header.num_frames, "fps": v.header.fps} for v in videos
            ],
            "do_sample_frames": True,
            "return_metadata": True,
        }
    return processor(**call)


def sampled_indices(processor: Qwen3VLProcessor, videos: Sequence[DecodedVideo]) -> list:
    """The frame indices the loaded video processor samples from each video (its own
    ``sample_frames`` with its own settings; the processor call does not return them)."""
    vp = processor.video_processor
    return [
        vp.sample_frames(
            VideoMetadata(total_num_frames=v.header.num_frames, fps=v.header.fps), fps=vp.fps
        )
        for v in videos
    ]


def _frame_counts(
    processor: Qwen3VLProcessor, videos: Sequence[DecodedVideo] | Sequence[PresampledVideo]
) -> tuple[int, ...]:
    """Frames of each video the vision tower sees (before odd padding)."""
    if not all(isinstance(v, PresampledVideo) for v in videos):
        return tuple(map(len, sampled_indices(processor, videos)))
    vp = processor.video_processor
    if not vp.do_sample_frames:
        return tuple(v.num_frames for v in videos)
    # the processor's own sampling with the metadata it makes up (no fps: 24 assumed)
    return tuple(
        len(vp.sample_frames(VideoMetadata(total_num_frames=len(v.frames), fps=None), fps=vp.fps))
        for v in videos
    )


def exact_lengths(
    processor: Qwen3VLProcessor,
    conversation: Conversation,
    images: Sequence[Image.Image],
    *,
    videos: Sequence[DecodedVideo] | Sequence[PresampledVideo] = (),
    turn_newline: bool = False,
) -> LengthRecord:
    """Count by running the real processor (chat template, image and video processors,
    tokenizer). ``turn_newline`` counts loss tokens as Megatron-Bridge does (see
    :func:`assistant_mask`); videos given as :class:`PresampledVideo` are passed as Bridge
    passes them (see :func:`run_processor`).

    Raises ``ValueError`` if the number of image (video) parts differs from ``len(images)``
    (``len(videos)``), if an assistant message holds media, or if the chat template cannot
    mark assistant tokens.
    """
    _check_conversation(processor, conversation, len(images), len(videos))
    # The pixel values are not needed, only their grids: skip the float passes.
    out = run_processor(
        processor, conversation, images, videos, "np", do_rescale=False, do_normalize=False
    )
    input_ids = out["input_ids"][0]
    merge = processor.image_processor.merge_size**2
    image_tokens = int(np.count_nonzero(input_ids == processor.image_token_id))
    video_tokens = int(np.count_nonzero(input_ids == processor.video_token_id))
    merged = int(out["image_grid_thw"].prod(axis=-1).sum()) // merge if images else 0
    assert image_tokens == merged, f"{image_tokens} <|image_pad|> but grids give {merged}"
    grids: tuple[tuple[int, int, int], ...] = ()
    frames, counts = 0, ()
    if videos:
        grid = out["video_grid_thw"]
        grids = tuple(tuple(int(v) for v in row) for row in grid.tolist())
        merged = int(grid.prod(axis=-1).sum()) // processor.video_processor.merge_size**2
        assert video_tokens == merged, f"{video_tokens} <|video_pad|> but grids give {merged}"
        counts = _frame_counts(processor, videos)
        frames = sum(counts)
    else:
        assert video_tokens == 0, f"{video_tokens} <|video_pad|> in a conversation without video"
    text_tokens = len(input_ids) - image_tokens - video_tokens
    return LengthRecord(
        text_tokens=text_tokens,
        image_tokens=image_tokens,
        num_images=len(images),
        total_tokens=len(input_ids),
        loss_tokens=int(
            assistant_mask(input_ids, processor.tokenizer, turn_newline=turn_newline).sum()
        ),
        video_tokens=video_tokens,
        num_videos=len(videos),
        video_frames=frames,
        video_grids=grids,
        video_frame_counts=counts,
    )


def cheap_lengths(
    processor: Qwen3VLProcessor,
    conversation: Conversation,
    image_sizes: Sequence[tuple[int, int]],
    visual_tokens: Callable[[int, int], int] | None = None,
    *,
    video_headers: Sequence[VideoHeader] = (),
    video_geometry: VideoGeometry | None = None,
    video_plans: Sequence[VideoPlan] | None = None,
    turn_newline: bool = False,
) -> LengthRecord:
    """Count without pixels, from each image's ``(width, height)`` and each video's header
    (frame count, rate and size).

    The chat template is tokenized with one ``<|image_pad|>`` per image and one
    ``<|video_pad|>`` per video; each is then expanded (:func:`expand_placeholders`): an
    image to its token count from the processor's geometry (or ``visual_tokens(height,
    width)`` if given), a video to its timestamps and groups under the video processor's
    geometry (or ``video_geometry``), or to its plan when ``video_plans`` give each video's
    in place of the headers (e.g. :meth:`packline.qwen.vision.BridgeVideoRule.plan`). Equal
    to :func:`exact_lengths` as long as the geometries are the processor's. Raises
    ``ValueError`` like :func:`exact_lengths`.
    """
    if video_plans is None:
        geometry = video_geometry or processor_video_geometry(processor)
        video_plans = [geometry.plan(h.num_frames, h.fps, h.height, h.width) for h in video_headers]
    elif video_headers:
        raise ValueError("give each video's header or its plan, not both")
    _check_conversation(processor, conversation, len(image_sizes), len(video_plans))
    if visual_tokens is None:
        visual_tokens = processor_geometry(processor).visual_tokens
    ids = processor.tokenizer.apply_chat_template(
        conversation,
        chat_template=processor.chat_template,
        tokenize=True,
        return_dict=True,
    )["input_ids"]
    image_counts = [visual_tokens(height, width) for width, height in image_sizes]
    expanded = expand_placeholders(
        ids,
        image_token_id=processor.image_token_id,
        image_counts=image_counts,
        video_token_id=processor.video_token_id,
        video_ids=[video_placeholder_ids(processor.tokenizer, plan) for plan in video_plans],
        what="the rendered conversation",
    )
    sampled = [plan.num_frames for plan in video_plans]
    grids = tuple(plan.grid_thw for plan in video_plans)
    image_tokens = sum(image_counts)
    video_tokens = sum(plan.num_tokens for plan in video_plans)
    return LengthRecord(
        text_tokens=len(expanded) - image_tokens - video_tokens,
        image_tokens=image_tokens,
        num_images=len(image_sizes),
        total_tokens=len(expanded),
        loss_tokens=int(
            assistant_mask(
                np.asarray(expanded), processor.tokenizer, turn_newline=turn_newline
            ).sum()
        ),
        video_tokens=video_tokens,
        num_videos=len(video_plans),
        video_frames=sum(sampled),
        video_grids=grids,
        video_frame_counts=tuple(sampled),
    )


def assistant_mask(input_ids: np.ndarray, tokenizer, *, turn_newline: bool = False) -> np.ndarray:
    """True on every token an assistant turn is trained on, from ChatML token ids.

    A turn starts with ``<|im_start|>`` and the tokens of ``assistant``; the newline token
    that ends the header is skipped; everything after it up to and including the turn's
    ``<|im_end|>`` is marked. ``turn_newline`` also marks the newline token right after that
    ``<|im_end|>``, as Megatron-Bridge's Qwen-VL loss mask does (its assistant end marker is
    ``<|im_end|>\\n``). (A reply that starts with newlines may merge with the header's
    newline into one token; that token is marked.) Works for any ChatML chat template.

    Worked example (ids shown as text)::

        <|im_start|> user \n Hi <|im_end|> \n <|im_start|> assistant \n Hello <|im_end|> \n
        0            0    0  0  0          0  0            0         0  1     1          0
    """
    ids = np.asarray(input_ids).reshape(-1)
    start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    header = tokenizer.encode("assistant", add_special_tokens=False)
    newline = tokenizer.encode("\n", add_special_tokens=False)
    mask = np.zeros(len(ids), dtype=bool)
    n, h = len(ids), len(header)
    i = 0
    while i < n:
        if ids[i] == start and ids[i + 1 : i + 1 + h].tolist() == header:
            j = i + 1 + h
            if len(newline) == 1 and j < n and ids[j] == newline[0]:
                j += 1
            k = j
            while k < n and ids[k] != end:
                k += 1
            if turn_newline and len(newline) == 1 and k + 1 < n and ids[k + 1] == newline[0]:
                k += 1
            mask[j : min(k + 1, n)] = True
            i = k + 1
        else:
            i += 1
    return mask


def _check_conversation(
    processor: Qwen3VLProcessor, conversation: Conversation, num_images: int, num_videos: int = 0
) -> None:
    counts = {"image": 0, "video": 0}
    for message in conversation:
        content = message.get("content")
        if isinstance(content, str):
            continue
        for kind in counts:
            parts = sum(1 for part in content or [] if part.get("type") == kind)
            if parts and message.get("role") == "assistant":
                raise ValueError(
                    f"an assistant message holds {kind} parts; media go in user messages"
                )
            counts[kind] += parts
    if counts["image"] != num_images:
        raise ValueError(
            f"the conversation has {counts['image']} image parts but {num_images} images"
        )
    if counts["video"] != num_videos:
        raise ValueError(
            f"the conversation has {counts['video']} video parts but {num_videos} videos"
        )


def media_first(conversation: Conversation) -> Conversation:
    """A copy with each message's image (and video) parts moved before its other parts, in
    their order: how Megatron-Bridge's Qwen-VL encoder renders a conversation
    (``normalized_vlm_sample_to_hf_example(..., media_first=True)``). The i-th image part
    still takes the i-th image.

    Worked example::

        >>> media_first([{"role": "user", "content": [
        ...     {"type": "text", "text": "A: "}, {"type": "image"},
        ...     {"type": "text", "text": " B: "}, {"type": "image"}]}])[0]["content"]
        [{'type': 'image'}, {'type': 'image'}, {'type': 'text', 'text': 'A: '}, \
{'type': 'text', 'text': ' B: '}]
    """
    out = []
    for message in conversation:
        content = message.get("content")
        if isinstance(content, list):
            media = [p for p in content if p.get("type") in ("image", "video")]
            rest = [p for p in content if p.get("type") not in ("image", "video")]
            content = media + rest
        out.append({**message, "content": content})
    return out


def bind_images(conversation: Conversation, images: Sequence[Image.Image]) -> Conversation:
    """A copy of the conversation whose image parts carry their images, in order."""
    remaining = iter(images)
    bound = []
    for message in conversation:
        content = message.get("content")
        if not isinstance(content, str) and content:
            content = [
                {**part, "image": next(remaining)} if part.get("type") == "image" else part
                for part in content
            ]
        bound.append({**message, "content": content})
    return bound
