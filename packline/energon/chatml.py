"""An Energon dataset in Megatron-Bridge's ChatML layout, adopted in place.

``data.source`` may name a prepared WebDataset dir that Megatron-Bridge reads as it is
(Bridge's ``tutorials/data/energon/README.md``)::

    train-shard-000000.tar ...   WebDataset shards, indexed by ``energon prepare``
    .nv-meta/dataset.yaml        __module__: megatron.bridge.data.energon.task_encoder_utils
                                 __class__: ChatMLWebdataset
                                 field_map: {imgs: jpgs, conversation: conversation.json}
    .nv-meta/split.yaml          split_parts (train, val; brace patterns) and exclude
    .nv-meta/.info.json          each shard's sample count

prepare checks every sample and writes, in its own dir, never touching the source's files:
a split config (the source's ``split_parts`` and ``exclude`` plus every rejected sample as
``<shard>/<key>``), packline's dataset config over the same shards (a ``CrudeWebdataset``
whose subflavors route its samples to packline's cooker,
:func:`packline.energon.sample.cook_chatml`) and two ``MetadatasetV2`` views
naming the source dir: ``packline.yaml`` (packline's loaders) and ``bridge.yaml`` (the
source's own ``dataset.yaml`` with that split config: Bridge's ``dataset.path``). The
excluded samples never reach either loader (Energon's reader skips them by name).

What is read, per sample (Energon's grouping: consecutive tar members whose names share the
part before the first dot of the file name, :data:`split_name_re`; ``__key__`` is that base
name, a dir inside the tar included, and is the manifest's ``key``; the manifest's ``id`` is
``<shard>/<key>``, the name Energon's excludes use). Energon 7.4's prepare refuses a key
twice in a dataset; an index an older Energon wrote may hold one twice: in one shard both
copies are rejected here, in another shard the later copy is prepare's ``duplicate_id``.

- ``conversation`` (required): JSON, a list of turns or an object holding them under
  ``conversations``, ``messages`` or ``conversation`` (Bridge's order); turns
  ``role``/``content`` or ``from``/``value``, content a string with ``<image>`` / ``<video>``
  markers or a list of typed parts; placed under Bridge's rule
  (:func:`packline.conversations.structure_conversation`, ``rule="chatml"``);
- ``imgs``: one encoded image (``image.png``, ``image.jpg`` ...) or, for a ``.jpgs`` part,
  a pickled list of encoded images, read with a restricted unpickler that builds builtin
  containers and bytes only (Bridge's ``utils/safe_pickle.py`` allow-list; anything else is
  refused, never run); its images fill the image parts in order;
- ``videos``: a pickled list of videos, each a list of encoded frames (``.videos``,
  ``.mp4s``, ``.jpgs``, Bridge's ``videohandler``).

What is refused, and why:

- an entry that names a file outside the dataset dir, before any file of the dataset is read
  (``ValueError`` from :meth:`ChatMLDataset.open`, every such entry at once, one a line, each
  naming its file, the entry and the fix): each brace-expanded ``split_parts`` entry (every
  split part, ``test`` too), each ``exclude`` entry and each shard of ``.info.json``'s
  ``shard_counts`` is a relative path without ``..`` that resolves, links followed, inside
  the dir (an absolute name, ``../other/train-0.tar`` or a shard that is a symbolic link out
  of the dir would have packline read a file the user never pointed it at); a ``field_map``
  part is a plain part name (no ``/``, no ``..``: it names a tar member's suffix, never a
  file);
- a dataset in another layout (``ValueError`` from :meth:`ChatMLDataset.open`, saying what is
  supported): another sample type, a ``sample_loader`` / ``part_filter`` (code, not a layout),
  a field map with ``audio`` or ``tools`` (packline trains images and videos), with
  alternatives or nested access (``a,b``, ``json[x]``), a video part Bridge cannot decode; a
  split config without ``train``, a shard in two splits, a shard whose index is missing or
  stale (``energon prepare`` again);
- per sample, with a reason in ``rejects.jsonl``: every reason of
  :func:`packline.conversations.parse_record`, plus a part larger than
  :attr:`ChatMLDataset.max_part_bytes` (prepare's ``prepare.max_media_bytes``; the tar
  header's size decides, the part is never read, so one sample cannot make prepare hold
  gigabytes): ``text_too_long`` for the conversation part, ``image_size_refused`` for an
  ``imgs`` part, ``video_size_refused`` for a ``videos`` part; a conversation part that is
  missing (``malformed``, Bridge's loader fails on a sample without a part its field map
  names) or not JSON (``malformed_json``), an image part that does not unpickle to encoded images
  (``image_unreadable``), chat-template ``tools`` (``malformed``: packline does not render
  them), an image without a part or marker (``marker_count_mismatch``: Bridge would drop it
  unseen), a key other than letters, digits, ``_``, ``-`` and ``/`` between dir names
  (``malformed``), a key twice in one shard (``duplicate_id``: an exclude names both);
- videos as frame lists (``video_frames_unsupported``): packline's readers take a video
  file, whose frame rate and frame count decide the frames the processor samples and the
  timestamps between them; a list of frames has neither. A sample with an empty video list
  is read as without videos.

The ``test`` split part is not read (packline trains on ``train`` and evaluates on ``val``;
a dataset without ``val`` gives views with a ``train`` split only); samples the source's own
split config excludes are not read either, and stay excluded. Each shard is read twice: once
over its tar headers (to count keys against the index), once for the mapped parts.
"""

