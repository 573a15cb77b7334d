"""Reading one row of a ``conversations.jsonl`` folder into packline's conversation form.

Accepted row forms (one JSON object per line of a folder's ``conversations.jsonl``, one
record of a LLaVA-style JSON list, or an Energon sample's conversation; all go through
:func:`parse_record`)::

    {"id": "a1", "images": ["imgs/cat.png"],
     "conversations": [{"role": "user", "content": "<image>\\nWhat is this?"},
                       {"role": "assistant", "content": "A cat."}]}
    {"id": "v1", "images": ["imgs/cat.png"], "videos": ["clips/walk.mp4"],
     "conversations": [{"role": "user", "content": "<image><video>\\nSame cat?"},
                       {"role": "assistant", "content": "Yes."}]}

LLaVA/ShareGPT turns (``{"from": "human"|"gpt"|"system", "value": ...}``) are accepted too,
and so are HF content part lists (``{"type": "text"|"image"|"video"}``, read back as marker
text). So is the HF/OpenAI chat layout, ``messages`` instead of ``conversations``, whose
parts name their own media (:func:`messages_record`)::

    {"id": "m1", "messages": [
        {"role": "user", "content": [{"type": "image", "image": "imgs/cat.png"},
                                     {"type": "text", "text": "What is this?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "A cat."}]}]}
 ``<image>`` and ``<video>`` markers place the images and videos where they stand, each
kind in its own order; a kind without markers goes before the first user text (images first,
then videos). Media paths are relative to the folder (absolute or escaping paths are
refused). An optional ``"split": "train"|"val"`` pins the split and an optional ``"meta"``
object is carried through untouched.

Every image is decoded once and every video is decoded once
(:func:`packline.media.video.probe_video`: the header alone can announce frames the file does
not hold); a video's recorded :class:`~packline.media.video.VideoHeader` (decoded frame count,
rate, upright size) is what its length is later computed from, and its frames are checked
against the video processor's sampling (at least ``temporal_patch_size`` sampled frames) and
prepare's limits.

The result is HF message form, ``[{"role", "content": [{"type": "image"} | {"type": "video"}
| {"type": "text", "text": ...}]}]``, which the chat template of the processor renders; a
user text ``"<image>Same as<video>?"`` becomes::

    >>> [p.get("text", p["type"]) for p in _text_parts("<image>Same as<video>?")]
    ['image', 'Same as', 'video', '?']

An Energon dataset in Megatron-Bridge's ChatML layout (:mod:`packline.energon.chatml`) is
read under Bridge's own rule instead (its media source says so, :attr:`MediaSource.markers`):
images and videos stand exactly where an ``{"type": "image"}`` part or a marker stands, each
item of the sample's ``imgs`` in order (an item without one is refused, Bridge would drop it
unseen), a string's text around its markers loses its spaces, typed parts are kept as they
are (a marker inside a text part is text), and ``from``/``value`` wins over ``role``/``content``:
``"Image 1: <image> Image 2: <image>"`` becomes ``["Image 1:", image, "Image 2:", image]``.
:func:`structure_conversation` is that structural rule, for both forms: :func:`parse_record`
and the load-time cooker of an adopted dataset call it, so what prepare checked is what the
loader gives.

Every way a row can be bad maps to one reason of ``schemas.tables.REJECT_REASONS``.
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import os
import re
import stat
import unicodedata
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

from PIL import Image

from packline.media.video import VideoError, VideoHeader, probe_video
from packline.qwen.vision import ImageGeometry, VideoGeometry, read_image_size
from schemas.paths import not_regular

IMAGE_MARKER = "<image>"
VIDEO_MARKER = "<video>"
#: The marker text of each media part type.
MARKERS = {"image": IMAGE_MARKER, "video": VIDEO_MARKER}
_MARKER_RE = re.compile(f"({re.escape(IMAGE_MARKER)}|{re.escape(VIDEO_MARKER)})")
#: File suffixes a video's bytes are stored under (``<key>.vid<k>.<suffix>``); a file with
#: another suffix (or none) is stored as ``.video``.
VIDEO_EXT_RE = re.compile(r"^[a-z0-9]{1,8}$")
ROLE_ALIASES = {
    "system": "system",
    "user": "user",
    "assistant": "assistant",
    "human": "user",
    "gpt": "assistant",
}
SAFE_KEY_RE = re.compile(r"^[A-Za-z0-9_\-]{1,120}$")
#: How a record's media are placed in its conversation: ``packline`` (a folder or a LLaVA
#: JSON file) or ``chatml`` (Megatron-Bridge's ChatML rule; see the module docstring).
MarkerRule = Literal["packline", "chatml"]


@dataclass
class Rejected(Exception):
    """A row that cannot be used, and why."""

    reason: str
    detail: str
    id: str | None = None


@dataclass
class ImageRef:
    """One image of a row: its source path, encoded bytes and header size (the stored
    pixels', which is what every reader of the shards decodes: see ``docs/data.md``)."""

    path: str
    data: bytes
    ext: str
    width: int
    height: int
    #: the EXIF orientation tag (1: as stored; 2-8: a viewer would flip or turn it); counted
    #: (``prepare/image_exif_oriented``), never applied
    orientation: int = 1


@dataclass
class VideoRef:
    """One video of a row: its source path, original bytes, storage extension and the
    header its frames gave (:func:`packline.media.video.probe_video`)."""

    path: str
    data: bytes
    ext: str
    header: VideoHeader


@dataclass
class VideoLimits:
    """What prepare accepts of a row's videos (``prepare.max_videos`` ...), and the video
    processor whose frame sampling decides how many frames a video gives."""

    geometry: VideoGeometry
    max_videos: int
    max_frames_per_video: int
    max_video_seconds: float


@dataclass
class ConversationRow:
    """A row accepted for the dataset."""

    id: str
    key: str
    split: str | None
    conversation: list[dict[str, Any]]
    images: list[ImageRef]
    videos: list[VideoRef] = field(default_factory=list)
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
        doc = {
            "id": self.id,
            "conversation": self.conversation,
            "meta": self.meta,
            "videos": [v.header.to_dict() for v in self.videos],
        }
        return json.dumps(doc, ensure_ascii=False, sort_keys=True).encode()


def key_for_id(sample_id: str) -> str:
    """WebDataset key of a sample: the id itself when it is a safe name (letters, digits,
    ``_`` and ``-``), else ``h`` + 24 hex digits of its sha1 (dots would break WebDataset)."""
    if SAFE_KEY_RE.match(sample_id):
        return sample_id
    return "h" + hashlib.sha1(sample_id.encode()).hexdigest()[:24]


class SeenKeys:
    """The keys accepted so far, each as an 8-byte digest with its row's position (about 100
    bytes a row: the one part of prepare's memory that grows with the dataset). A key seen
    again is the same id again, or another id that maps to the same key
    (:func:`key_for_id` hashes an id that is not a safe name); :meth:`add` says which, naming
    both ids where it can: the earlier one is known when it was its own key, or from
    ``earlier_id(position, key)`` (an adopted dataset's ``<shard>/<key>``).

        >>> seen = SeenKeys("line")
        >>> [seen.add(key_for_id(i), i, n) for n, i in enumerate(["a", "b.c", "a"], 1)]
        [None, None, "id 'a' already seen (line 1)"]
        >>> seen.add("h3366156682782217faa715bc", "h3366156682782217faa715bc", 4)[:48]
        "ids 'h3366156682782217faa715bc' and the id at li"
    """

    def __init__(self, where: str, earlier_id: Callable[[int, str], str] | None = None) -> None:
        self.where = where
        self._earlier_id = earlier_id
        self._seen: dict[bytes, int] = {}  # digest → position, negative when id != key

    def add(self, key: str, sid: str, position: int) -> str | None:
        """Record the row at ``position`` (id ``sid``, key ``key``); None when the key is
        new, else why the row is a duplicate."""
        digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
        first = self._seen.get(digest)
        if first is None:
            self._seen[digest] = position if sid == key else -position
            return None
        at = f"{self.where} {abs(first)}"
        if first > 0:
            earlier: str | None = key  # a safe name: the id is its key
        elif self._earlier_id is not None:
            earlier = self._earlier_id(abs(first), key)
        else:
            earlier = sid if sid != key else None  # one hash of both: one id
        if earlier == sid:
            return f"id {sid!r} already seen ({at})"
        if earlier is None:
            return (
                f"ids {sid!r} and the id at {at} map to the same key {key!r} (the hash of an "
                "id that is not a safe name)"
            )
        return f"ids {sid!r} and {earlier!r} ({at}) map to the same key {key!r}"


def split_for_id(sample_id: str, val_fraction: float) -> str:
    """Deterministic split from a hash of the id."""
    bucket = int(hashlib.sha256(sample_id.encode()).hexdigest()[:8], 16) / 0xFFFFFFFF
    return "val" if bucket < val_fraction else "train"


def _text_parts(text: str) -> list[dict[str, Any]]:
    """Text with markers → typed parts, media where their markers stand."""
    parts: list[dict[str, Any]] = []
    for chunk in _MARKER_RE.split(text):
        if chunk == IMAGE_MARKER:
            parts.append({"type": "image"})
        elif chunk == VIDEO_MARKER:
            parts.append({"type": "video"})
        elif chunk:
            parts.append({"type": "text", "text": chunk})
    return parts


def _content_text(content: Any, sid: str | None) -> str:
    """Message content as text; HF parts lists are turned back into marker text."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") not in ("text", *MARKERS):
                raise Rejected(
                    "malformed", f"content part {part!r} is not text, image or video", sid
                )
            if part["type"] in MARKERS:
                out.append(MARKERS[part["type"]])
            elif not isinstance(part.get("text"), str):
                raise Rejected("malformed", "a text part has no string 'text'", sid)
            else:
                out.append(part["text"])
        return "".join(out)
    raise Rejected(
        "malformed", f"message content must be a string, got {type(content).__name__}", sid
    )


def _chatml_parts(content: Any, sid: str) -> list[dict[str, Any]]:
    """Message content → typed parts as Megatron-Bridge's ChatML normaliser reads it
    (``normalized_vlm_sample_to_hf_example``): a string is split at its markers, each text
    piece stripped of spaces (a string without markers is kept whole); a parts list is kept
    part by part, a marker inside a text part staying text.

    >>> [p.get("text", p["type"]) for p in _chatml_parts("Image 1: <image> Image 2: <image>", "x")]
    ['Image 1:', 'image', 'Image 2:', 'image']
    >>> _chatml_parts([{"type": "text", "text": "a <image> "}], "x")
    [{'type': 'text', 'text': 'a <image> '}]
    """
    if isinstance(content, str):
        if not _MARKER_RE.search(content):
            return [{"type": "text", "text": content}] if content else []
        parts: list[dict[str, Any]] = []
        for piece in _MARKER_RE.split(content):
            if piece in (IMAGE_MARKER, VIDEO_MARKER):
                parts.append({"type": "image" if piece == IMAGE_MARKER else "video"})
            elif piece.strip(" "):
                parts.append({"type": "text", "text": piece.strip(" ")})
        return parts
    if not isinstance(content, list):
        raise Rejected(
            "malformed", f"message content must be a string, got {type(content).__name__}", sid
        )
    parts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("text", *MARKERS):
            raise Rejected("malformed", f"content part {part!r} is not text, image or video", sid)
        if kind == "text":
            if not isinstance(part.get("text"), str):
                raise Rejected("malformed", "a text part has no string 'text'", sid)
            if part["text"]:
                parts.append({"type": "text", "text": part["text"]})
        elif any(k in part for k in (kind, "path", "url")):
            raise Rejected(
                "malformed",
                f"an {kind} part names its own {kind} ({part!r}); the sample's media parts "
                "are the only source read",
                sid,
            )
        else:
            parts.append({"type": kind})
    return parts


def _turn(turn: dict[str, Any], rule: MarkerRule) -> tuple[Any, Any] | None:
    """(role, content) of a turn, or None when it has neither form. Megatron-Bridge reads
    ``from``/``value`` first (a missing ``value`` or ``content`` is empty text); packline's
    own rule reads ``role``/``content`` first."""
    if rule == "chatml":
        if "from" in turn:
            return turn["from"], turn.get("value", "")
        if "role" in turn:
            return turn["role"], turn.get("content", "")
        return None
    if "role" in turn or "content" in turn:
        return turn.get("role"), turn.get("content")
    if "from" in turn or "value" in turn:
        return turn.get("from"), turn.get("value")
    return None


def _turns(turns: Any, sid: str, rule: MarkerRule) -> list[tuple[str, list[dict[str, Any]]]]:
    """The turns' roles and typed parts (media where their markers or parts stand, none
    placed yet), checked for roles and for a user and an assistant turn."""
    if not isinstance(turns, list) or not turns:
        raise Rejected("malformed", "'conversations' must be a non-empty list", sid)
    out = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise Rejected("malformed", f"turn {i} is not an object", sid)
        found = _turn(turn, rule)
        if found is None:
            raise Rejected("malformed", f"turn {i} has neither role/content nor from/value", sid)
        role, content = found
        if not isinstance(role, str) or role not in ROLE_ALIASES:
            raise Rejected("unknown_role", f"turn {i} has role {role!r}", sid)
        if rule == "chatml":
            parts = _chatml_parts(content, sid)
        else:
            parts = _text_parts(_content_text(content, sid))
        out.append((ROLE_ALIASES[role], parts))
    if not any(role == "assistant" for role, _ in out):
        raise Rejected("no_assistant_turn", "the conversation has no assistant turn", sid)
    if not any(role == "user" for role, _ in out):
        raise Rejected("malformed", "the conversation has no user turn", sid)
    return out


def _place_media(
    turns: list[tuple[str, list[dict[str, Any]]]],
    counts: dict[str, int],
    sid: str,
    rule: MarkerRule,
) -> list[dict[str, Any]]:
    """HF message form with every image and video placed: each ``counts[kind]`` must equal
    the markers (parts) of its kind; under packline's own rule a kind without any goes
    before the first user text instead, images first."""
    markers = {kind: sum(p["type"] == kind for _, parts in turns for p in parts) for kind in counts}
    for kind, n in counts.items():
        if markers[kind] != n and (markers[kind] or rule == "chatml"):
            detail = f"{markers[kind]} {MARKERS[kind]} markers for {n} {kind}s"
            if not markers[kind]:
                detail += (
                    f"; Megatron-Bridge's ChatML reader places {kind}s only where an "
                    f"{{'type': '{kind}'}} part or a {MARKERS[kind]} marker stands"
                )
            raise Rejected("marker_count_mismatch", detail, sid)
    unplaced = [{"type": kind} for kind, n in counts.items() if not markers[kind] for _ in range(n)]
    conversation: list[dict[str, Any]] = []
    placed = not unplaced
    for role, parts in turns:
        if not placed and role == "user":
            parts = unplaced + parts
            placed = True
        if not parts:
            raise Rejected("malformed", f"an empty {role} turn", sid)
        conversation.append({"role": role, "content": parts})
    return conversation


def structure_conversation(
    turns: Any, *, num_images: int, num_videos: int, sid: str, rule: MarkerRule = "packline"
) -> list[dict[str, Any]]:
    """A record's turns with ``num_images`` images and ``num_videos`` videos → HF message
    form (``[{"role", "content": [{"type": "text"|"image"|"video", ...}]}]``), or raise
    :class:`Rejected`: roles, markers, media placement and empty turns, under ``rule``
    (see the module docstring). The one home of that rule: :func:`parse_record` and the
    load-time cooker of an adopted Energon dataset both call it.

    >>> turns = [{"from": "human", "value": "Is <image> red?"}, {"from": "gpt", "value": "No"}]
    >>> user, _ = structure_conversation(turns, num_images=1, num_videos=0, sid="a", rule="chatml")
    >>> [p.get("text", p["type"]) for p in user["content"]]
    ['Is', 'image', 'red?']
    >>> turns[0]["value"] = "Is it red?"  # packline's own rule: an unmarked image goes first
    >>> user, _ = structure_conversation(turns, num_images=1, num_videos=0, sid="a")
    >>> [p.get("text", p["type"]) for p in user["content"]]
    ['image', 'Is it red?']
    """
    parsed = _turns(turns, sid, rule)
    return _place_media(parsed, {"image": num_images, "video": num_videos}, sid, rule)


def _media_path(folder: Path, rel: Any, sid: str, kind: str) -> Path:
    """The file a row's media path names (``kind``: ``image`` or ``video``), refusing paths
    that are absolute or escape the folder (``<kind>_path_unsafe``) and a loop of symbolic
    links (``<kind>_unreadable``); whether the file is there and readable is
    :class:`FolderMedia`'s to find out."""
    if not isinstance(rel, str) or not rel:
        raise Rejected("malformed", f"{kind} path {rel!r} is not a non-empty string", sid)
    if Path(rel).is_absolute():
        raise Rejected(
            f"{kind}_path_unsafe", f"{rel!r} is absolute; paths are relative to the folder", sid
        )
    if "\x00" in rel:
        raise Rejected(f"{kind}_path_unsafe", f"{rel!r} holds a NUL, which no file name can", sid)
    root = folder.resolve()
    try:
        path = (root / rel).resolve()
    except (RuntimeError, OSError) as exc:  # a loop: RuntimeError up to 3.12, ELOOP after
        raise Rejected(f"{kind}_unreadable", _os_problem(exc, rel), sid) from None
    if not path.is_relative_to(root):
        raise Rejected(f"{kind}_path_unsafe", f"{rel!r} escapes the data folder", sid)
    return path


