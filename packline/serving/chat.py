"""Try the trained model: the base and a run's LoRA adapter, loaded with transformers and
PEFT, answering a prompt (with an image or a video) or replaying a prepared sample.

The base is what training started from (:func:`packline.train.setup.build_model`: the
``model.path`` checkpoint, or with ``model.path`` null the tiny model at random init, rebuilt
exactly from ``train.seed``), the processor is connect's copy, and the adapter is the one
:func:`packline.catalog.adapter_dir` names. Generation is greedy, with the processor's chat
template and the language model on ``sdpa`` attention (one conversation: the packed
attention buys nothing here).

A sample is replayed as the conversation up to its first assistant turn (its system and user
turns, with their images and videos); the reference answer is that assistant turn's text.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch

from packline.catalog import adapter_dir, dataset_dir, dataset_path, processor_dir
from packline.qwen.generate import (
    DEFAULT_MAX_NEW_TOKENS,
    Prompt,
    decoded_video,
    generate_answer,
    message_text,
    quiet_libraries,
    sample_prompt,
)
from schemas.config import PipelineConfig
from schemas.errors import UserError


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
    with quiet_libraries():  # fp32 whatever the run trained in: an exact merge, a CPU chat
        model = build_model(cfg, processor, dtype=torch.float32)
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
        from packline.media.video import VideoError

        try:
            videos.append(decoded_video(Path(video)))
        except VideoError as exc:
            raise UserError([f"{video}: not a readable video ({exc})"]) from None
        parts.append({"type": "video"})
    parts.append({"type": "text", "text": text})
    return Prompt([{"role": "user", "content": parts}], images, videos)


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
    from packline.energon.loader import read_conversations

    for sample in read_conversations(dataset_path(cfg), split):
        if key is None or sample.__key__ == key:
            return sample
    raise UserError([f"--sample {key}: in the manifest but not in the {split} shards"])


# --- generating ----------------------------------------------------------------------------


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
        question = message_text(asked.conversation[-1]).strip()
        print(f"sample:    {asked.key}", file=out)
        print(f"question:  {question}", file=out)
        print(f"answer:    {answer}", file=out)
        print(f"reference: {asked.reference}", file=out)
    else:
        print(answer, file=out)
    return answer
