"""One conversation → token ids, training targets, M-RoPE positions, image and video patches.

Two ways, with identical results (a test checks it):

- **lazy** (:meth:`ConversationEncoder.tokenize` then :meth:`~ConversationEncoder.finish`):
  the chat template is tokenized with one ``<|image_pad|>`` per image and one
  ``<|video_pad|>`` per video, each expanded to its exact tokens from the image's header
  size or the video's header (frame count, rate, size: its sampled frames' timestamps and
  groups); the media are decoded and processed only later, for conversations that were
  selected into a pack — and of a video, only the frames the processor samples are kept.
- **eager** (:meth:`ConversationEncoder.encode_eager`): the full HF processor runs at once
  (chat template + image processor + video processor over every decoded frame, which it
  samples itself), as Megatron-Bridge's encoder does.
"""

from __future__ import annotations

import io
from dataclasses import dataclass, field
from typing import Any

import torch
from PIL import Image

from packline.media.video import VideoHeader, decode_frames
from packline.packing.thd import EncodedConversation, mm_token_type_ids
from packline.qwen.lengths import (
    DecodedVideo,
    assistant_mask,
    expand_placeholders,
    run_processor,
    sampled_indices,
    video_placeholder_ids,
)
from packline.qwen.processor import (
    load_processor,
    processor_geometry,
    processor_video_geometry,
)
from packline.qwen.rope import RopeIndex
from packline.qwen.vision import read_image_size


def _headers(docs) -> list[VideoHeader]:
    """Video headers as given: :class:`VideoHeader` s, or their dicts from a sample's JSON."""
    return [h if isinstance(h, VideoHeader) else VideoHeader.from_dict(h) for h in docs]


@dataclass(kw_only=True)
class Tokenized:
    """The cheap part of encoding: exact ids and targets, images still encoded bytes."""

    key: str
    input_ids: torch.Tensor  # (L,) int64, image pads expanded
    target_mask: torch.Tensor  # (L,) bool
    images: list[bytes]
    image_sizes: list[tuple[int, int]]  # (width, height) from the headers
    videos: list[bytes] = field(default_factory=list)  # encoded files
    video_headers: list[VideoHeader] = field(default_factory=list)

    def __len__(self) -> int:
        return int(self.input_ids.numel())