def _os_problem(exc: OSError | RuntimeError, rel: str, st: os.stat_result | None = None) -> str:
    """Why the file ``rel`` cannot be read, from what the system said (``st``: its
    ``stat``, where that worked)."""
    if isinstance(exc, RuntimeError) or exc.errno == errno.ELOOP:
        return f"{rel!r} is a loop of symbolic links"
    if exc.errno in (errno.EACCES, errno.EPERM):
        if st is None:  # stat itself was refused: a directory on the way
            why = "a directory on its path cannot be searched"
        else:
            why = f"mode {stat.S_IMODE(st.st_mode):03o}, owner uid {st.st_uid}"
        return f"{rel!r}: permission denied ({why}); let the user running prepare read it"
    name = errno.errorcode.get(exc.errno, str(exc.errno))
    return f"{rel!r}: {exc.strerror or exc} ({name})"


def _normalisation_twin(root: Path, rel: str) -> str | None:
    """The name on disk that differs from a missing part of ``rel`` only in Unicode
    normalisation (e.g. ``café`` in NFD where the row has NFC, common from macOS), else None.
    Only the directory where the path stops existing is listed, and only for a name that is
    not ASCII (an ASCII name is its own NFC and NFD)."""
    here = root
    for part in Path(rel).parts:
        if os.path.lexists(here / part):
            here = here / part
            continue
        if part.isascii():
            return None
        want = unicodedata.normalize("NFC", part)
        try:
            with os.scandir(here) as entries:
                for entry in entries:
                    if unicodedata.normalize("NFC", entry.name) == want:
                        return entry.name
        except OSError:
            pass
        return None
    return None


