"""The sample type of packline's prepared shards and the cooker that builds it.

A prepared sample is a WebDataset entry ``<key>.json`` (``{"id", "conversation", "meta"}``,
the conversation in HF message form with ``{"type": "image"}`` parts) plus one file per
image, ``<key>.img<k>.<ext>``, holding the image's original encoded bytes. The dataset is a
``CrudeWebdataset``; :func:`cook_conversation` turns the crude dict into a
:class:`ConversationSample` without decoding any pixels.
"""

from __future__ import annotations

import json
import re
from typing import Any

from megatron.energon import (
    Cooker,
    DefaultTaskEncoder,
    Sample,
    basic_sample_keys,
    edataclass,
    stateless,
)

IMAGE_PART_RE = re.compile(r"^img(\d+)\.[A-Za-z0-9]+$")


@edataclass
class ConversationSample(Sample):
    """One conversation with its images, still encoded."""

    #: The row's id in the source data.
    sample_id: str
    #: HF message form: ``[{"role", "content": [{"type": "text"|"image", ...}]}]``.
    conversation: list[dict[str, Any]]
    #: Encoded image bytes (PNG/JPEG/...), in order of appearance.
    images: list[bytes]
    #: Free-form metadata carried from the source row (e.g. checkable answers).
    meta: dict[str, Any]


def image_parts(raw: dict[str, Any]) -> list[str]:
    """The image entries of a crude sample, ordered by their index."""
    found = [(int(m.group(1)), k) for k in raw if (m := IMAGE_PART_RE.match(k))]
    return [k for _, k in sorted(found)]


@stateless
def cook_conversation(raw: dict[str, Any]) -> ConversationSample:
    """Crude WebDataset dict → :class:`ConversationSample` (pixels stay encoded)."""
    doc = json.loads(raw["json"])
    return ConversationSample(
        **basic_sample_keys(raw),
        sample_id=doc["id"],
        conversation=doc["conversation"],
        images=[raw[k] for k in image_parts(raw)],
        meta=doc.get("meta", {}),
    )


class ConversationReader(DefaultTaskEncoder[ConversationSample, ConversationSample, Any, Any]):
    """Reads prepared shards as :class:`ConversationSample` s, one per batch, no decoding."""

    cookers = [Cooker(cook_conversation)]
    #: No decoder: images stay as their encoded bytes (sizes come from headers).
    decoder = None

    def batch(self, samples: list[ConversationSample]) -> list[ConversationSample]:
        return samples
