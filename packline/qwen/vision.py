"""Image geometry of the Qwen2-VL / Qwen3-VL image processor, without decoding pixels.

The processor resizes every image with ``smart_resize`` to a multiple of
``patch_size * merge_size`` within ``[min_pixels, max_pixels]``, cuts it into
``patch_size``-square patches and merges ``merge_size**2`` patches into one LLM token.
Knowing the image's width and height (read from the file header) is therefore enough to
know its exact number of visual tokens — the cheap path the packer relies on.
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass
from pathlib import Path

from PIL import Image
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize


@dataclass(frozen=True, kw_only=True)
class ImageGeometry:
    """The parameters of the image processor that decide an image's token count."""

    patch_size: int = 16
    """Side of one ViT patch in pixels (Qwen3-VL: 16)."""
    merge_size: int = 2
    """Patches merged per side into one LLM token (2 → 4 patches per token)."""
    temporal_patch_size: int = 2
    """Frames per temporal patch; a still image is duplicated to fill it (t = 1)."""
    min_pixels: int = 64 * 64
    """Images are upscaled to at least this many pixels."""
    max_pixels: int = 1024 * 32 * 32
    """Images are downscaled to at most this many pixels (here: 1,024 visual tokens)."""

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    @classmethod
    def from_processor_dir(cls, path: str | Path) -> ImageGeometry:
        """Read the geometry from a saved HF processor dir (``preprocessor_config.json`` or
        the ``image_processor`` entry of ``processor_config.json``)."""
        path = Path(path)
        params: dict | None = None
        pre = path / "preprocessor_config.json"
        proc = path / "processor_config.json"
        if pre.is_file():
            params = json.loads(pre.read_text())
        elif proc.is_file():
            params = json.loads(proc.read_text()).get("image_processor")
        if not params:
            raise ValueError(
                f"{path} holds no image processor config (preprocessor_config.json or "
                "processor_config.json with an 'image_processor' entry)"
            )
        size = params.get("size") or {}
        return cls(
            patch_size=int(params.get("patch_size", 16)),
            merge_size=int(params.get("merge_size", 2)),
            temporal_patch_size=int(params.get("temporal_patch_size", 2)),
            min_pixels=int(params.get("min_pixels") or size.get("shortest_edge", 64 * 64)),
            max_pixels=int(params.get("max_pixels") or size.get("longest_edge", 1024 * 32 * 32)),
        )

    def resized(self, height: int, width: int) -> tuple[int, int]:
        """(height, width) after the processor's resize rule; ``ValueError`` if it refuses
        the image (aspect ratio over 200, or an empty image)."""
        if height <= 0 or width <= 0:
            raise ValueError(f"image has no pixels ({width}x{height})")
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


def read_image_size(data: bytes) -> tuple[int, int]:
    """(width, height) from an encoded image's header; the pixels are not decoded.

    Raises ``ValueError`` when the bytes are not an image PIL can identify.
    """
    try:
        with Image.open(io.BytesIO(data)) as img:
            return img.size
    except Exception as exc:  # PIL raises UnidentifiedImageError, OSError, SyntaxError...
        raise ValueError(f"unreadable image: {exc}") from exc