class MediaSource:
    """Where a row's media bytes come from: each entry of its ``images`` / ``videos`` list
    is a reference this source resolves to ``(bytes, file suffix)`` or rejects. The source
    also says how the row's media are placed (:attr:`markers`), and a source that is one
    stored sample (an Energon dataset's) gives the row its key and reports parts it could not
    read (:meth:`check`)."""

    #: The placement rule of the rows this source belongs to (see the module docstring).
    markers: ClassVar[MarkerRule] = "packline"

    def read(self, ref: Any, sid: str, kind: str) -> tuple[bytes, str]:  # pragma: no cover
        raise NotImplementedError

    def check(self, sid: str) -> None:
        """Raise :class:`Rejected` when the stored sample behind the row could not be read
        (before anything else of the row is looked at); nothing for a folder's files."""

    def key(self, sid: str) -> str:
        """The WebDataset key of the row with id ``sid``: :func:`key_for_id`."""
        return key_for_id(sid)

    def name(self, ref: Any) -> Any:
        """How the row's reject and record name the medium ``ref``: the reference itself
        (a path, an index), unless it is the bytes themselves."""
        return ref


@dataclass
class FolderMedia(MediaSource):
    """Media named by paths relative to ``folder`` (a conversation folder, or a LLaVA JSON
    file's media dir). Each file is looked at (``stat``, following links) before it is
    opened: a missing file is ``missing_<kind>`` (naming a file whose name differs only in
    Unicode normalisation), anything but a regular file (a FIFO, a device, a socket, a
    directory) and a file the system refuses to read (no permission, a loop of links, an
    I/O error) are ``<kind>_unreadable``, one over ``max_bytes`` ``<kind>_size_refused``;
    none of these opens it, and each rejects its row only."""

    folder: Path
    #: files larger than this (bytes, from ``stat``) are refused unread: ``prepare.max_media_bytes``
    max_bytes: int = 1 << 30

    def read(self, ref: Any, sid: str, kind: str) -> tuple[bytes, str]:
        path = _media_path(self.folder, ref, sid, kind)
        try:
            st = path.stat()
        except (FileNotFoundError, NotADirectoryError):
            detail = f"{kind} {ref!r} does not exist"
            if (twin := _normalisation_twin(self.folder.resolve(), ref)) is not None:
                detail += (
                    f"; a file named {twin!r} differs from it only in Unicode normalisation "
                    "(NFC vs NFD): rename the file or the path in the row"
                )
            raise Rejected(f"missing_{kind}", detail, sid) from None
        except OSError as exc:
            raise Rejected(f"{kind}_unreadable", _os_problem(exc, ref), sid) from None
        data = self._read_regular(path, st, ref, sid, kind)
        return data, path.suffix.lower().lstrip(".")

    def _read_regular(self, path: Path, st: os.stat_result, ref: str, sid: str, kind: str) -> bytes:
        """The bytes of the file ``path`` (``st``: its ``stat``) when it is a regular file
        within ``max_bytes``; opened without blocking and checked again once open, so a file
        swapped for a FIFO after the ``stat`` cannot hang the worker."""
        if (what := not_regular(path, st)) is not None:
            raise Rejected(f"{kind}_unreadable", f"{ref!r} is {what}, not a regular file", sid)
        if st.st_size > self.max_bytes:
            raise Rejected(
                f"{kind}_size_refused",
                f"{ref!r}: {st.st_size:,} bytes, over prepare.max_media_bytes {self.max_bytes:,}",
                sid,
            )
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
            with open(fd, "rb") as f:
                st = os.fstat(f.fileno())
                if not stat.S_ISREG(st.st_mode):
                    raise Rejected(f"{kind}_unreadable", f"{ref!r} is not a regular file", sid)
                data = f.read()
        except OSError as exc:
            raise Rejected(f"{kind}_unreadable", _os_problem(exc, ref, st), sid) from None
        if len(data) > self.max_bytes:  # it grew after the stat
            raise Rejected(
                f"{kind}_size_refused",
                f"{ref!r}: {len(data):,} bytes, over prepare.max_media_bytes {self.max_bytes:,}",
                sid,
            )
        return data