class ConversationEncoder:
    """Encodes conversations for one processor (loaded from ``processor_dir``)."""

    def __init__(self, processor_dir):
        self.processor = load_processor(processor_dir)
        self.tokenizer = self.processor.tokenizer
        self.geometry = processor_geometry(self.processor)
        self.video_geometry = processor_video_geometry(self.processor)
        self.image_token_id = int(self.processor.image_token_id)
        self.video_token_id = int(self.processor.video_token_id)
        self.pad_token_id = int(self.tokenizer.pad_token_id)
        self.rope = RopeIndex(self.geometry.merge_size)

    # -- lazy -------------------------------------------------------------------------------

    def tokenize(
        self,
        key: str,
        conversation: list[dict[str, Any]],
        images: list[bytes],
        videos: list[bytes] = (),
        video_headers: list[VideoHeader | dict] = (),
    ) -> Tokenized:
        """Exact ids from the text, the image headers and the video headers; no pixel is
        decoded."""
        sizes = [read_image_size(b) for b in images]
        headers = _headers(video_headers)
        if len(headers) != len(videos):
            raise ValueError(f"{key}: {len(videos)} videos but {len(headers)} video headers")
        ids = self.tokenizer.apply_chat_template(
            conversation,
            chat_template=self.processor.chat_template,
            tokenize=True,
            return_dict=True,
        )["input_ids"]
        expanded = expand_placeholders(
            ids,
            image_token_id=self.image_token_id,
            image_counts=[self.geometry.visual_tokens(h, w) for w, h in sizes],
            video_token_id=self.video_token_id,
            video_ids=[
                video_placeholder_ids(
                    self.tokenizer,
                    self.video_geometry.plan(h.num_frames, h.fps, h.height, h.width),
                )
                for h in headers
            ],
            what=key,
        )
        input_ids = torch.tensor(expanded, dtype=torch.long)
        mask = torch.from_numpy(assistant_mask(input_ids.numpy(), self.tokenizer))
        return Tokenized(
            key=key,
            input_ids=input_ids,
            target_mask=mask,
            images=list(images),
            image_sizes=sizes,
            videos=list(videos),
            video_headers=headers,
        )

    def process_images(
        self, images: list[bytes]
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Decode and run the image processor: (pixel_values (P, D), image_grid_thw (k, 3))."""
        if not images:
            return None, None
        pil = []
        for data in images:
            with Image.open(io.BytesIO(data)) as img:
                pil.append(img.convert("RGB"))
        out = self.processor.image_processor(images=pil, return_tensors="pt")
        return out["pixel_values"], out["image_grid_thw"].long()

    def process_videos(
        self, videos: list[bytes], headers: list[VideoHeader]
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, int]:
        """Decode only the frames the processor samples and run the video processor on them:
        (pixel_values_videos (P, D), video_grid_thw (v, 3), frames sampled)."""
        if not videos:
            return None, None, 0
        clips, metadata = [], []
        for data, header in zip(videos, headers, strict=True):
            indices = self.video_geometry.sample_indices(header.num_frames, header.fps)
            clips.append(decode_frames(data, indices, rotation=header.rotation))
            metadata.append(
                {
                    "total_num_frames": header.num_frames,
                    "fps": header.fps,
                    "frames_indices": indices.tolist(),
                }
            )
        out = self.processor.video_processor(
            videos=clips, video_metadata=metadata, do_sample_frames=False, return_tensors="pt"
        )
        return out["pixel_values_videos"], out["video_grid_thw"].long(), sum(map(len, clips))

    def finish(self, tok: Tokenized) -> EncodedConversation:
        """The heavy part: images and sampled video frames processed, positions computed."""
        pixel_values, grid = self.process_images(tok.images)
        videos, video_grid, frames = self.process_videos(tok.videos, tok.video_headers)
        return self._encoded(
            tok.key, tok.input_ids, tok.target_mask, pixel_values, grid, videos, video_grid, frames
        )

    # -- eager ------------------------------------------------------------------------------

    def encode_eager(
        self,
        key: str,
        conversation: list[dict[str, Any]],
        images: list[bytes],
        videos: list[bytes] = (),
        video_headers: list[VideoHeader | dict] = (),
    ) -> EncodedConversation:
        """Everything at once through the HF processor (the Megatron-Bridge way): every
        image decoded, every frame of every video decoded, the processor samples."""
        pil = []
        for data in images:
            with Image.open(io.BytesIO(data)) as img:
                pil.append(img.convert("RGB"))
        headers = _headers(video_headers)
        decoded = [
            DecodedVideo(
                frames=decode_frames(data, range(h.num_frames), rotation=h.rotation), header=h
            )
            for data, h in zip(videos, headers, strict=True)
        ]
        out = run_processor(self.processor, conversation, pil, decoded, "pt")
        input_ids = out["input_ids"][0].long()
        mask = torch.from_numpy(assistant_mask(input_ids.numpy(), self.tokenizer))
        grid = out["image_grid_thw"].long() if pil else None
        pixel_values = out["pixel_values"] if pil else None
        video_pixels = out["pixel_values_videos"] if decoded else None
        video_grid = out["video_grid_thw"].long() if decoded else None
        frames = sum(map(len, sampled_indices(self.processor, decoded)))
        return self._encoded(
            key, input_ids, mask, pixel_values, grid, video_pixels, video_grid, frames
        )

    # -- shared -----------------------------------------------------------------------------

    def _encoded(
        self,
        key,
        input_ids,
        target_mask,
        pixel_values,
        grid,
        video_pixels=None,
        video_grid=None,
        video_frames: int = 0,
    ) -> EncodedConversation:
        token_types = mm_token_type_ids(input_ids, self.image_token_id, self.video_token_id)
        mrope = self.rope.positions(input_ids, token_types, grid, video_grid)
        return EncodedConversation(
            key=key,
            input_ids=input_ids,
            target_mask=target_mask,
            mrope=mrope,
            pixel_values=pixel_values,
            image_grid_thw=grid,
            pixel_values_videos=video_pixels,
            video_grid_thw=video_grid,
            video_frames=video_frames,
        )