from __future__ import annotations

import io
import itertools
import json
import pickle
import re
import sqlite3
import tarfile
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import braceexpand
import yaml
from megatron.energon.flavors.webdataset.config import skip_meta_re, split_name_re

from packline.conversations import (
    InlineMedia,
    MarkerRule,
    Rejected,
    structure_conversation,
)
from packline.energon.files import BRIDGE_METADATASET, PACKLINE_METADATASET
from schemas.tables import KEY_PATTERN

#: Bridge's sample type, the only dataset config adopted.
CHATML_MODULE = "megatron.bridge.data.energon.task_encoder_utils"
CHATML_CLASS = "ChatMLWebdataset"
#: Field map entries read; Bridge's ``ChatMLSample`` also has ``audio`` and ``tools``.
FIELDS = ("conversation", "imgs", "videos")
#: Dataset config keys besides the class and field map that do not change what is read.
CONFIG_KEYS = ("field_map", "subflavors", "image_decode_spec")
#: Part extensions Bridge's ``videohandler`` unpickles (a list of images for ``jpgs``, a list
#: of frame lists otherwise).
PICKLED_LISTS = ("jpgs", "mp4s", "videos")
#: Split parts adopted; a ``test`` part is left alone.
SPLITS = ("train", "val")
#: The files prepare writes into its dir (see the module docstring).
SPLIT_CONFIG = "packline_split.yaml"
DATASET_CONFIG = "packline_dataset.yaml"
#: The subflavor that routes an adopted dataset's crude samples to their cooker
#: (:data:`packline.energon.sample.CHATML_COOKER`), and the one that carries its field map.
SOURCE_SUBFLAVOR = "packline_source"
FIELD_MAP_SUBFLAVOR = "packline_field_map"
#: :attr:`ChatMLDataset.max_part_bytes` unless given: ``prepare.max_media_bytes``' default.
DEFAULT_MAX_PART_BYTES = 1 << 30
#: The reason a sample is rejected with when a part of a field is over the size limit.
SIZE_REASONS = {
    "conversation": "text_too_long",
    "imgs": "image_size_refused",
    "videos": "video_size_refused",
}
_KEY_RE = re.compile(KEY_PATTERN)
#: Shard and exclude names (brace patterns expanded) an adopted dataset may list: checking
#: each one is cheap, but a pattern like ``{0..999999999}`` would take minutes and gigabytes.
MAX_ENTRIES = 1_000_000