@dataclass
class InlineMedia(MediaSource):
    """Media carried inside the sample itself (an Energon dataset's parts): a row's
    references are indices into ``images`` / ``videos``, each ``(bytes, file suffix)``."""

    images: list[tuple[bytes, str]] = field(default_factory=list)
    videos: list[tuple[bytes, str]] = field(default_factory=list)

    def read(self, ref: Any, sid: str, kind: str) -> tuple[bytes, str]:
        items = self.images if kind == "image" else self.videos
        if isinstance(ref, bool) or not isinstance(ref, int) or not 0 <= ref < len(items):
            raise Rejected(f"missing_{kind}", f"the sample holds no {kind} {ref!r}", sid)
        return items[ref]


def _load_image(media: MediaSource, ref: Any, sid: str, geometry: ImageGeometry) -> ImageRef:
    data, _ = media.read(ref, sid, "image")
    rel = media.name(ref)
    try:
        width, height = read_image_size(data)
        ext, orientation = _decode_fully(data)
    except ValueError as exc:
        raise Rejected("image_unreadable", f"{rel!r}: {exc}", sid) from None
    try:
        geometry.resized(height, width)
    except ValueError as exc:
        raise Rejected("image_size_refused", f"{rel!r} ({width}x{height}): {exc}", sid) from None
    return ImageRef(
        path=str(rel), data=data, ext=ext, width=width, height=height, orientation=orientation
    )


