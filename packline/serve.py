"""Try the trained model: the base and a run's LoRA adapter, loaded with transformers and
PEFT, answering a prompt (with an image or a video) or replaying a prepared sample.

The base is what training started from (:func:`packline.train.setup.build_model`: the
``model.path`` checkpoint, or with ``model.path`` null the tiny model at random init, rebuilt
exactly from ``train.seed``), the processor is connect's copy, and the adapter is the one
:func:`packline.workdir.adapter_dir` names. Generation is greedy, with the processor's chat
template and the language model on ``sdpa`` attention (one conversation: the packed
attention buys nothing here).

A sample is replayed as the conversation up to its first assistant turn (its system and user
turns, with their images and videos); the reference answer is that assistant turn's text.
"""

from __future__ import annotations

import contextlib
import io
import re
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from packline.workdir import adapter_dir, dataset_dir, dataset_path, processor_dir
from schemas.config import PipelineConfig
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


def require_adapter(cfg: PipelineConfig) -> Path:
    """The run's adapter dir, or a UserError (exit 2) saying how to make it."""
    path = adapter_dir(cfg)
    if not (path / "adapter_config.json").is_file():
        raise UserError(
            [
                f"no trained adapter at {path} (train.backend={cfg.train.backend.value}, "
                f"packing.enabled={cfg.packing.enabled}); fix: train it first "
                "(packline run CONFIG), or set packing.enabled to the run you trained"
            ],
            "nothing to load",
        )
    return path


def load_base(cfg: PipelineConfig):
    """(base model in fp32 on CPU with ``sdpa`` text attention, connect's processor)."""
    from packline.qwen.attention import set_text_attention
    from packline.qwen.processor import load_processor
    from packline.train.setup import build_model

    path = processor_dir(cfg)
    if not path.is_dir():
        raise UserError([f"no processor at {path}; fix: run connect first (packline run CONFIG)"])
    processor = load_processor(path)
    with quiet_libraries():
        model = build_model(cfg, processor)
    return set_text_attention(model, "sdpa").eval(), processor


def load_tuned(cfg: PipelineConfig, adapter: Path | None = None):
    """(base + the run's adapter as a ``PeftModel``, eval mode, processor)."""
    from peft import PeftModel

    adapter = adapter or require_adapter(cfg)
    model, processor = load_base(cfg)
    with quiet_libraries():
        tuned = PeftModel.from_pretrained(model, str(adapter), is_trainable=False)
    return tuned.eval(), processor


# --- the prompt ------------------------------------------------------------------------------


@dataclass
class Prompt:
    """A conversation to continue, with its media (in order of appearance)."""

    conversation: list[dict[str, Any]]
    images: list = None  # PIL images
    videos: list = None  # packline.qwen.lengths.DecodedVideo
    reference: str | None = None
    """The sample's own answer (a replayed sample only)."""
    key: str | None = None


def _decoded_video(data: bytes | Path, header: dict[str, Any] | None = None):
    from packline.qwen.lengths import DecodedVideo
    from packline.video import VideoHeader, decode_frames, probe_video

    head = VideoHeader.from_dict(header) if header else probe_video(data)
    frames = decode_frames(data, range(head.num_frames), rotation=head.rotation)
    return DecodedVideo(frames, head)


def user_prompt(text: str, *, image: Path | None = None, video: Path | None = None) -> Prompt:
    """One user turn: ``text`` after an image or a video file, if one is given."""
    from PIL import Image

    parts: list[dict[str, Any]] = []
    images, videos = [], []
    for path in (image, video):
        if path is not None and not Path(path).is_file():
            raise UserError([f"{path}: no such file"])
    if image is not None:
        try:
            with Image.open(image) as img:
                images.append(img.convert("RGB"))
        except OSError as exc:
            raise UserError([f"{image}: not a readable image ({exc})"]) from None
        parts.append({"type": "image"})
    if video is not None:
        from packline.video import VideoError

        try:
            videos.append(_decoded_video(Path(video)))
        except VideoError as exc:
            raise UserError([f"{video}: not a readable video ({exc})"]) from None
        parts.append({"type": "video"})
    parts.append({"type": "text", "text": text})
    return Prompt([{"role": "user", "content": parts}], images, videos)


def _text(message: dict[str, Any]) -> str:
    content = message.get("content")
    if isinstance(content, str):
        return content
    return "".join(p.get("text", "") for p in content if p.get("type") == "text")