@dataclass(frozen=True)
class ChatMLDataset:
    """An Energon dataset dir in Bridge's ChatML layout, as :meth:`open` read it."""

    root: Path
    #: ``conversation`` and, when mapped, ``imgs`` / ``videos`` → part name
    field_map: dict[str, str]
    #: the source dataset config's own subflavors
    subflavors: dict[str, Any]
    #: the source split config's ``split_parts``, as written (brace patterns kept)
    split_parts: dict[str, list[str]]
    #: the source split config's ``exclude`` entries, as written
    exclude: list[str]
    #: ``train`` / ``val`` → shard names (brace-expanded, excluded shards left out)
    splits: dict[str, list[str]]
    #: samples the source excludes, ``<shard>/<key>``
    sample_excludes: frozenset[str]
    #: shard name → samples in it, from ``.nv-meta/.info.json``
    shard_counts: dict[str, int]
    #: a sample part (tar member) larger than this is not read: the sample is rejected
    #: (:func:`shard_records`); prepare passes ``prepare.max_media_bytes``
    max_part_bytes: int = DEFAULT_MAX_PART_BYTES

    @classmethod
    def open(cls, root: Path, max_part_bytes: int = DEFAULT_MAX_PART_BYTES) -> ChatMLDataset:
        """Read ``root``'s Energon metadata; ``ValueError`` (what is wrong, what is supported)
        when it is not a prepared dataset in Bridge's ChatML layout, or when an entry of it
        names a file outside ``root`` (every such entry, one a line: :func:`_inside`).
        ``max_part_bytes``: see :attr:`max_part_bytes`."""
        from megatron.energon.epathlib import EPath
        from megatron.energon.flavors.webdataset.metadata import get_dataset_info

        root = Path(root).expanduser().resolve()
        meta = root / ".nv-meta"
        config_path = meta / "dataset.yaml"
        if not config_path.is_file():
            raise ValueError(f"{root} has no .nv-meta/dataset.yaml: not an Energon dataset")
        # the metadata itself first: a .nv-meta (or a file of it) linked out of the dir
        metadata = [".nv-meta", *(f".nv-meta/{p.name}" for p in sorted(meta.iterdir()))]
        linked = [p for name in metadata if (p := _inside(root, name, f"{root}:")) is not None]
        if linked:
            raise ValueError("\n".join(linked))
        config = yaml.safe_load(config_path.read_text())
        field_map, subflavors = _check_dataset_config(config, config_path)
        split_path, split_doc = _split_config(meta)
        split_parts = split_doc.get("split_parts")
        exclude = split_doc.get("exclude") or []
        if not isinstance(split_parts, dict) or not isinstance(exclude, list):
            raise ValueError(f"{meta}/split.yaml: split_parts must map names to shard lists")
        if "train" not in split_parts:
            raise ValueError(
                f"{meta}/split.yaml has no train split part (it has {sorted(split_parts)}); "
                "packline trains on 'train' and evaluates on 'val'"
            )
        excluded = {e for entry in exclude for e in braceexpand.braceexpand(str(entry))}
        try:
            counts = dict(get_dataset_info(EPath(root))["shard_counts"])
        except (ValueError, KeyError) as exc:
            raise ValueError(f"{root}: no readable .nv-meta/.info.json ({exc})") from None
        # Every entry that names a file is checked before any file of the dataset is read.
        info_path = meta / (".info.json" if (meta / ".info.json").is_file() else ".info.yaml")
        listed = sum(brace_size(str(p)) for ps in split_parts.values() for p in ps or [])
        listed += sum(brace_size(str(e)) for e in exclude) + len(counts)
        if listed > MAX_ENTRIES:  # a brace pattern of a billion names is not a dataset
            raise ValueError(
                f"{split_path} and {info_path} name {listed:,} shards and excludes (brace "
                f"patterns expanded), more than {MAX_ENTRIES:,}; fix: name the shards the "
                "dataset holds"
            )
        entries = itertools.chain(
            (
                (f"{split_path}: split_parts.{part} entry", name)
                for part, patterns in split_parts.items()
                for pattern in patterns or []
                for name in braceexpand.braceexpand(str(pattern))
            ),
            # ``<shard>`` or ``<shard>/<key>``: resolved whole, a link as the shard resolves
            (
                (f"{split_path}: exclude entry", name)
                for entry in exclude
                for name in braceexpand.braceexpand(str(entry))
            ),
            ((f"{info_path}: shard_counts entry", str(name)) for name in counts),
        )

        problems = [
            *_part_name_problems(field_map, config_path),
            *(p for where, name in entries if (p := _inside(root, name, where)) is not None),
        ]
        if problems:
            raise ValueError("\n".join(problems))
        splits: dict[str, list[str]] = {}
        owner: dict[str, str] = {}
        for split in SPLITS:
            names = [
                name
                for pattern in split_parts.get(split) or []
                for name in braceexpand.braceexpand(str(pattern))
                if name not in excluded
            ]
            for name in names:
                if name in owner:
                    raise ValueError(
                        f"{meta}/split.yaml lists shard {name} in both {owner[name]} and "
                        f"{split}: a sample belongs to one split"
                    )
                owner[name] = split
                if name not in counts:
                    raise ValueError(
                        f"shard {name} is not in {meta}/.info.json: the index is stale, "
                        f"run `energon prepare {root}` again"
                    )
                if not (root / name).is_file() or not (root / f"{name}.idx").is_file():
                    raise ValueError(
                        f"shard {name} or its index {name}.idx is missing in {root} "
                        f"(run `energon prepare {root}`)"
                    )
                problem = _inside(root, f"{name}.idx", f"{root}: the Energon index of shard")
                if problem is not None:
                    raise ValueError(problem)
            if names:
                splits[split] = names
        if "train" not in splits:
            raise ValueError(f"{meta}/split.yaml: the train split part holds no shard")
        return cls(
            root=root,
            field_map=field_map,
            subflavors=subflavors,
            split_parts={str(k): [str(p) for p in v or []] for k, v in split_parts.items()},
            exclude=[str(e) for e in exclude],
            splits=splits,
            sample_excludes=frozenset(e for e in excluded if "/" in e),
            shard_counts=counts,
            max_part_bytes=max_part_bytes,
        )

    def shards(self) -> list[tuple[str, str]]:
        """``(split, shard name)`` of every shard read, train then val, each in its split
        config's order."""
        return [(split, name) for split in SPLITS for name in self.splits.get(split, [])]

    def split_of(self, shard: str) -> str:
        for split, names in self.splits.items():
            if shard in names:
                return split
        raise KeyError(f"{shard} is in no adopted split of {self.root}")