def _load_video(media: MediaSource, ref: Any, sid: str, limits: VideoLimits) -> VideoRef:
    """Decode the whole video once and check it against the processor and the limits."""
    data, suffix = media.read(ref, sid, "video")
    rel = media.name(ref)
    try:
        header = probe_video(data)
    except VideoError as exc:
        raise Rejected("video_unreadable", f"{rel!r}: {exc}", sid) from None
    frames = f"{header.num_frames} frame" + ("s" if header.num_frames != 1 else "")
    clip = f"{rel!r} ({frames} at {header.fps:g} fps, {header.width}x{header.height})"
    if header.duration > limits.max_video_seconds:
        raise Rejected(
            "video_too_long",
            f"{clip} lasts {header.duration:.1f} s, prepare.max_video_seconds is "
            f"{limits.max_video_seconds:g}",
            sid,
        )
    geometry = limits.geometry
    sampled = geometry.num_sampled(header.num_frames, header.fps)
    if sampled < geometry.temporal_patch_size:
        raise Rejected(
            "video_too_short",
            f"{clip}: the video processor samples {sampled} frame(s), it needs at least "
            f"{geometry.temporal_patch_size} (temporal_patch_size)",
            sid,
        )
    try:
        geometry.resized(sampled, header.height, header.width)
    except ValueError as exc:
        raise Rejected("video_size_refused", f"{clip}: {exc}", sid) from None
    if sampled > limits.max_frames_per_video:
        raise Rejected(
            "too_many_frames",
            f"{clip}: the video processor samples {sampled} frames (at {geometry.fps:g} fps), "
            f"prepare.max_frames_per_video is {limits.max_frames_per_video}",
            sid,
        )
    ext = suffix if VIDEO_EXT_RE.match(suffix) else "video"
    return VideoRef(path=str(rel), data=data, ext=ext, header=header)


