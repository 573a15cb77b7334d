"""The sample type of packline's prepared shards and the cooker that builds it.

A prepared sample is a WebDataset entry ``<key>.json`` (``{"id", "conversation", "meta",
"videos"}``, the conversation in HF message form with ``{"type": "image"}`` and
``{"type": "video"}`` parts, ``videos`` the header prepare probed of each video:
:meth:`packline.media.video.VideoHeader.to_dict`) plus one file per image, ``<key>.img<k>.<ext>``,
and one per video, ``<key>.vid<k>.<ext>`` (``mp4``, ``mkv``, ``webm`` ...), each holding the
original encoded bytes. The dataset is a ``CrudeWebdataset``; :func:`cook_conversation` turns
the crude dict into a :class:`ConversationSample` without decoding any pixels. The samples of
an Energon dataset adopted in place (Megatron-Bridge's ChatML layout,
:mod:`packline.energon.chatml`) come in through :func:`cook_chatml` instead, routed by their
subflavors: every task encoder lists :data:`CHATML_COOKER` before the default cooker.

    >>> image_parts({"json": b"", "img1.png": b"", "img0.jpg": b"", "vid0.mp4": b""})
    ['img0.jpg', 'img1.png']
    >>> video_parts({"json": b"", "vid10.mkv": b"", "vid2.mp4": b"", "img0.png": b""})
    ['vid2.mp4', 'vid10.mkv']
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

from packline.energon.chatml import SOURCE_SUBFLAVOR, chatml_conversation

IMAGE_PART_RE = re.compile(r"^img(\d+)\.[A-Za-z0-9]+$")
VIDEO_PART_RE = re.compile(r"^vid(\d+)\.[A-Za-z0-9]+$")


@edataclass
class ConversationSample(Sample):
    """One conversation with its images and videos, still encoded."""

    #: The row's id in the source data.
    sample_id: str
    #: HF message form: ``[{"role", "content": [{"type": "text"|"image"|"video", ...}]}]``.
    conversation: list[dict[str, Any]]
    #: Encoded image bytes (PNG/JPEG/...), in order of appearance.
    images: list[bytes]
    #: The video files' original bytes (MP4/MKV/WebM/...), in order of appearance.
    videos: list[bytes]
    #: Each video's header as prepare probed it (``VideoHeader.to_dict()``: decoded frame
    #: count, fps, upright width/height ...), in the order of ``videos``.
    video_headers: list[dict[str, Any]]
    #: Free-form metadata carried from the source row (e.g. checkable answers).
    meta: dict[str, Any]


def _indexed_parts(raw: dict[str, Any], pattern: re.Pattern) -> list[str]:
    found = [(int(m.group(1)), k) for k in raw if (m := pattern.match(k))]
    return [k for _, k in sorted(found)]


def image_parts(raw: dict[str, Any]) -> list[str]:
    """The image entries of a crude sample, ordered by their index."""
    return _indexed_parts(raw, IMAGE_PART_RE)


def video_parts(raw: dict[str, Any]) -> list[str]:
    """The video entries of a crude sample, ordered by their index."""
    return _indexed_parts(raw, VIDEO_PART_RE)


@stateless
def cook_conversation(raw: dict[str, Any]) -> ConversationSample:
    """Crude WebDataset dict → :class:`ConversationSample` (pixels stay encoded)."""
    doc = json.loads(raw["json"])
    videos = [raw[k] for k in video_parts(raw)]
    headers = doc.get("videos", [])
    if len(headers) != len(videos):
        raise ValueError(
            f"sample {raw.get('__key__')!r} has {len(videos)} video parts but "
            f"{len(headers)} video headers in its JSON"
        )
    return ConversationSample(
        **basic_sample_keys(raw),
        sample_id=doc["id"],
        conversation=doc["conversation"],
        images=[raw[k] for k in image_parts(raw)],
        videos=videos,
        video_headers=headers,
        meta=doc.get("meta", {}),
    )


@stateless
def cook_chatml(raw: dict[str, Any]) -> ConversationSample:
    """A crude sample of an Energon dataset adopted in place → :class:`ConversationSample`
    (:func:`packline.energon.chatml.chatml_conversation`: the conversation as prepare
    structured it; no video; ``__key__`` Energon's key, the manifest's)."""
    sid, conversation, images = chatml_conversation(raw)
    return ConversationSample(
        **basic_sample_keys(raw),
        sample_id=sid,
        conversation=conversation,
        images=images,
        videos=[],
        video_headers=[],
        meta={},
    )


#: Placed before the default cooker in every packline task encoder's ``cookers``: the crude
#: samples whose subflavor :data:`~packline.energon.chatml.SOURCE_SUBFLAVOR` is ``chatml``
#: (an adopted dataset's, through prepare's ``packline.yaml``) are cooked by it.
CHATML_COOKER = Cooker(cook_chatml, has_subflavors={SOURCE_SUBFLAVOR: "chatml"})


class ConversationReader(DefaultTaskEncoder[ConversationSample, ConversationSample, Any, Any]):
    """Reads prepared shards as :class:`ConversationSample` s, one per batch, no decoding."""

    cookers = [CHATML_COOKER, Cooker(cook_conversation)]
    #: No decoder: images and videos stay as their encoded bytes (sizes come from headers).
    decoder = None

    def batch(self, samples: list[ConversationSample]) -> list[ConversationSample]:
        return samples