def _check_dataset_config(config: Any, path: Path) -> tuple[dict[str, str], dict[str, Any]]:
    """The field map and subflavors of Bridge's ChatML dataset config, or ``ValueError``."""
    supported = (
        f"packline adopts Energon datasets in Megatron-Bridge's ChatML layout: __module__: "
        f"{CHATML_MODULE}, __class__: {CHATML_CLASS}, a field_map of conversation, imgs and "
        "videos to part names (e.g. {imgs: jpgs, conversation: conversation.json})"
    )
    if not isinstance(config, dict):
        raise ValueError(f"{path} is not a YAML mapping; {supported}")
    if "sample_type" in config and "__class__" not in config:
        kind = config["sample_type"]
        raise ValueError(f"{path} declares sample_type {kind}; {supported}")
    if (config.get("__module__"), config.get("__class__")) != (CHATML_MODULE, CHATML_CLASS):
        kind = f"{config.get('__module__')}.{config.get('__class__')}"
        raise ValueError(f"{path} declares {kind}; {supported}")
    if "sample_loader" in config or "part_filter" in config:
        raise ValueError(
            f"{path} reads its samples with a sample_loader (code packline does not run); "
            f"{supported}"
        )
    unknown = sorted(set(config) - {"__module__", "__class__", *CONFIG_KEYS})
    if unknown:
        raise ValueError(f"{path}: packline does not read {unknown}; {supported}")
    field_map = config.get("field_map")
    if not isinstance(field_map, dict) or "conversation" not in field_map:
        raise ValueError(f"{path} has no field_map with a conversation part; {supported}")
    extra = sorted(set(field_map) - set(FIELDS))
    if extra:
        raise ValueError(
            f"{path} maps {extra}: packline trains on conversations with images and videos "
            f"only; {supported}"
        )
    for name, part in field_map.items():
        if not isinstance(part, str) or not part or any(c in part for c in ",[]"):
            raise ValueError(
                f"{path}: field_map {name}: {part!r} is not one part name (alternatives and "
                f"nested access are not read); {supported}"
            )
    if _ext(field_map.get("imgs", "")) in ("mp4s", "videos"):
        raise ValueError(f"{path}: imgs: {field_map['imgs']} holds videos, not images")
    if "videos" in field_map and _ext(field_map["videos"]) not in PICKLED_LISTS:
        raise ValueError(
            f"{path}: videos: {field_map['videos']}: Bridge's ChatMLWebdataset decodes videos "
            f"only from pickled frame lists ({', '.join('.' + e for e in PICKLED_LISTS)})"
        )
    subflavors = config.get("subflavors") or {}
    if not isinstance(subflavors, dict):
        raise ValueError(f"{path}: subflavors must be a mapping")
    return {k: str(v) for k, v in field_map.items()}, subflavors


def _groups(pattern: str) -> list[str]:
    """The top-level ``{...}`` groups of a brace pattern (``\\`` escapes a brace)."""
    groups, depth, start, escaped = [], 0, 0, False
    for i, c in enumerate(pattern):
        if escaped:
            escaped = False
        elif c == "\\":
            escaped = True
        elif c == "{":
            depth += 1
            if depth == 1:
                start = i + 1
        elif c == "}" and depth:
            depth -= 1
            if depth == 0:
                groups.append(pattern[start:i])
    return groups


def _top_level_split(expr: str) -> list[str]:
    parts, depth, start, escaped = [], 0, 0, False
    for i, c in enumerate(expr):
        if escaped:
            escaped = False
        elif c == "\\":
            escaped = True
        elif c == "{":
            depth += 1
        elif c == "}" and depth:
            depth -= 1
        elif c == "," and depth == 0:
            parts.append(expr[start:i])
            start = i + 1
    return [*parts, expr[start:]]


def brace_size(pattern: str) -> int:
    """How many names ``braceexpand`` makes of ``pattern``, counted without making them
    (it builds each range whole before the first name: ``{0..999999999}`` takes gigabytes).

    >>> brace_size("train-{0..9}.tar"), brace_size("a{1,2}{x,y{3..5}}"), brace_size("x")
    (10, 8, 1)
    """
    total = 1
    for expr in _groups(pattern):
        if m := braceexpand.int_range_re.match(expr):
            first, last, step = int(m.group(1)), int(m.group(2)), int(m.group(3) or 1)
            total *= abs(last - first) // max(step, 1) + 1
        elif m := braceexpand.char_range_re.match(expr):
            first, last, step = ord(m.group(1)), ord(m.group(2)), int(m.group(3) or 1)
            total *= abs(last - first) // max(step, 1) + 1
        elif len(parts := _top_level_split(expr)) > 1:
            total *= sum(brace_size(p) for p in parts)
    return total


