"""What the model and processor a config names say, as far as the config's own rules need
it: read from their JSON files (no model, no processor loaded, no torch imported), or, for
the built-in tiny ones, the values packline builds them with (``packline/qwen/model.py`` and
``packline/qwen/vision.py`` take them from here).

- :func:`context_length`: the language model's ``max_position_embeddings`` (a Qwen3-VL
  ``config.json`` holds it in ``text_config``), which ``packing.seq_length`` may not exceed;
- :func:`image_processor_params`: the image processor's geometry as saved in a processor dir
  (``preprocessor_config.json``, or the ``image_processor`` entry of
  ``processor_config.json``), which :class:`ImageBounds` resolves with the config's own
  ``processor.*`` values.

A file that is missing or unreadable gives None: the rules that need it do not apply, and
the stage that loads the file (connect, validate's model rules) says what is wrong with it.

    >>> context_length(None)
    128000
    >>> bounds = ImageBounds.of(None, {"max_pixels": 2000})
    >>> bounds.min_pixels, bounds.max_pixels, bounds.problems()[0].split(": no")[0][-30:]
    (4096, 2000, 'built-in tiny processor) 4,096')
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from schemas.hub import local_dir

TINY_CONTEXT_LENGTH = 128_000
"""The built-in tiny Qwen3-VL's ``max_position_embeddings`` (Qwen3-VL's configs' default)."""

TINY_IMAGE = {
    "patch_size": 16,
    "merge_size": 2,
    "temporal_patch_size": 2,
    "min_pixels": 64 * 64,
    "max_pixels": 1024 * 32 * 32,  # 1,024 visual tokens
}
"""The built-in tiny processor's image geometry (Qwen3-VL's patch, merge and temporal patch
sizes; pixel bounds for a laptop): also what a processor dir that leaves a field out gets."""


def _json(path: Path) -> dict[str, Any] | None:
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def context_length(model_path: str | None) -> int | None:
    """The model's context length: ``max_position_embeddings`` of ``<model_path>/config.json``
    (its ``text_config``'s, else its own); the tiny model's for None; None when the file
    says nothing readable."""
    if model_path is None:
        return TINY_CONTEXT_LENGTH
    where = local_dir(model_path)  # a dir, or a Hub repo's cached snapshot
    if where is None:
        return None
    doc = _json(where / "config.json")
    if doc is None:
        return None
    text = doc.get("text_config") if isinstance(doc.get("text_config"), dict) else doc
    value = text.get("max_position_embeddings", doc.get("max_position_embeddings"))
    return int(value) if isinstance(value, int) and value > 0 else None


def image_processor_params(processor_path: str | Path) -> dict[str, Any] | None:
    """The image processor's saved parameters of a processor dir, None when it has none."""
    path = Path(processor_path).expanduser()
    pre = _json(path / "preprocessor_config.json")
    if pre is not None:
        return pre
    proc = _json(path / "processor_config.json")
    params = proc.get("image_processor") if proc is not None else None
    return params if isinstance(params, dict) and params else None


def image_geometry_fields(params: dict[str, Any]) -> dict[str, int]:
    """The five geometry fields of saved image-processor ``params`` (``min_pixels`` /
    ``max_pixels`` or ``size``'s ``shortest_edge`` / ``longest_edge``); a field left out
    takes :data:`TINY_IMAGE`'s value."""
    size = params.get("size") or {}
    return {
        "patch_size": int(params.get("patch_size", TINY_IMAGE["patch_size"])),
        "merge_size": int(params.get("merge_size", TINY_IMAGE["merge_size"])),
        "temporal_patch_size": int(
            params.get("temporal_patch_size", TINY_IMAGE["temporal_patch_size"])
        ),
        "min_pixels": int(
            params.get("min_pixels") or size.get("shortest_edge", TINY_IMAGE["min_pixels"])
        ),
        "max_pixels": int(
            params.get("max_pixels") or size.get("longest_edge", TINY_IMAGE["max_pixels"])
        ),
    }


@dataclass(frozen=True)
class ImageBounds:
    """The pixel bounds and token side an image is resized with: the processor's, with the
    config's ``processor.*`` in their place where set; and which ones the config set."""

    min_pixels: int
    max_pixels: int
    patch_size: int
    merge_size: int
    source: str
    """Where the processor's own values come from, for a message."""
    overridden: frozenset[str]

    @classmethod
    def of(cls, processor_path: str | None, overrides: dict[str, int]) -> ImageBounds | None:
        """The bounds of the processor at ``processor_path`` (the tiny one for None) with
        ``overrides``; None when the dir holds no readable image processor config."""
        if processor_path is None:
            own, source = dict(TINY_IMAGE), "the built-in tiny processor"
        else:
            where = local_dir(processor_path)
            params = image_processor_params(where) if where is not None else None
            if params is None:
                return None
            try:
                own = image_geometry_fields(params)
            except (TypeError, ValueError):
                return None
            source = str(processor_path)
        merged = {**own, **overrides}
        return cls(
            min_pixels=merged["min_pixels"],
            max_pixels=merged["max_pixels"],
            patch_size=merged["patch_size"],
            merge_size=merged["merge_size"],
            source=source,
            overridden=frozenset(overrides),
        )

    def _name(self, field: str) -> str:
        """``processor.<field>`` when the config sets it, else the processor's own."""
        if field in self.overridden:
            return f"processor.{field}"
        return f"the processor's own {field} ({self.source})"

    def problems(self) -> list[str]:
        """Why no image could be resized within these bounds (each with its fix), or []."""
        out = []
        lo, hi = self.min_pixels, self.max_pixels
        if lo > hi:
            out.append(
                f"{self._name('max_pixels')} {hi:,} is below {self._name('min_pixels')} "
                f"{lo:,}: no image size lies within both; fix: set processor.max_pixels >= "
                f"{lo} (or processor.min_pixels <= {hi})"
            )
        side = self.patch_size * self.merge_size
        if hi < side * side:
            out.append(
                f"{self._name('max_pixels')} {hi:,} is below one visual token, {side}x{side} "
                f"= {side * side:,} pixels (patch {self.patch_size} x merge {self.merge_size}): "
                f"every image would shrink to nothing; fix: set processor.max_pixels >= "
                f"{side * side}"
            )
        return out
