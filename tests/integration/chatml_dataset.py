"""An Energon dataset in Megatron-Bridge's ChatML layout, written in a tmp dir as a user would:
WebDataset shards (webdataset's ``TarWriter``) indexed by Energon's own prepare, and Bridge's
``.nv-meta/dataset.yaml`` (``ChatMLWebdataset`` with a ``field_map``), as Bridge's
``tutorials/data/energon/README.md`` lays it out.

:func:`write_chatml_dataset` writes the standard set (``field_map``: ``imgs: jpgs``,
``videos: videos``, ``conversation: conversation.json``): two train shards and one val shard
holding good samples of every accepted form (one image, several images, text only, typed
content parts, ``from``/``value`` turns, a wrapped ``{"conversations": ...}`` document, a
JPEG) and one bad sample of each kind, with the reason prepare must give it
(:attr:`ChatMLSet.bad`).
"""

from __future__ import annotations

import io
import json
import pickle
from dataclasses import dataclass, field
from datetime import date
from pathlib import Path
from typing import Any

import webdataset as wds
import yaml
from PIL import Image

from packline.conversations import ConversationRow, Rejected
from packline.energon.chatml import ChatMLDataset, shard_records, write_adoption
from schemas.config import PipelineConfig
from tests.conftest import png_bytes

#: Bridge's sample type, as its tutorial's dataset.yaml declares it.
BRIDGE_CLASS = {
    "__module__": "megatron.bridge.data.energon.task_encoder_utils",
    "__class__": "ChatMLWebdataset",
}
STANDARD_FIELDS = {"imgs": "jpgs", "videos": "videos", "conversation": "conversation.json"}


@dataclass
class ChatMLSet:
    """What was written: the dataset dir, each shard's keys, and what prepare must make of
    each sample."""

    root: Path
    #: shard name → its sample keys, in tar order
    shards: dict[str, list[str]]
    #: key → split of each good sample
    good: dict[str, str] = field(default_factory=dict)
    #: key → the reason prepare must reject the sample with
    bad: dict[str, str] = field(default_factory=dict)
    #: key → the encoded bytes of each image of a good sample, in order
    images: dict[str, list[bytes]] = field(default_factory=dict)

    @property
    def shard_files(self) -> list[Path]:
        return [self.root / name for name in self.shards]


def jpeg_bytes(size: tuple[int, int], colour: str) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, colour).save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def user(content: Any) -> dict:
    return {"role": "user", "content": content}


def reply(text: str) -> dict:
    return {"role": "assistant", "content": text}


def _sample(key: str, conversation: Any, images: list[bytes] = (), **parts: bytes) -> dict:
    entry: dict[str, Any] = {
        "__key__": key,
        "conversation.json": conversation
        if isinstance(conversation, bytes)
        else json.dumps(conversation).encode(),
        "jpgs": pickle.dumps(list(images)),
        "videos": pickle.dumps([]),
    }
    entry.update(parts)
    return entry


