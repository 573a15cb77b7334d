"""One conversation → token ids, training targets, M-RoPE positions and image patches.

Two ways, with identical results (a test checks it):

- **lazy** (:meth:`ConversationEncoder.tokenize` then :meth:`~ConversationEncoder.finish`):
  the chat template is tokenized with one ``<|image_pad|>`` per image, each pad expanded to
  the image's exact token count from its header size; the images are decoded and processed
  only later, for conversations that were selected into a pack.
- **eager** (:meth:`ConversationEncoder.encode_eager`): the full HF processor runs at once
  (chat template + image processor), as Megatron-Bridge's encoder does.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Any

import torch
from PIL import Image

from packline.packing.thd import EncodedConversation
from packline.qwen.lengths import assistant_mask, bind_images
from packline.qwen.processor import load_processor, processor_geometry
from packline.qwen.rope import RopeIndex
from packline.qwen.vision import read_image_size


@dataclass(kw_only=True)
class Tokenized:
    """The cheap part of encoding: exact ids and targets, images still encoded bytes."""

    key: str
    input_ids: torch.Tensor  # (L,) int64, image pads expanded
    target_mask: torch.Tensor  # (L,) bool
    images: list[bytes]
    image_sizes: list[tuple[int, int]]  # (width, height) from the headers

    def __len__(self) -> int:
        return int(self.input_ids.numel())


class ConversationEncoder:
    """Encodes conversations for one processor (loaded from ``processor_dir``)."""

    def __init__(self, processor_dir):
        self.processor = load_processor(processor_dir)
        self.tokenizer = self.processor.tokenizer
        self.geometry = processor_geometry(self.processor)
        self.image_token_id = int(self.processor.image_token_id)
        self.pad_token_id = int(self.tokenizer.pad_token_id)
        self.rope = RopeIndex(self.geometry.merge_size)

    # -- lazy -------------------------------------------------------------------------------

    def tokenize(
        self, key: str, conversation: list[dict[str, Any]], images: list[bytes]
    ) -> Tokenized:
        """Exact ids from the text and the image headers; no pixel is decoded."""
        sizes = [read_image_size(b) for b in images]
        ids = self.tokenizer.apply_chat_template(
            conversation,
            chat_template=self.processor.chat_template,
            tokenize=True,
            return_dict=True,
        )["input_ids"]
        counts = iter(self.geometry.visual_tokens(h, w) for w, h in sizes)
        expanded: list[int] = []
        for tok in ids:
            if tok == self.image_token_id:
                expanded.extend([tok] * next(counts))
            else:
                expanded.append(tok)
        if next(counts, None) is not None:
            raise ValueError(f"{key}: fewer image placeholders than images")
        input_ids = torch.tensor(expanded, dtype=torch.long)
        mask = torch.from_numpy(assistant_mask(input_ids.numpy(), self.tokenizer))
        return Tokenized(
            key=key, input_ids=input_ids, target_mask=mask, images=list(images), image_sizes=sizes
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

    def finish(self, tok: Tokenized) -> EncodedConversation:
        """The heavy part: images processed, positions computed."""
        pixel_values, grid = self.process_images(tok.images)
        return self._encoded(tok.key, tok.input_ids, tok.target_mask, pixel_values, grid)

    # -- eager ------------------------------------------------------------------------------

    def encode_eager(
        self, key: str, conversation: list[dict[str, Any]], images: list[bytes]
    ) -> EncodedConversation:
        """Everything at once through the HF processor (the Megatron-Bridge way)."""
        pil = []
        for data in images:
            with Image.open(io.BytesIO(data)) as img:
                pil.append(img.convert("RGB"))
        bound = bind_images(conversation, pil)
        out = self.processor.apply_chat_template(
            bound, tokenize=True, return_dict=True, return_tensors="pt"
        )
        input_ids = out["input_ids"][0].long()
        mask = torch.from_numpy(assistant_mask(input_ids.numpy(), self.tokenizer))
        grid = out["image_grid_thw"].long() if pil else None
        pixel_values = out["pixel_values"] if pil else None
        return self._encoded(key, input_ids, mask, pixel_values, grid)

    # -- shared -----------------------------------------------------------------------------

    def _encoded(self, key, input_ids, target_mask, pixel_values, grid) -> EncodedConversation:
        token_types = (input_ids == self.image_token_id).to(torch.long)
        mrope = self.rope.positions(input_ids, token_types, grid)
        return EncodedConversation(
            key=key,
            input_ids=input_ids,
            target_mask=target_mask,
            mrope=mrope,
            pixel_values=pixel_values,
            image_grid_thw=grid,
        )