def _split_config(meta: Path) -> tuple[Path, dict[str, Any]]:
    """The source's split config and its file: ``split.yaml``, else ``split.json`` (Energon's
    order)."""
    for name in ("split.yaml", "split.json"):
        if (meta / name).is_file():
            doc = yaml.safe_load((meta / name).read_text())  # JSON is YAML
            if not isinstance(doc, dict):
                raise ValueError(f"{meta / name} is not a mapping")
            return meta / name, doc
    raise ValueError(f"{meta} has no split.yaml: run `energon prepare` on the dataset")


def _inside(root: Path, name: str, where: str) -> str | None:
    """The problem with ``name``, a file of the dataset at ``root`` (resolved) named at
    ``where`` (a file and the entry's place in it), or None: a dataset's entries are
    relative paths with no ``..`` that resolve, links followed, inside ``root``. The same
    rule as a folder source's media paths (:func:`packline.conversations._media_path`).

    >>> root, where = Path("/data/ds"), "split.yaml: split_parts.train entry"
    >>> print(_inside(root, "../b/t.tar", where).split(";")[0])
    split.yaml: split_parts.train entry '../b/t.tar' escapes the dataset dir /data/ds
    >>> print(_inside(root, "/etc/t.tar", where).split(";")[0])
    split.yaml: split_parts.train entry '/etc/t.tar' is an absolute path
    >>> print(_inside(root, "a/../t.tar", where).split(";")[0])
    split.yaml: split_parts.train entry 'a/../t.tar' has a '..' component
    >>> _inside(root, "shards/t.tar", where) is None
    True
    """
    fix = (
        "fix: name shards relative to the dataset dir, inside it (run energon prepare on the "
        "dataset where its shards are)"
    )
    path = Path(name)
    if path.is_absolute():
        return f"{where} {name!r} is an absolute path; {fix}"
    try:
        resolved = (root / path).resolve()
    except (OSError, RuntimeError) as exc:  # a link loop
        return f"{where} {name!r} cannot be resolved ({exc}); {fix}"
    if not resolved.is_relative_to(root):
        if ".." in path.parts:
            return f"{where} {name!r} escapes the dataset dir {root}; {fix}"
        return (
            f"{where} {name!r} escapes the dataset dir {root} (a symbolic link to {resolved}); "
            "fix: copy the file into the dataset dir in place of the link"
        )
    if ".." in path.parts:
        return f"{where} {name!r} has a '..' component; {fix}"
    return None


def _part_name_problems(field_map: dict[str, str], path: Path) -> list[str]:
    """Each field map entry that is not a plain part name: a part names the suffix of tar
    members after their key, never a file, so it holds no ``/`` and no ``..``."""
    return [
        f"{path}: field_map {field}: {part!r} is a path, not a part name (the suffix of a tar "
        "member after its key, e.g. jpgs or conversation.json); fix: name the part only"
        for field, part in field_map.items()
        if "/" in part or ".." in part
    ]


def _ext(part: str) -> str:
    """A part name's extension, as webdataset's decoders match it (after the last dot)."""
    return part.rsplit(".", 1)[-1].lower()


# --- reading a sample's parts -------------------------------------------------------------------


class _SafeUnpickler(pickle.Unpickler):
    """Builds builtin containers, bytes, strings and numbers only: the allow-list of Bridge's
    ``_RestrictedUnpickler`` (``utils/safe_pickle.py``). Any other global is refused before
    anything of it runs."""

    ALLOWED: ClassVar[dict[str, frozenset[str]]] = {
        "builtins": frozenset(
            "list dict tuple set frozenset bytes bytearray str int float bool complex slice "
            "range NoneType".split()
        ),
        "collections": frozenset({"OrderedDict"}),
    }

    def find_class(self, module: str, name: str) -> Any:
        if name in self.ALLOWED.get(module, ()):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refused to load {module}.{name}: builtin types only")


def safe_unpickle(data: bytes) -> Any:
    """Unpickle ``data`` with builtin types only (see :class:`_SafeUnpickler`).

    >>> safe_unpickle(pickle.dumps([b"x", {"a": 1}]))
    [b'x', {'a': 1}]
    >>> import datetime
    >>> safe_unpickle(pickle.dumps(datetime.date(2020, 1, 1)))
    Traceback (most recent call last):
    ...
    _pickle.UnpicklingError: refused to load datetime.date: builtin types only
    """
    return _SafeUnpickler(io.BytesIO(data)).load()


@dataclass
class SampleRead:
    """What one sample's parts hold, or the first thing about them that could not be read."""

    #: the conversation's turns (unchecked; ``None`` when unreadable)
    turns: Any
    #: each image's encoded bytes and file suffix, in order
    images: list[tuple[bytes, str]]
    #: ``(reason, detail)`` of the first part that could not be read, None when all could
    problem: tuple[str, str] | None = None


def _encoded_list(data: bytes, part: str, what: str) -> list[bytes]:
    value = safe_unpickle(data)
    if not isinstance(value, list) or not all(isinstance(v, (bytes, bytearray)) for v in value):
        raise ValueError(f"part {part!r} is not a pickled list of encoded {what}")
    return [bytes(v) for v in value]