def _standard_samples() -> tuple[dict[str, list[dict]], ChatMLSet]:
    red, blue = png_bytes((64, 48), "red"), png_bytes((48, 64), "blue")
    green, pink = png_bytes((56, 56), "green"), jpeg_bytes((72, 40), "pink")
    good = {
        "one-image": ([red], [user("<image>\nWhat colour is the disc?"), reply("Red.")]),
        "typed-parts": (
            [blue],
            [
                user([{"type": "image"}, {"type": "text", "text": "Describe it."}]),
                reply("A blue disc on grey."),
            ],
        ),
        "two-images": (
            [red, blue],
            [user("Image 1: <image> Image 2: <image> Which is taller?"), reply("Image 2.")],
        ),
        "text-only": ([], [user("How many sides has a square?"), reply("Four.")]),
        "from-value": (
            [green],
            [
                {"from": "human", "value": "<image>\nWhat colour?"},
                {"from": "gpt", "value": "Green."},
            ],
        ),
        "system": (
            [],
            [{"role": "system", "content": "Be brief."}, user("Hi"), reply("Hello.")],
        ),
        "two-turns": (
            [red, green],
            [
                user("Look at <image> first."),
                reply("A red disc."),
                user([{"type": "text", "text": "And now "}, {"type": "image"}]),
                reply("A green one."),
            ],
        ),
        "wrapped": (
            [blue],
            {"conversations": [user("<image> Which colour?"), reply("Blue.")]},
        ),
        "jpeg": ([pink], [user("What colour is this? <image>"), reply("Pink.")]),
        "three-images": (
            [red, green, blue],
            [
                user(
                    [
                        {"type": "image"},
                        {"type": "image"},
                        {"type": "image"},
                        {"type": "text", "text": "Order the colours."},
                    ]
                ),
                reply("Red, green, blue."),
            ],
        ),
        "llava-text": (
            [],
            [{"from": "human", "value": "Say yes."}, {"from": "gpt", "value": "Yes."}],
        ),
        "val-image": ([green], [user("<image>Colour?"), reply("Green.")]),
        "val-text": ([], [user("Two plus two?"), reply("Four.")]),
        "val-typed": (
            [pink],
            [user([{"type": "text", "text": "What is "}, {"type": "image"}]), reply("Pink.")],
        ),
    }
    chat = [user("<image>What is it?"), reply("A disc.")]
    bad = {
        "bad-image-bytes": ("image_unreadable", _sample("bad-image-bytes", chat, [b"not a png"])),
        "no-assistant": (
            "no_assistant_turn",
            _sample("no-assistant", [user("<image> Anything?")], [red]),
        ),
        "marker-mismatch": (
            "marker_count_mismatch",
            _sample("marker-mismatch", [user("<image> and <image>?"), reply("One.")], [red]),
        ),
        "unmarked-image": (
            # Bridge fills images only where an image part or <image> marker stands
            "marker_count_mismatch",
            _sample("unmarked-image", [user("What is it?"), reply("A disc.")], [red]),
        ),
        "unknown-role": (
            "unknown_role",
            _sample("unknown-role", [user("Hi"), {"role": "tool", "content": "x"}, reply("Hi.")]),
        ),
        "bad-pickle": (
            "image_unreadable",
            {**_sample("bad-pickle", chat), "jpgs": b"\x80\x04not a pickle"},
        ),
        "unsafe-pickle": (
            # a pickle that names a global: refused by the restricted unpickler, never run
            "image_unreadable",
            {**_sample("unsafe-pickle", chat), "jpgs": pickle.dumps([date(2020, 1, 1)])},
        ),
        "bad-json": ("malformed_json", _sample("bad-json", b'[{"role": "user", "content": ')),
        "no-conversation": (
            "malformed",
            {
                k: v
                for k, v in _sample("no-conversation", chat, [red]).items()
                if k != "conversation.json"
            },
        ),
        "video-frames": (
            "video_frames_unsupported",
            {
                **_sample("video-frames", [user("<video> Which way?"), reply("Right.")]),
                "videos": pickle.dumps([[jpeg_bytes((32, 32), "white")] * 4]),
            },
        ),
    }
    samples = {k: _sample(k, conv, images) for k, (images, conv) in good.items()}
    s = {k: v for k, (_, v) in bad.items()}
    shards = {
        "train-shard-000000.tar": [
            samples["one-image"],
            s["bad-image-bytes"],
            samples["typed-parts"],
            samples["two-images"],
            s["no-assistant"],
            samples["text-only"],
            s["marker-mismatch"],
            samples["from-value"],
            s["bad-pickle"],
            s["unsafe-pickle"],
        ],
        "train-shard-000001.tar": [
            samples["system"],
            samples["two-turns"],
            s["unknown-role"],
            samples["wrapped"],
            s["bad-json"],
            samples["jpeg"],
            s["unmarked-image"],
            samples["three-images"],
            s["no-conversation"],
            samples["llava-text"],
        ],
        "val-shard-000000.tar": [
            samples["val-image"],
            s["video-frames"],
            samples["val-text"],
            samples["val-typed"],
        ],
    }
    expected = ChatMLSet(root=Path(), shards={})
    for name, entries in shards.items():
        split = "val" if name.startswith("val") else "train"
        for entry in entries:
            key = entry["__key__"]
            if key in bad:
                expected.bad[key] = bad[key][0]
            else:
                expected.good[key] = split
                expected.images[key] = list(good[key][0])
    return shards, expected


