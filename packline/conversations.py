"""Reading one row of a ``conversations.jsonl`` folder into packline's conversation form.

Accepted row forms (one JSON object per line)::

    {"id": "a1", "images": ["imgs/cat.png"],
     "conversations": [{"role": "user", "content": "<image>\\nWhat is this?"},
                       {"role": "assistant", "content": "A cat."}]}

LLaVA/ShareGPT turns (``{"from": "human"|"gpt"|"system", "value": ...}``) are accepted too.
``<image>`` markers place the images where they stand, in order; with no markers the images
go before the first user text. An optional ``"split": "train"|"val"`` pins the split and an
optional ``"meta"`` object is carried through untouched.

The result is HF message form, ``[{"role", "content": [{"type": "image"} |
{"type": "text", "text": ...}]}]``, which the chat template of the processor renders.
Every way a row can be bad maps to one reason of ``schemas.tables.REJECT_REASONS``.
"""

from __future__ import annotations

import hashlib
import io
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from PIL import Image

from packline.qwen.vision import ImageGeometry, read_image_size

IMAGE_MARKER = "<image>"
ROLE_ALIASES = {
    "system": "system",
    "user": "user",
    "assistant": "assistant",
    "human": "user",
    "gpt": "assistant",
}
SAFE_KEY_RE = re.compile(r"^[A-Za-z0-9_\-]{1,120}$")


@dataclass
class Rejected(Exception):
    """A row that cannot be used, and why."""

    reason: str
    detail: str
    id: str | None = None


@dataclass
class ImageRef:
    """One image of a row: its source path, encoded bytes and header size."""

    path: str
    data: bytes
    ext: str
    width: int
    height: int


@dataclass
class ConversationRow:
    """A row accepted for the dataset."""

    id: str
    key: str
    split: str | None
    conversation: list[dict[str, Any]]
    images: list[ImageRef]
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def num_assistant_turns(self) -> int:
        return sum(1 for m in self.conversation if m["role"] == "assistant")

    @property
    def text_chars(self) -> int:
        return sum(
            len(p["text"]) for m in self.conversation for p in m["content"] if p["type"] == "text"
        )

    def sample_json(self) -> bytes:
        doc = {"id": self.id, "conversation": self.conversation, "meta": self.meta}
        return json.dumps(doc, ensure_ascii=False, sort_keys=True).encode()


def key_for_id(sample_id: str) -> str:
    """WebDataset key of a sample: the id itself when it is a safe name (letters, digits,
    ``_`` and ``-``), else ``h`` + 24 hex digits of its sha1 (dots would break WebDataset)."""
    if SAFE_KEY_RE.match(sample_id):
        return sample_id
    return "h" + hashlib.sha1(sample_id.encode()).hexdigest()[:24]


def split_for_id(sample_id: str, val_fraction: float) -> str:
    """Deterministic split from a hash of the id."""
    bucket = int(hashlib.sha256(sample_id.encode()).hexdigest()[:8], 16) / 0xFFFFFFFF
    return "val" if bucket < val_fraction else "train"


def _text_parts(text: str) -> list[dict[str, Any]]:
    parts: list[dict[str, Any]] = []
    for i, chunk in enumerate(text.split(IMAGE_MARKER)):
        if i > 0:
            parts.append({"type": "image"})
        if chunk:
            parts.append({"type": "text", "text": chunk})
    return parts


