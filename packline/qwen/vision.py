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
``smart_resize`` and constants; :func:`bridge_fetch_image` runs it on pixels.
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass, replace
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


def _qwen_vl_utils_size(height: int, width: int) -> tuple[int, int]:
    """(height, width) ``qwen_vl_utils.fetch_image`` resizes an image to, with the arguments
    Bridge's Qwen path gives it (none: patch size 14, the default bounds)."""
    from qwen_vl_utils import vision_process as qvu

    factor = 14 * qvu.SPATIAL_MERGE_SIZE
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


def read_image_size(data: bytes) -> tuple[int, int]:
    """(width, height) from an encoded image's header; the pixels are not decoded.

    Raises ``ValueError`` when the bytes are not an image PIL can identify.
    """
    try:
        with Image.open(io.BytesIO(data)) as img:
            return img.size
    except Exception as exc:  # PIL raises UnidentifiedImageError, OSError, SyntaxError...
        raise ValueError(f"unreadable image: {exc}") from exc