#: The EXIF tag of an image's orientation (1: as stored).
EXIF_ORIENTATION = 0x0112


def _decode_fully(data: bytes) -> tuple[str, int]:
    """Decode every pixel once (a header can be fine while the pixels are truncated);
    returns the file extension to store the bytes under and the image's EXIF orientation
    (1 when it has none), read after the pixels so that no format decodes them twice (a
    PNG's ``getexif`` loads the image when its header holds no EXIF)."""
    try:
        with Image.open(io.BytesIO(data)) as img:
            fmt = (img.format or "png").lower()
            img.load()
            try:
                orientation = img.getexif().get(EXIF_ORIENTATION, 1)
            except Exception:  # damaged EXIF: the pixels are fine, and nothing turns them
                orientation = 1
    except Exception as exc:
        raise ValueError(f"cannot decode pixels: {exc}") from exc
    if not isinstance(orientation, int) or not 1 <= orientation <= 8:
        orientation = 1  # a tag out of range: no viewer turns the image either
    return {"jpeg": "jpg", "mpo": "jpg"}.get(fmt, fmt), orientation


def parse_row(
    line: str,
    folder: Path,
    *,
    geometry: ImageGeometry,
    max_images: int,
    val_fraction: float,
    videos: VideoLimits,
    max_text_chars: int,
) -> ConversationRow:
    """One jsonl line → :class:`ConversationRow`, or raise :class:`Rejected` with the reason;
    media paths are relative to ``folder``; see :func:`parse_record` for the rest."""
    try:
        row = json.loads(line)
    except json.JSONDecodeError as exc:
        raise Rejected("malformed_json", f"not JSON: {exc.msg} at column {exc.colno}") from None
    return parse_record(
        row,
        FolderMedia(folder),
        geometry=geometry,
        max_images=max_images,
        val_fraction=val_fraction,
        videos=videos,
        max_text_chars=max_text_chars,
    )