def _content_text(content: Any, sid: str | None) -> str:
    """Message content as text; HF parts lists are turned back into marker text."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") not in ("text", "image"):
                raise Rejected("malformed", f"content part {part!r} is not text or image", sid)
            if part["type"] == "image":
                out.append(IMAGE_MARKER)
            elif not isinstance(part.get("text"), str):
                raise Rejected("malformed", "a text part has no string 'text'", sid)
            else:
                out.append(part["text"])
        return "".join(out)
    raise Rejected(
        "malformed", f"message content must be a string, got {type(content).__name__}", sid
    )


def _messages(turns: Any, sid: str) -> list[tuple[str, str]]:
    if not isinstance(turns, list) or not turns:
        raise Rejected("malformed", "'conversations' must be a non-empty list", sid)
    out = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise Rejected("malformed", f"turn {i} is not an object", sid)
        if "role" in turn or "content" in turn:
            role, content = turn.get("role"), turn.get("content")
        elif "from" in turn or "value" in turn:
            role, content = turn.get("from"), turn.get("value")
        else:
            raise Rejected("malformed", f"turn {i} has neither role/content nor from/value", sid)
        if role not in ROLE_ALIASES:
            raise Rejected("unknown_role", f"turn {i} has role {role!r}", sid)
        out.append((ROLE_ALIASES[role], _content_text(content, sid)))
    return out


def _load_image(folder: Path, rel: Any, sid: str, geometry: ImageGeometry) -> ImageRef:
    if not isinstance(rel, str) or not rel:
        raise Rejected("malformed", f"image path {rel!r} is not a non-empty string", sid)
    if Path(rel).is_absolute():
        raise Rejected(
            "image_path_unsafe", f"{rel!r} is absolute; paths are relative to the folder", sid
        )
    root = folder.resolve()
    path = (root / rel).resolve()
    if not path.is_relative_to(root):
        raise Rejected("image_path_unsafe", f"{rel!r} escapes the data folder", sid)
    if not path.is_file():
        raise Rejected("missing_image", f"{rel!r} does not exist", sid)
    data = path.read_bytes()
    try:
        width, height = read_image_size(data)
        ext = _decode_fully(data)
    except ValueError as exc:
        raise Rejected("image_unreadable", f"{rel!r}: {exc}", sid) from None
    try:
        geometry.resized(height, width)
    except ValueError as exc:
        raise Rejected("image_size_refused", f"{rel!r} ({width}x{height}): {exc}", sid) from None
    return ImageRef(path=rel, data=data, ext=ext, width=width, height=height)


def _decode_fully(data: bytes) -> str:
    """Decode every pixel once (a header can be fine while the pixels are truncated);
    returns the file extension to store the bytes under."""
    try:
        with Image.open(io.BytesIO(data)) as img:
            fmt = (img.format or "png").lower()
            img.load()
    except Exception as exc:
        raise ValueError(f"cannot decode pixels: {exc}") from exc
    return {"jpeg": "jpg", "mpo": "jpg"}.get(fmt, fmt)


def parse_row(
    line: str,
    folder: Path,
    *,
    geometry: ImageGeometry,
    max_images: int,
    val_fraction: float,
) -> ConversationRow:
    """One jsonl line → :class:`ConversationRow`, or raise :class:`Rejected` with the reason."""
    try:
        row = json.loads(line)
    except json.JSONDecodeError as exc:
        raise Rejected("malformed_json", f"not JSON: {exc.msg} at column {exc.colno}") from None
    if not isinstance(row, dict):
        raise Rejected("malformed_json", f"a row must be a JSON object, got {type(row).__name__}")
    raw_id = row.get("id")
    if isinstance(raw_id, bool) or not isinstance(raw_id, (str, int)) or str(raw_id) == "":
        raise Rejected("malformed", f"'id' must be a non-empty string or integer, got {raw_id!r}")
    sid = str(raw_id)
    split = row.get("split")
    if split is not None and split not in ("train", "val"):
        raise Rejected("malformed", f"'split' must be 'train' or 'val', got {split!r}", sid)
    meta = row.get("meta", {})
    if not isinstance(meta, dict):
        raise Rejected("malformed", "'meta' must be an object", sid)
    messages = _messages(row.get("conversations"), sid)
    if not any(role == "assistant" for role, _ in messages):
        raise Rejected("no_assistant_turn", "the conversation has no assistant turn", sid)
    if not any(role == "user" for role, _ in messages):
        raise Rejected("malformed", "the conversation has no user turn", sid)
    images = row.get("images", [])
    if images is None:
        images = []
    if not isinstance(images, list):
        raise Rejected("malformed", "'images' must be a list of paths", sid)
    if len(images) > max_images:
        raise Rejected(
            "too_many_images", f"{len(images)} images, prepare.max_images is {max_images}", sid
        )
    markers = sum(text.count(IMAGE_MARKER) for _, text in messages)
    if markers and markers != len(images):
        raise Rejected(
            "marker_count_mismatch",
            f"{markers} {IMAGE_MARKER} markers for {len(images)} images",
            sid,
        )
    refs = [_load_image(folder, rel, sid, geometry) for rel in images]
    conversation: list[dict[str, Any]] = []
    placed = markers > 0 or not images
    for role, text in messages:
        parts = _text_parts(text)
        if not placed and role == "user":
            parts = [{"type": "image"} for _ in images] + parts
            placed = True
        if not parts:
            raise Rejected("malformed", f"an empty {role} turn", sid)
        conversation.append({"role": role, "content": parts})
    return ConversationRow(
        id=sid,
        key=key_for_id(sid),
        split=split if split is not None else split_for_id(sid, val_fraction),
        conversation=conversation,
        images=refs,
        meta=meta,
    )