def write_shards(root: Path, shards: dict[str, list[dict]]) -> None:
    """Each shard's entries with webdataset's own writer (parts in the entry's order)."""
    root.mkdir(parents=True, exist_ok=True)
    for name, entries in shards.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        with wds.TarWriter(str(root / name)) as sink:
            for entry in entries:
                sink.write(entry)


def energon_prepare(root: Path, shards: list[str], splits: dict[str, str]) -> None:
    """Index ``shards`` with Energon's own prepare; ``splits``: split part → shard regex."""
    from megatron.energon.flavors.webdataset.base_webdataset import BaseWebdatasetFactory

    BaseWebdatasetFactory.prepare_dataset(
        root, shards, split_parts_patterns=list(splits.items()), shuffle_seed=None, workers=1
    )


def write_bridge_yaml(root: Path, field_map: dict[str, str], **extra: Any) -> None:
    """Bridge's dataset.yaml (its tutorial's form)."""
    doc = {**BRIDGE_CLASS, "field_map": field_map, "subflavors": {}, **extra}
    (root / ".nv-meta" / "dataset.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))


def write_chatml_dataset(root: Path) -> ChatMLSet:
    """The standard set (see the module docstring), prepared by Energon in ``root``."""
    shards, expected = _standard_samples()
    write_shards(root, shards)
    energon_prepare(
        root,
        list(shards),
        {"train": "^train-shard-[0-9]+[.]tar$", "val": "^val-shard-[0-9]+[.]tar$"},
    )
    write_bridge_yaml(root, STANDARD_FIELDS)
    expected.root = root
    expected.shards = {name: [e["__key__"] for e in entries] for name, entries in shards.items()}
    return expected


@dataclass
class Adoption:
    """What prepare's checks make of an adopted dataset (:func:`adopt`)."""

    dataset: ChatMLDataset
    #: key → the accepted row
    rows: dict[str, ConversationRow]
    #: key → the rejection
    rejected: dict[str, Rejected]
    #: key → the source shard of each sample read
    shard_of: dict[str, str]


def adopt(cfg: PipelineConfig, source: Path, out: Path) -> Adoption:
    """Check every sample of ``source`` as prepare does (``shard_records`` into
    ``parse_record`` under ``cfg``'s limits: :func:`stages.prepare.row_context`) and write
    the adoption files into ``out`` (published there, as prepare's dir)."""
    from packline.rows import row_context

    ds = ChatMLDataset.open(source)
    context = row_context(cfg)  # prepare's own limits
    adoption = Adoption(ds, {}, {}, {})
    for _, shard in ds.shards():
        for key, record, media in shard_records(ds, shard):
            assert key not in adoption.shard_of, f"{key} read twice"
            adoption.shard_of[key] = shard
            try:
                adoption.rows[key] = context.parse(record, media)
            except Rejected as rej:
                assert rej.id == record["id"], (rej.id, record["id"])
                adoption.rejected[key] = rej
    out.mkdir(parents=True, exist_ok=True)
    excluded = [f"{adoption.shard_of[k]}/{k}" for k in adoption.rejected]
    write_adoption(out, out, ds, excluded)
    return adoption


def file_stats(root: Path) -> dict[str, tuple[int, int]]:
    """Every file under ``root``: (size, mtime in ns)."""
    return {
        str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }
