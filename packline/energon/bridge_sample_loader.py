"""Energon sample loader: packline's shards read as Megatron-Bridge's ``ChatMLWebdataset``.

prepare copies this file, unchanged, into ``<work>/prepare/.nv-meta/`` and names it in
``.nv-meta/bridge_dataset.yaml``; ``<work>/prepare/bridge.yaml`` (a ``MetadatasetV2``) selects
that dataset config for both splits. Bridge's ``dataset.path`` points at ``bridge.yaml``, so
Bridge reads the very shards packline's own loader reads (through ``.nv-meta/dataset.yaml``,
a ``CrudeWebdataset``), without a second copy.

It runs inside Energon, after the ``ChatMLWebdataset`` decoder: each ``<key>.img<k>.<ext>`` part
arrives decoded (a ``(3, H, W)`` float tensor for the extensions webdataset's image handler
knows, the encoded bytes otherwise, which become a PIL image here), and ``<key>.json`` as
bytes. It maps them onto ``ChatMLSample``'s fields: ``conversation`` (the JSON document whose
``"conversation"`` holds the turns with typed ``{"type": "image"}`` / ``{"type": "text"}``
parts) and ``imgs`` (the images in order of appearance, ``None`` for a text-only sample).

Self-contained on purpose (PIL only): it is loaded by file path inside the training
container, where packline's packages need not be importable.
"""

from __future__ import annotations

import io
import re

_IMAGE_PART = re.compile(r"^img(\d+)\.[A-Za-z0-9]+$")


def part_filter(part: str) -> bool:
    """The parts a sample is read from: its JSON document and its images."""
    return part == "json" or _IMAGE_PART.match(part) is not None


def _image(value):
    if isinstance(value, (bytes, bytearray)):
        from PIL import Image

        with Image.open(io.BytesIO(value)) as img:
            return img.convert("RGB")
    return value


def sample_loader(raw: dict) -> dict:
    """``ChatMLSample`` fields of one decoded WebDataset entry."""
    found = sorted((int(m.group(1)), k) for k in raw if (m := _IMAGE_PART.match(k)))
    images = [_image(raw[k]) for _, k in found]
    return {"conversation": raw["json"], "imgs": images or None}