def read_sample(parts: dict[str, Any], field_map: dict[str, str]) -> SampleRead:
    """A sample's parts (part name → bytes) read through ``field_map`` (see the module
    docstring). Nothing is decoded beyond JSON and the pickled lists: images are checked
    by :func:`packline.conversations.parse_record`."""
    name = field_map["conversation"]
    if name not in parts:
        reason = f"the sample has no {name!r} part (field_map conversation)"
        return SampleRead(None, [], ("malformed", reason))
    try:
        # As Bridge reads it (json.loads of the bytes): a BOM is skipped, an encoded lone
        # surrogate decodes to one (which parse_record rejects as text_not_utf8).
        payload = json.loads(bytes(parts[name]))
    except UnicodeDecodeError as exc:
        detail = f"part {name!r}: byte {exc.object[exc.start]:#04x} at {exc.start} is not UTF-8"
        return SampleRead(None, [], ("text_not_utf8", detail))
    except json.JSONDecodeError as exc:
        return SampleRead(None, [], ("malformed_json", f"part {name!r} is not JSON: {exc}"))
    turns = payload
    if isinstance(payload, dict):
        if payload.get("tools") is not None:
            detail = "the conversation carries chat-template tools, which packline does not render"
            return SampleRead(None, [], ("malformed", detail))
        turns = payload.get("conversations", payload.get("messages", payload.get("conversation")))
    images: list[tuple[bytes, str]] = []
    if "imgs" in field_map:
        name = field_map["imgs"]
        if name not in parts:
            detail = f"the sample has no {name!r} part (field_map imgs): Bridge fails on it"
            return SampleRead(turns, [], ("malformed", detail))
        if _ext(name) == "jpgs":
            try:
                images = [(b, "jpg") for b in _encoded_list(parts[name], name, "images")]
            except Exception as exc:
                return SampleRead(turns, [], ("image_unreadable", f"part {name!r}: {exc}"))
        else:
            images = [(bytes(parts[name]), _ext(name))]
    if "videos" in field_map:
        name = field_map["videos"]
        if name not in parts:
            detail = f"the sample has no {name!r} part (field_map videos): Bridge fails on it"
            return SampleRead(turns, images, ("malformed", detail))
        try:
            videos = safe_unpickle(parts[name])
            if not isinstance(videos, list):
                raise ValueError("not a list")
        except Exception as exc:
            detail = f"part {name!r} is not a pickled list of videos: {exc}"
            return SampleRead(turns, images, ("video_unreadable", detail))
        if videos:
            detail = (
                f"{len(videos)} video(s) as lists of frames in part {name!r}: packline reads a "
                "video as a file, whose frame rate and count decide the frames the processor "
                "samples; a list of frames has neither"
            )
            return SampleRead(turns, images, ("video_frames_unsupported", detail))
    return SampleRead(turns, images)


@dataclass
class ChatMLParts(InlineMedia):
    """The media of one stored sample of an adopted dataset, with its Energon key and the
    first part that could not be read; its rows are placed under Bridge's ChatML rule."""

    sample_key: str = ""
    problem: tuple[str, str] | None = None
    markers: ClassVar[MarkerRule] = "chatml"

    def check(self, sid: str) -> None:
        if self.problem is not None:
            raise Rejected(*self.problem, sid)

    def key(self, sid: str) -> str:
        return self.sample_key


# --- one shard ----------------------------------------------------------------------------------


def _members(tar: tarfile.TarFile) -> Iterator[tuple[tarfile.TarInfo, str, str]]:
    """``(member, sample key, part name)`` of the shard's sample files, as Energon's prepare
    and reader take them (``skip_meta_re``, ``split_name_re``)."""
    for member in tar:
        if not member.isreg() or skip_meta_re.match(member.name):
            continue
        m = split_name_re.match(member.name)
        if m is not None:
            yield member, m.group(1), m.group(2)


def _samples(
    path: Path, wanted: set[str] | None, max_bytes: int = DEFAULT_MAX_PART_BYTES
) -> Iterator[tuple[str, dict[str, bytes], dict[str, int]]]:
    """``(key, parts, oversize)`` of each sample in tar order: consecutive members sharing a
    key, as Energon groups them; only the ``wanted`` parts are read (None: no part is), and
    of those only the ones of at most ``max_bytes`` (the tar header's size, before a byte is
    read): ``oversize`` holds the size of each one left unread."""
    key: str | None = None
    parts: dict[str, bytes] = {}
    oversize: dict[str, int] = {}
    with tarfile.open(path, "r:*") as tar:
        for member, base, part in _members(tar):
            if base != key:
                if key is not None:
                    yield key, parts, oversize
                key, parts, oversize = base, {}, {}
            if wanted is not None and part in wanted:
                if member.size > max_bytes:
                    oversize[part] = member.size
                    continue
                f = tar.extractfile(member)
                parts[part] = f.read() if f is not None else b""
    if key is not None:
        yield key, parts, oversize