def llava_record(record: Any) -> Any:
    """A LLaVA-style record (``{"id", "image": "coco/1.jpg", "conversations": [{"from",
    "value"}]}``; ``images`` for several, ``video`` / ``videos`` likewise) in the row form
    :func:`parse_record` reads: the single ``image`` / ``video`` becomes a one-item list.
    Anything else (a record that is not an object, a non-string ``image``) is passed on for
    :func:`parse_record` to reject with its reason.

    >>> llava_record({"id": 7, "image": "a.jpg", "conversations": []})["images"]
    ['a.jpg']
    >>> llava_record({"id": 8, "conversations": []}).get("images") is None
    True
    """
    if not isinstance(record, dict):
        return record
    out = dict(record)
    for single, plural in (("image", "images"), ("video", "videos")):
        if single in out and plural not in out:
            value = out.pop(single)
            out[plural] = [value] if isinstance(value, str) else value
    return out


#: The keys a ``messages`` part names its file under, per media kind (HF's ``image`` /
#: ``video``, ``path``, ``url``; OpenAI's ``image_url.url``).
_PART_MEDIA = {"image": ("image", "path", "url"), "video": ("video", "path", "url")}


def _part_media(part: dict[str, Any], sid: str) -> tuple[str, Any] | None:
    """(kind, the path it names) of a ``messages`` content part, or None for a text part."""
    kind = part.get("type")
    if kind == "image_url":  # OpenAI: {"type": "image_url", "image_url": {"url": ...}}
        inner = part.get("image_url")
        url = inner.get("url") if isinstance(inner, dict) else inner
        kind, named = "image", [url]
    elif kind in _PART_MEDIA:
        named = [part[k] for k in _PART_MEDIA[kind] if k in part]
    else:
        return None
    if len(named) != 1 or not isinstance(named[0], str):
        raise Rejected("malformed", f"a {kind} part must name one file: {part!r}", sid)
    if re.match(r"^[a-z][a-z0-9+.-]*:", named[0]):  # http:, data:, file: ...
        raise Rejected(
            "malformed",
            f"{kind} {named[0][:60]!r}: only files in the data folder are read, no URLs",
            sid,
        )
    return kind, named[0]


def messages_record(row: Any) -> Any:
    """A record in the HF/OpenAI chat layout (``messages``, content parts that name their
    own media: ``{"type": "image", "image": PATH}``, ``"path"``/``"url"`` keys, OpenAI's
    ``{"type": "image_url", "image_url": {"url": PATH}}``, videos likewise) in the row form
    :func:`parse_record` reads: the media named, in order, become ``images`` / ``videos`` and
    each part a bare ``{"type": ...}`` that places it. Paths are relative to the data folder
    (no URL is fetched). Anything else is passed on unchanged.

    >>> r = messages_record({"id": 1, "messages": [
    ...     {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "a.png"}},
    ...                                  {"type": "text", "text": "What?"}]},
    ...     {"role": "assistant", "content": "A cat."}]})
    >>> r["images"], r["conversations"][0]["content"][0]
    (['a.png'], {'type': 'image'})
    """
    if not isinstance(row, dict) or "messages" not in row:
        return row
    sid = printable_id(row.get("id"))
    if "conversations" in row or "images" in row or "videos" in row:
        raise Rejected(
            "malformed",
            "a 'messages' row names its media in its parts: no 'conversations', 'images' "
            "or 'videos' beside it",
            sid,
        )
    messages = row["messages"]
    if not isinstance(messages, list):
        raise Rejected("malformed", "'messages' must be a list", sid)
    media: dict[str, list[str]] = {"image": [], "video": []}
    turns = []
    for turn in messages:
        if isinstance(turn, dict) and isinstance(turn.get("content"), list):
            parts = []
            for part in turn["content"]:
                found = _part_media(part, sid) if isinstance(part, dict) else None
                if found is None:
                    parts.append(part)
                    continue
                kind, path = found
                media[kind].append(path)
                parts.append({"type": kind})
            turn = {**turn, "content": parts}
        turns.append(turn)
    out = {k: v for k, v in row.items() if k != "messages"}
    return {**out, "conversations": turns, "images": media["image"], "videos": media["video"]}