def sample_prompt(sample) -> Prompt:
    """A prepared sample (:class:`packline.energon.sample.ConversationSample`) as the prompt
    of its first assistant turn, that turn's text the reference."""
    from PIL import Image

    turns = sample.conversation
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
        _decoded_video(data, header)
        for data, header in zip(
            sample.videos[:n_videos], sample.video_headers[:n_videos], strict=True
        )
    ]
    return Prompt(prompt, images, videos, reference=_text(turns[first]), key=sample.__key__)


def read_samples(cfg: PipelineConfig, split: str = "val") -> Iterator:
    """The prepared ``split``'s samples in its fixed order, media still encoded."""
    from megatron.energon import WorkerConfig, get_loader, get_val_dataset

    from packline.energon.loader import quiet_pin_memory
    from packline.energon.sample import ConversationReader

    ds = get_val_dataset(
        dataset_path(cfg),
        split_part=split,
        worker_config=WorkerConfig(rank=0, world_size=1, num_workers=0),
        batch_size=1,
        task_encoder=ConversationReader(),
    )
    quiet_pin_memory()
    for batch in get_loader(ds):
        yield batch[0]


def read_sample(cfg: PipelineConfig, key: str | None = None):
    """The prepared sample ``key`` (any split, found through prepare's manifest), or with no
    key the val split's first sample. UserError when the dataset or the key is missing."""
    import pandas as pd

    manifest_path = dataset_dir(cfg) / "manifest.parquet"
    if not manifest_path.is_file():
        raise UserError([f"no prepared dataset at {dataset_dir(cfg)}; fix: packline run CONFIG"])
    manifest = pd.read_parquet(manifest_path, columns=["key", "split"])
    if key is None:
        split = "val" if (manifest["split"] == "val").any() else "train"
    else:
        found = manifest.loc[manifest["key"] == key, "split"]
        if found.empty:
            val = manifest.loc[manifest["split"] == "val", "key"].head(3).tolist()
            raise UserError(
                [f"--sample {key}: no such key in {manifest_path}; val keys are e.g. {val}"]
            )
        split = str(found.iloc[0])
    for sample in read_samples(cfg, split):
        if key is None or sample.__key__ == key:
            return sample
    raise UserError([f"--sample {key}: in the manifest but not in the {split} shards"])


# --- generating ----------------------------------------------------------------------------


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


#: A ``key=value`` override or a ``~key`` deletion, as the CLI's CONFIG arguments take them.
OVERRIDE_RE = re.compile(r"^(\+?[\w.\-]+=|~[\w.\-]+$)")


def split_prompt(args: list[str]) -> tuple[str | None, list[str]]:
    """``chat``'s positionals → (prompt, [CONFIG] [key=value ...]): the prompt is the last
    one that is neither an override nor a ``.yaml``/``.yml`` file name.

    >>> split_prompt(["configs/tiny_cpu.yaml", "train.seed=1", "what colour is it?"])
    ('what colour is it?', ['configs/tiny_cpu.yaml', 'train.seed=1'])
    >>> split_prompt(["configs/tiny_cpu.yaml"])
    (None, ['configs/tiny_cpu.yaml'])
    """
    if args and not OVERRIDE_RE.match(args[-1]) and not args[-1].endswith((".yaml", ".yml")):
        return args[-1], args[:-1]
    return None, list(args)


def chat(
    cfg: PipelineConfig,
    prompt: str | None = None,
    *,
    image: Path | None = None,
    video: Path | None = None,
    sample: str | None = None,
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
    out=None,
) -> str:
    """``packline chat``: answer ``prompt`` (after ``image`` or ``video``), or replay sample
    ``sample`` (with neither, the val split's first sample), printing the answer (and for a
    sample its key and reference) to ``out`` (stdout). Returns the answer."""
    import sys

    out = out or sys.stdout
    if prompt is not None and sample is not None:
        raise UserError(["chat: give a prompt or --sample KEY, not both"])
    if prompt is None and (image is not None or video is not None):
        raise UserError(["chat: --image and --video go with a prompt"])
    if image is not None and video is not None:
        raise UserError(["chat: one of --image or --video"])
    adapter = require_adapter(cfg)
    if prompt is not None:
        asked = user_prompt(prompt, image=image, video=video)
    else:
        asked = sample_prompt(read_sample(cfg, sample))
    model, processor = load_tuned(cfg, adapter)
    answer = generate_answer(model, processor, asked, max_new_tokens=max_new_tokens)
    if asked.key is not None:
        question = _text(asked.conversation[-1]).strip()
        print(f"sample:    {asked.key}", file=out)
        print(f"question:  {question}", file=out)
        print(f"answer:    {answer}", file=out)
        print(f"reference: {asked.reference}", file=out)
    else:
        print(answer, file=out)
    return answer
