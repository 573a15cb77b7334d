"""Token counts of one conversation: exact (the real processor) and cheap (no pixels).

Conversations are HF messages, ``[{"role": "system" | "user" | "assistant", "content":
[{"type": "image"}, {"type": "text", "text": "..."}, ...] | "..."}]``; the i-th image part
takes the i-th image. Both functions count the same things, so the cheap count can be
checked against the exact one sample by sample:

- ``text_tokens``: every token that is not an ``<|image_pad|>`` (chat markup included);
- ``image_tokens``: the ``<|image_pad|>`` tokens, one per merged group of patches;
- ``loss_tokens``: each assistant reply's tokens and its ``<|im_end|>`` (what training
  learns from), found from the token ids by :func:`assistant_mask` — so any ChatML
  template works, a real Qwen3-VL one without ``{% generation %}`` markers included.

Both are deterministic, as Energon's buffer restore re-runs them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from PIL import Image
from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor

from packline.qwen.processor import processor_geometry

Conversation = list[dict]
"""HF chat messages, see the module docstring."""


@dataclass(frozen=True)
class LengthRecord:
    """Token counts of one conversation."""

    text_tokens: int
    """Tokens that are not ``<|image_pad|>``, chat markup and vision start/end included."""
    image_tokens: int
    """``<|image_pad|>`` tokens: Σ over images of t·h·w / merge²."""
    num_images: int
    """Images in the conversation."""
    total_tokens: int
    """``text_tokens + image_tokens``: the conversation's length in a packed row."""
    loss_tokens: int
    """Tokens trained on: each assistant reply's content tokens plus its ``<|im_end|>``."""


def exact_lengths(
    processor: Qwen3VLProcessor,
    conversation: Conversation,
    images: Sequence[Image.Image],
    *,
    turn_newline: bool = False,
) -> LengthRecord:
    """Count by running the real processor (chat template, image processor, tokenizer).
    ``turn_newline`` counts loss tokens as Megatron-Bridge does (see :func:`assistant_mask`).

    Raises ``ValueError`` if the number of image parts differs from ``len(images)``, if an
    assistant message holds an image, or if the chat template cannot mark assistant tokens.
    """
    _check_conversation(processor, conversation, len(images))
    out = processor.apply_chat_template(
        bind_images(conversation, images),
        tokenize=True,
        return_dict=True,
        return_tensors="np",
        # The pixel values are not needed, only their grid: skip the float passes.
        processor_kwargs={"do_rescale": False, "do_normalize": False},
    )
    input_ids = out["input_ids"][0]
    image_tokens = int(np.count_nonzero(input_ids == processor.image_token_id))
    if images:
        grid_thw = out["image_grid_thw"]  # (num_images, 3): t, h, w in patches
        merged = int(grid_thw.prod(axis=-1).sum()) // processor.image_processor.merge_size**2
        assert image_tokens == merged, f"{image_tokens} <|image_pad|> but grids give {merged}"
    else:
        assert image_tokens == 0, f"{image_tokens} <|image_pad|> in a conversation without images"
    text_tokens = len(input_ids) - image_tokens
    return LengthRecord(
        text_tokens=text_tokens,
        image_tokens=image_tokens,
        num_images=len(images),
        total_tokens=text_tokens + image_tokens,
        loss_tokens=int(
            assistant_mask(input_ids, processor.tokenizer, turn_newline=turn_newline).sum()
        ),
    )


def cheap_lengths(
    processor: Qwen3VLProcessor,
    conversation: Conversation,
    image_sizes: Sequence[tuple[int, int]],
    visual_tokens: Callable[[int, int], int] | None = None,
    *,
    turn_newline: bool = False,
) -> LengthRecord:
    """Count without pixels, from each image's ``(width, height)`` (its file header).

    The chat template is tokenized with one ``<|image_pad|>`` per image, which is then
    replaced by the image's token count from the processor's geometry (or from
    ``visual_tokens(height, width)`` if given). Equal to :func:`exact_lengths` as long as
    the geometry is the processor's. Raises ``ValueError`` like :func:`exact_lengths`.
    """
    _check_conversation(processor, conversation, len(image_sizes))
    if visual_tokens is None:
        visual_tokens = processor_geometry(processor).visual_tokens
    out = processor.tokenizer.apply_chat_template(
        conversation,
        chat_template=processor.chat_template,
        tokenize=True,
        return_dict=True,
    )
    input_ids = out["input_ids"]
    num_pads = input_ids.count(processor.image_token_id)
    if num_pads != len(image_sizes):
        raise ValueError(
            f"the rendered conversation has {num_pads} {processor.image_token} for "
            f"{len(image_sizes)} images: does its text contain {processor.image_token}?"
        )
    image_tokens = sum(visual_tokens(height, width) for width, height in image_sizes)
    text_tokens = len(input_ids) - num_pads
    return LengthRecord(
        text_tokens=text_tokens,
        image_tokens=image_tokens,
        num_images=len(image_sizes),
        total_tokens=text_tokens + image_tokens,
        loss_tokens=int(
            assistant_mask(
                np.asarray(input_ids), processor.tokenizer, turn_newline=turn_newline
            ).sum()
        ),
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
    processor: Qwen3VLProcessor, conversation: Conversation, num_images: int
) -> None:
    num_parts = 0
    for message in conversation:
        content = message.get("content")
        if isinstance(content, str):
            continue
        parts = sum(1 for part in content or [] if part.get("type") == "image")
        if parts and message.get("role") == "assistant":
            raise ValueError("an assistant message holds an image; images go in user messages")
        num_parts += parts
    if num_parts != num_images:
        raise ValueError(f"the conversation has {num_parts} image parts but {num_images} images")


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