class ShardUnreadable(Exception):
    """A shard of an adopted dataset that cannot be read as a tar (truncated, a corrupt
    header, unreadable): its samples are rejected as ``shard_unreadable`` and the shard is
    left out; the file is never touched."""

    def __init__(self, ds: ChatMLDataset, shard: str, error: BaseException | str):
        self.shard = shard
        why = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
        self.detail = (
            f"shard {shard} cannot be read ({why}); fix: restore it "
            f"(or write it again and run `energon prepare {ds.root}`), or remove it from "
            ".nv-meta/split.yaml"
        )
        super().__init__(self.detail)


def _index_query(ds: ChatMLDataset, shard: str, sql: str) -> list[tuple]:
    """The rows of ``sql`` (with one ``?``: the shard's ``tar_file_id``, its place in
    ``.info.json``'s ``shard_counts``) over Energon's ``.nv-meta/index.sqlite``, opened
    read-only; empty when the dataset has no such index."""
    index = ds.root / ".nv-meta" / "index.sqlite"
    if not index.is_file():
        return []
    tar_file_id = list(ds.shard_counts).index(shard)
    db = sqlite3.connect(f"{index.as_uri()}?mode=ro", uri=True)
    try:
        return db.execute(sql, (tar_file_id,)).fetchall()
    finally:
        db.close()


def _indexed_end(ds: ChatMLDataset, shard: str) -> int | None:
    """The byte where the shard's last indexed sample ends (None without an index)."""
    rows = _index_query(
        ds, shard, "SELECT MAX(byte_offset + byte_size) FROM samples WHERE tar_file_id = ?"
    )
    return rows[0][0] if rows and rows[0][0] is not None else None


def indexed_keys(ds: ChatMLDataset, shard: str) -> list[str]:
    """The sample keys Energon's index holds for ``shard``, in tar order, but those the
    source excludes: what the shard held when it was prepared, read from
    ``.nv-meta/index.sqlite`` (read-only). Without that index (an older Energon's), the
    samples ``.info.json`` counts, as ``#1``, ``#2``, ..."""
    rows = _index_query(
        ds, shard, "SELECT sample_key FROM samples WHERE tar_file_id = ? ORDER BY sample_index"
    )
    if not rows:
        return [f"#{n}" for n in range(1, ds.shard_counts[shard] + 1)]
    return [key for (key,) in rows if f"{shard}/{key}" not in ds.sample_excludes]


def shard_records(ds: ChatMLDataset, shard: str) -> Iterator[tuple[str, Any, InlineMedia]]:
    """Every sample of ``shard`` in tar order (but those the source's split config excludes)
    as ``(key, record, media)``: ``key`` Energon's ``__key__``, ``record`` the row form
    :func:`packline.conversations.parse_record` reads (``{"id": "<shard>/<key>", "split",
    "conversations", "images": [0, ...], "videos": []}``) and ``media`` its
    :class:`ChatMLParts`. A sample whose parts cannot be read comes out too, as a record
    ``parse_record`` rejects with the reason (see the module docstring), and so does a sample
    with a mapped part over ``ds.max_part_bytes``, which is never read (the tar header's
    size decides); a shard that cannot be read as a tar raises :class:`ShardUnreadable`."""
    split = ds.split_of(shard)
    path = ds.root / shard
    try:
        keys = Counter(key for key, _, _ in _samples(path, None))
    except (tarfile.TarError, EOFError, OSError) as exc:
        raise ShardUnreadable(ds, shard, exc) from exc
    found = sum(keys.values())
    if found < ds.shard_counts[shard] and (end := _indexed_end(ds, shard)) is not None:
        size = path.stat().st_size
        if size < end:
            raise ShardUnreadable(
                ds, shard, f"truncated: {size} bytes, its index places samples up to byte {end}"
            )
    if found != ds.shard_counts[shard]:
        raise ValueError(
            f"{path} holds {sum(keys.values())} samples, its Energon index says "
            f"{ds.shard_counts[shard]}: the shard changed since it was prepared, run "
            f"`energon prepare {ds.root}` again"
        )
    wanted = set(ds.field_map.values())
    try:
        samples = _samples(path, wanted, ds.max_part_bytes)
        yield from _shard_samples(ds, shard, split, keys, samples)
    except (tarfile.TarError, EOFError, OSError) as exc:
        raise ShardUnreadable(ds, shard, exc) from exc


