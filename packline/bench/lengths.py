"""Length distributions of the packing benchmark: a seeded synthetic one shaped like VLM SFT
data (:func:`vlm_sft_lengths`) and the seeded order a stream hands them to a packer in."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class VlmSftShape:
    """Synthetic VLM SFT conversation lengths: heavy-tailed text plus 0-4 images."""

    text_median: int = 220
    """Median text tokens per conversation (template, prompt and answer)."""
    text_sigma: float = 1.0
    """σ of log(text tokens): the right tail (long answers, documents)."""
    text_max: int = 32_768
    """Text tokens are clipped here; anything this long is overlength anyway."""
    image_count_weights: tuple[int, ...] = (35, 40, 13, 7, 5)
    """Relative frequency of 0, 1, 2, ... images per conversation."""
    image_tokens_min: int = 256
    """Fewest visual tokens of one image."""
    image_tokens_max: int = 1024
    """Most visual tokens of one image (drawn uniformly between min and max)."""
    visual_budget: int = 1536
    """Most visual tokens per conversation, as a processor's total-pixel limit does: when a
    conversation's images exceed it, each image's tokens above ``image_tokens_min`` shrink
    by the same factor."""

    def __post_init__(self):
        max_images = len(self.image_count_weights) - 1
        if not 0 < self.image_tokens_min <= self.image_tokens_max:
            raise ValueError(
                f"need 0 < image_tokens_min <= image_tokens_max, got "
                f"{self.image_tokens_min} and {self.image_tokens_max}"
            )
        if self.visual_budget < max_images * self.image_tokens_min:
            raise ValueError(
                f"visual_budget {self.visual_budget} cannot hold {max_images} images of "
                f"{self.image_tokens_min} tokens: raise it to at least "
                f"{max_images * self.image_tokens_min}"
            )


def vlm_sft_samples(
    num_samples: int, *, seed: int, shape: VlmSftShape | None = None
) -> list[tuple[int, list[int]]]:
    """``(text tokens, visual tokens per image)`` per conversation, seeded.

    >>> vlm_sft_samples(3, seed=0)
    [(183, [670]), (768, [450, 705, 379]), (48, [512])]
    """
    shape = shape or VlmSftShape()
    rng = random.Random(seed)
    mu = math.log(shape.text_median)
    counts = range(len(shape.image_count_weights))
    lo = shape.image_tokens_min
    out = []
    for _ in range(num_samples):
        text = min(shape.text_max, max(16, round(rng.lognormvariate(mu, shape.text_sigma))))
        k = rng.choices(counts, weights=shape.image_count_weights)[0]
        images = [rng.randint(lo, shape.image_tokens_max) for _ in range(k)]
        if sum(images) > shape.visual_budget:
            scale = (shape.visual_budget - lo * k) / (sum(images) - lo * k)
            images = [lo + int((n - lo) * scale) for n in images]
        out.append((text, images))
    return out


def vlm_sft_lengths(num_samples: int, *, seed: int, shape: VlmSftShape | None = None) -> list[int]:
    """Total tokens (text + visual) per conversation of :func:`vlm_sft_samples`.

    >>> vlm_sft_lengths(3, seed=0)  # 183 + 670, 768 + 450 + 705 + 379, 48 + 512
    [853, 2302, 560]
    """
    return [t + sum(v) for t, v in vlm_sft_samples(num_samples, seed=seed, shape=shape)]


def vlm_sft_rows(
    num_samples: int, *, seed: int, shape: VlmSftShape | None = None
) -> list[tuple[int, list[tuple[int, int, int]], list]]:
    """:func:`vlm_sft_samples` as ``(length, image grids, video grids)``: an image of n
    visual tokens is the patch grid ``(1, 2, 2n)`` (merged 2×2 into n tokens; the vision
    tower's FLOPs depend on the patch count, not the aspect), no videos.

    >>> vlm_sft_rows(2, seed=0)
    [(853, [(1, 2, 1340)], []), (2302, [(1, 2, 900), (1, 2, 1410), (1, 2, 758)], [])]
    """
    return [
        (text + sum(images), [(1, 2, 2 * n) for n in images], [])
        for text, images in vlm_sft_samples(num_samples, seed=seed, shape=shape)
    ]


def shuffled(lengths: list[int], seed: int) -> list[int]:
    """The sample stream: ``lengths`` in a seeded shuffled order (``lengths`` untouched).

    >>> shuffled([1, 2, 3, 4, 5], 0)
    [3, 2, 1, 5, 4]
    """
    stream = list(lengths)
    random.Random(seed).shuffle(stream)
    return stream
