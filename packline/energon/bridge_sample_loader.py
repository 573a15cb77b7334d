"""Energon sample loader: packline's shards read as Megatron-Bridge's ``ChatMLWebdataset``.

prepare copies this file, unchanged, into ``<work>/prepare/.nv-meta/`` and names it in
``.nv-meta/bridge_dataset.yaml``; ``<work>/prepare/bridge.yaml`` (a ``MetadatasetV2``) selects
that dataset config for both splits. Bridge's ``dataset.path`` points at ``bridge.yaml``, so
Bridge reads the very shards packline's own loader reads (through ``.nv-meta/dataset.yaml``,
a ``CrudeWebdataset``), without a second copy.

It runs inside Energon, after the ``ChatMLWebdataset`` decoder, on the parts
:func:`part_filter` lets through:

- ``<key>.json``, decoded by webdataset into a dict (``"conversation"`` holds the turns with
  typed ``{"type": "image"}`` / ``{"type": "video"}`` / ``{"type": "text"}`` parts; a video
  part carries no ``"video"`` or ``"path"`` key, so Bridge fills it from ``videos``);
- each ``<key>.img<k>.<ext>``: a ``(3, H, W)`` float tensor for the extensions webdataset's
  image handler knows, the encoded bytes otherwise (a PIL image here);
- each video's frames as prepare pre-sampled them for Bridge (``train.backend: megatron``),
  ``<key>.vid<k>.f<j>.png``: one lossless PNG per sampled frame, ``j`` in order, decoded like
  the images. The video file itself (``<key>.vid<k>.mp4`` ...) is left out: Bridge decodes no
  video file for Qwen (mp4 bytes in ``videos`` fail in qwen-vl-utils).

They map onto ``ChatMLSample``'s fields: ``conversation``, ``imgs`` (the images in order of
appearance, ``None`` for none) and ``videos`` (a list of videos, each the list of its frames
in order, ``None`` for none).

Self-contained on purpose (PIL only): it is loaded by file path inside the training
container, where packline's packages need not be importable.

    >>> frame_parts({"json": b"", "vid1.f000.png": 0, "vid0.f010.png": 0, "vid0.f002.png": 0,
    ...              "vid0.mp4": 0})
    [['vid0.f002.png', 'vid0.f010.png'], ['vid1.f000.png']]
    >>> [p for p in ("json", "img0.jpg", "vid0.mp4", "vid0.f003.png") if part_filter(p)]
    ['json', 'img0.jpg', 'vid0.f003.png']
"""

from __future__ import annotations

import io
import json
import re

_IMAGE_PART = re.compile(r"^img(\d+)\.[A-Za-z0-9]+$")
_FRAME_PART = re.compile(r"^vid(\d+)\.f(\d+)\.png$")


def part_filter(part: str) -> bool:
    """The parts a sample is read from: its JSON document, its images and its videos'
    pre-sampled frames (not the video files)."""
    return part == "json" or any(p.match(part) for p in (_IMAGE_PART, _FRAME_PART))


def frame_parts(raw: dict) -> list[list[str]]:
    """The frame parts of a sample, grouped by video and in order (video ``k``, frame ``j``)."""
    videos: dict[int, list[tuple[int, str]]] = {}
    for key in raw:
        if m := _FRAME_PART.match(key):
            videos.setdefault(int(m.group(1)), []).append((int(m.group(2)), key))
    return [[key for _, key in sorted(videos[k])] for k in sorted(videos)]


def _image(value):
    if isinstance(value, (bytes, bytearray)):
        from PIL import Image

        with Image.open(io.BytesIO(value)) as img:
            return img.convert("RGB")
    return value


def sample_loader(raw: dict) -> dict:
    """``ChatMLSample`` fields of one decoded WebDataset entry. Raises ``ValueError`` for a
    video without frame parts (a dataset prepared for ``train.backend: local``)."""
    doc = raw["json"]
    if isinstance(doc, (bytes, bytearray, str)):
        doc = json.loads(doc)
    found = sorted((int(m.group(1)), k) for k in raw if (m := _IMAGE_PART.match(k)))
    images = [_image(raw[k]) for _, k in found]
    videos = [[_image(raw[k]) for k in keys] for keys in frame_parts(raw)]
    expected = len(doc.get("videos") or []) if isinstance(doc, dict) else 0
    if len(videos) != expected:
        raise ValueError(
            f"sample {raw.get('__key__')!r} holds {expected} videos but the frames of "
            f"{len(videos)}: Megatron-Bridge reads a video as its pre-sampled frames, which "
            "prepare writes for train.backend megatron only (rerun prepare with it)"
        )
    return {"conversation": doc, "imgs": images or None, "videos": videos or None}