def _shard_samples(
    ds: ChatMLDataset,
    shard: str,
    split: str,
    keys: Counter,
    samples: Iterator[tuple[str, dict[str, bytes], dict[str, int]]],
) -> Iterator[tuple[str, Any, InlineMedia]]:
    for key, parts, oversize in samples:
        sid = f"{shard}/{key}"
        if sid in ds.sample_excludes:
            continue
        read = (
            SampleRead(None, [], _size_problem(ds, sid, oversize))
            if oversize
            else read_sample(parts, ds.field_map)
        )
        problem = read.problem
        if keys[key] > 1:
            problem = (
                "duplicate_id",
                f"key {key!r} names {keys[key]} samples in {shard}: an exclude names them all",
            )
        elif not _KEY_RE.match(key):
            problem = (
                "malformed",
                f"key {key!r}: packline keys are letters, digits, '_' and '-', with '/' "
                "between dir names",
            )
        record = {
            "id": sid,
            "split": split,
            "conversations": read.turns,
            "images": list(range(len(read.images))),
            "videos": [],
        }
        yield key, record, ChatMLParts(images=read.images, sample_key=key, problem=problem)


def _size_problem(ds: ChatMLDataset, sid: str, oversize: dict[str, int]) -> tuple[str, str]:
    """The rejection of sample ``sid`` for its first part over ``ds.max_part_bytes`` (in
    field order: conversation, imgs, videos; :data:`SIZE_REASONS`)."""
    field = next(f for f in FIELDS if ds.field_map.get(f) in oversize)
    part = ds.field_map[field]
    detail = (
        f"part {part!r} of {sid}: {oversize[part]:,} bytes, over prepare.max_media_bytes "
        f"{ds.max_part_bytes:,}"
    )
    return SIZE_REASONS[field], detail


# --- the files prepare writes -------------------------------------------------------------------


def _brace_escaped(name: str) -> str:
    """``name`` as an exclude entry: Energon brace-expands each one.

    >>> list(braceexpand.braceexpand(_brace_escaped("a{1,2}\\\\b")))
    ['a{1,2}\\\\b']
    """
    return re.sub(r"([\\{}])", r"\\\1", name)


def write_adoption(out: Path, final: Path, ds: ChatMLDataset, excluded: list[str]) -> None:
    """Write into ``out`` (prepare's build dir, published as ``final``) the split config
    (the source's split parts and excludes plus ``excluded``: the ids ``<shard>/<key>`` of
    the rejected samples), packline's dataset config, ``packline.yaml`` and ``bridge.yaml``,
    which name ``final`` and the source dir by absolute paths."""
    out, final = Path(out), Path(final).resolve()
    split = {
        "split_parts": ds.split_parts,
        "exclude": [*ds.exclude, *sorted({_brace_escaped(e) for e in excluded})],
    }
    (out / SPLIT_CONFIG).write_text(yaml.safe_dump(split, sort_keys=False))
    dataset = {
        "__module__": "megatron.energon",
        "__class__": "CrudeWebdataset",
        "subflavors": {
            **ds.subflavors,
            SOURCE_SUBFLAVOR: "chatml",
            FIELD_MAP_SUBFLAVOR: dict(ds.field_map),
        },
        "part_filter": sorted(set(ds.field_map.values())),
    }
    (out / DATASET_CONFIG).write_text(yaml.safe_dump(dataset, sort_keys=False))
    for name, config in (
        (PACKLINE_METADATASET, str(final / DATASET_CONFIG)),
        (BRIDGE_METADATASET, "dataset.yaml"),
    ):
        metadataset = {
            "__module__": "megatron.energon",
            "__class__": "MetadatasetV2",
            "splits": {
                s: {
                    "path": str(ds.root),
                    "dataset_config": config,
                    "split_config": str(final / SPLIT_CONFIG),
                }
                for s in ds.splits
            },
        }
        (out / name).write_text(yaml.safe_dump(metadataset, sort_keys=False))


# --- at load time -------------------------------------------------------------------------------


def chatml_conversation(raw: dict[str, Any]) -> tuple[str, list[dict[str, Any]], list[bytes]]:
    """``(id, conversation, images)`` of a crude sample of an adopted dataset (the parts of
    :data:`SOURCE_SUBFLAVOR` ``chatml``, its field map in :data:`FIELD_MAP_SUBFLAVOR`): the
    conversation structured as prepare's ``parse_record`` did
    (:func:`~packline.conversations.structure_conversation`, Bridge's rule), the images'
    encoded bytes in order. Media are not checked again: prepare did, and excluded every
    sample it rejected. The cooker (:func:`packline.energon.sample.cook_chatml`) builds the
    sample from these."""
    field_map = raw["__subflavors__"][FIELD_MAP_SUBFLAVOR]
    shard = raw["__sources__"][0].shard_name
    sid = f"{shard}/{raw['__key__']}"
    read = read_sample(raw, field_map)
    if read.problem is not None:
        reason, detail = read.problem
        raise ValueError(f"{sid}: {reason}: {detail} (prepare should have excluded it)")
    conversation = structure_conversation(
        read.turns, num_images=len(read.images), num_videos=0, sid=sid, rule="chatml"
    )
    return sid, conversation, [data for data, _ in read.images]