def text_problem(row: dict[str, Any], max_chars: int) -> tuple[str, str] | None:
    """``(reason, detail)`` when a record's text is not UTF-8 — a lone surrogate in any of its
    strings, which is what an undecodable byte (read with ``surrogateescape``) or a
    ``\\ud800``-style JSON escape becomes — or when its conversation holds more than
    ``max_chars`` characters; None when neither. Checked before anything encodes, hashes or
    tokenizes the text.

        >>> text_problem({"id": "a", "conversations": [{"value": "hi"}]}, 10)
        >>> text_problem({"id": "a", "conversations": [{"value": "ok\\udcff"}]}, 10)
        ('text_not_utf8', 'conversations[0].value: the byte 0xff at character 3 is not UTF-8')
        >>> text_problem({"id": "a", "conversations": ["x" * 6, {"value": "y" * 5}]}, 10)[1]
        'the conversation holds 11 characters of text, prepare.max_text_chars is 10'
    """
    chars = 0
    stack: list[tuple[str, Any]] = [("", row)]
    while stack:
        where, value = stack.pop()
        if isinstance(value, dict):
            stack.extend((f"{where}.{k}".lstrip("."), v) for k, v in reversed(value.items()))
            strings = [str(k) for k in value]
        elif isinstance(value, list):
            stack.extend((f"{where}[{i}]", v) for i, v in reversed(list(enumerate(value))))
            continue
        elif isinstance(value, str):
            strings = [value]
            if where.startswith("conversations"):
                chars += len(value)
        else:
            continue
        for text in strings:
            if text.isascii():
                continue
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as exc:
                code = ord(text[exc.start])
                what = (
                    f"the byte {code - 0xDC00:#04x}"
                    if 0xDC80 <= code <= 0xDCFF
                    else f"a lone surrogate U+{code:04X}"
                )
                where = where or "a field name"
                return "text_not_utf8", f"{where}: {what} at character {exc.start + 1} is not UTF-8"
    if chars > max_chars:
        return (
            "text_too_long",
            f"the conversation holds {chars} characters of text, prepare.max_text_chars is "
            f"{max_chars}",
        )
    return None


def printable_id(raw_id: Any) -> str:
    """An id as a reject record names it: its text, a lone surrogate as its escape."""
    return str(raw_id).encode("utf-8", "backslashreplace").decode("utf-8")


def parse_record(
    row: Any,
    media: MediaSource,
    *,
    geometry: ImageGeometry,
    max_images: int,
    val_fraction: float,
    videos: VideoLimits,
    max_text_chars: int,
) -> ConversationRow:
    """One source record (a decoded jsonl line, a LLaVA JSON record, an Energon sample's
    conversation) → :class:`ConversationRow`, or raise :class:`Rejected` with the reason;
    its text first (:func:`text_problem`).
    ``media`` resolves the record's ``images`` / ``videos`` entries and says which placement
    rule applies, the row's key and whether its stored sample was readable
    (:class:`MediaSource`); ``videos`` holds the video processor and prepare's video limits.
    The conversation's structure is :func:`structure_conversation`'s."""
    if not isinstance(row, dict):
        raise Rejected("malformed_json", f"a row must be a JSON object, got {type(row).__name__}")
    if media.markers == "packline":
        row = messages_record(row)
    raw_id = row.get("id")
    if isinstance(raw_id, bool) or not isinstance(raw_id, (str, int)) or str(raw_id) == "":
        raise Rejected("malformed", f"'id' must be a non-empty string or integer, got {raw_id!r}")
    if (problem := text_problem(row, max_text_chars)) is not None:
        raise Rejected(*problem, printable_id(raw_id))
    sid = str(raw_id)
    split = row.get("split")
    if split is not None and split not in ("train", "val"):
        raise Rejected("malformed", f"'split' must be 'train' or 'val', got {split!r}", sid)
    meta = row.get("meta", {})
    if not isinstance(meta, dict):
        raise Rejected("malformed", "'meta' must be an object", sid)
    media.check(sid)
    turns = _turns(row.get("conversations"), sid, media.markers)
    images = row.get("images", [])
    if images is None:
        images = []
    if not isinstance(images, list):
        raise Rejected("malformed", "'images' must be a list of paths", sid)
    if len(images) > max_images:
        raise Rejected(
            "too_many_images", f"{len(images)} images, prepare.max_images is {max_images}", sid
        )
    video_paths = row.get("videos", [])
    if video_paths is None:
        video_paths = []
    if not isinstance(video_paths, list):
        raise Rejected("malformed", "'videos' must be a list of paths", sid)
    if len(video_paths) > videos.max_videos:
        raise Rejected(
            "too_many_videos",
            f"{len(video_paths)} videos, prepare.max_videos is {videos.max_videos}",
            sid,
        )
    counts = {"image": len(images), "video": len(video_paths)}
    conversation = _place_media(turns, counts, sid, media.markers)
    refs = [_load_image(media, rel, sid, geometry) for rel in images]
    video_refs = [_load_video(media, rel, sid, videos) for rel in video_paths]
    return ConversationRow(
        id=sid,
        key=media.key(sid),
        split=split if split is not None else split_for_id(sid, val_fraction),
        conversation=conversation,
        images=refs,
        videos=video_refs,
        meta=meta,
    )
