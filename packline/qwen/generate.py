"""Asking a Qwen3-VL model: a conversation with its media as a :class:`Prompt` (a prepared
sample's question, or a user's text after an image or a video), the processor's tensors of
it, and the model's greedy answer. One home for ``packline chat`` (:mod:`packline.serving.chat`) and
the trainer's answer accuracy (:mod:`packline.train.evaluate`)."""

from __future__ import annotations

import contextlib
import io
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from schemas.errors import UserError

DEFAULT_MAX_NEW_TOKENS = 64


@contextlib.contextmanager
def quiet_libraries() -> Iterator[None]:
    """transformers' and PEFT's progress bars, warnings and log lines off for the body: a
    command that prints an answer prints nothing else."""
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()


@dataclass
class Prompt:
    """A conversation to continue, with its media (in order of appearance)."""

    conversation: list[dict[str, Any]]
    images: list = None  # PIL images
    videos: list = None  # packline.qwen.lengths.DecodedVideo
    reference: str | None = None
    """The sample's own answer (a replayed sample only)."""
    key: str | None = None


def decoded_video(data: bytes | Path, header: dict[str, Any] | None = None):
    """A video file or its bytes as the processor takes it: every frame, decoded (its
    header as prepare recorded it, else probed)."""
    from packline.media.video import VideoHeader, decode_frames, probe_video
    from packline.qwen.lengths import DecodedVideo

    head = VideoHeader.from_dict(header) if header else probe_video(data)
    frames = decode_frames(data, range(head.num_frames), rotation=head.rotation)
    return DecodedVideo(frames, head)


def message_text(message: dict[str, Any]) -> str:
    content = message.get("content")
    if isinstance(content, str):
        return content
    return "".join(p.get("text", "") for p in content if p.get("type") == "text")


def sample_prompt(sample, turn: int | None = None) -> Prompt:
    """A prepared sample (:class:`packline.energon.sample.ConversationSample`) as the prompt
    of its assistant turn ``turn`` (default: the first), that turn's text the reference; the
    media of the turns before it decoded."""
    from PIL import Image

    turns = sample.conversation
    first = turn
    if first is None:
        first = next((i for i, m in enumerate(turns) if m["role"] == "assistant"), None)
    if not first:
        raise UserError([f"sample {sample.__key__}: no assistant turn after a user turn"])
    prompt = turns[:first]
    parts = [p for m in prompt if isinstance(m["content"], list) for p in m["content"]]
    n_images = sum(1 for p in parts if p.get("type") == "image")
    n_videos = sum(1 for p in parts if p.get("type") == "video")
    images = []
    for data in sample.images[:n_images]:
        with Image.open(io.BytesIO(data)) as img:
            images.append(img.convert("RGB"))
    videos = [
        decoded_video(data, header)
        for data, header in zip(
            sample.videos[:n_videos], sample.video_headers[:n_videos], strict=True
        )
    ]
    return Prompt(prompt, images, videos, reference=message_text(turns[first]), key=sample.__key__)


def model_inputs(processor, prompt: Prompt, *, add_generation_prompt: bool = True) -> dict:
    """The processor's tensors for ``prompt`` (chat template, images, videos)."""
    from packline.qwen.lengths import run_processor

    inputs = run_processor(
        processor,
        prompt.conversation,
        prompt.images or [],
        prompt.videos or [],
        "pt",
        add_generation_prompt=add_generation_prompt,
    )
    return {k: v for k, v in inputs.items() if k != "token_type_ids"}


@torch.no_grad()
def generate_answer(
    model, processor, prompt: Prompt, *, max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
) -> str:
    """The model's greedy continuation of ``prompt``, decoded without special tokens."""
    inputs = model_inputs(processor, prompt)
    device = next(model.parameters()).device
    with quiet_libraries():
        out = model.generate(
            **{k: v.to(device) for k, v in inputs.items()},
            max_new_tokens=max_new_tokens,
            do_sample=False,
            use_cache=True,
            pad_token_id=processor.tokenizer.pad_token_id,
        )
    answer = out[0, inputs["input_ids"].shape[1] :]
    return processor.tokenizer.decode(answer, skip_special_tokens=True).strip()
