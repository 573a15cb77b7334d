"""An Energon dataset in Megatron-Bridge's ChatML layout, adopted in place
(``packline.energon.chatml``): written with webdataset's writer and indexed by Energon's own
prepare (``tests/integration/chatml_dataset.py``), read sample by sample, checked by
``parse_record``, and loaded back by packline's readers through the ``packline.yaml`` the
adoption writes, without a byte of the source changing.
"""

from __future__ import annotations

import json
import pickle
from itertools import islice
from pathlib import Path

import pytest
import yaml
from megatron.energon import WorkerConfig, get_loader, get_train_dataset, get_val_dataset

from packline.catalog import dataset_path
from packline.energon.chatml import (
    ChatMLDataset,
    shard_records,
    write_adoption,
)
from packline.energon.files import BRIDGE_METADATASET, PACKLINE_METADATASET
from packline.energon.loader import train_loader, val_loader
from packline.energon.packing import PackingSettings, make_encoder
from packline.energon.sample import ConversationReader
from packline.qwen.processor import copy_tiny_processor
from packline.rows import row_context
from tests.conftest import make_config, png_bytes
from tests.integration.chatml_dataset import (
    STANDARD_FIELDS,
    adopt,
    energon_prepare,
    file_stats,
    reply,
    user,
    write_bridge_yaml,
    write_chatml_dataset,
    write_shards,
)


@pytest.fixture(scope="module")
def adopted(tmp_path_factory):
    """The standard set, adopted into a prepare dir (read-only for the tests)."""
    root = tmp_path_factory.mktemp("chatml")
    written = write_chatml_dataset(root / "source")
    before = file_stats(written.root)
    cfg = make_config(root / "work", f"data.source={written.root}")
    adoption = adopt(cfg, written.root, root / "work" / "prepare")
    return written, adoption, cfg, before


def _read(path: Path, encoder, splits=("train", "val")) -> dict[str, tuple[str, object]]:
    """key → (split, sample) of every sample of ``splits`` of ``path``, one worker."""
    wc = WorkerConfig(rank=0, world_size=1, num_workers=0)
    out = {}
    for split in splits:
        if split == "train":
            ds = get_train_dataset(
                path,
                split_part="train",
                worker_config=wc,
                batch_size=1,
                shuffle_buffer_size=None,
                max_samples_per_sequence=None,
                packing_buffer_size=None,
                repeat=False,
                task_encoder=encoder,
            )
        else:
            ds = get_val_dataset(
                path, split_part=split, worker_config=wc, batch_size=1, task_encoder=encoder
            )
        for (sample,) in get_loader(ds):
            assert sample.__key__ not in out, f"{sample.__key__} read twice"
            out[sample.__key__] = (split, sample)
    return out


def test_open_reads_the_layout_of_a_bridge_chatml_dataset(adopted):
    written, adoption, _, _ = adopted
    ds = adoption.dataset
    assert ds.field_map == STANDARD_FIELDS
    assert ds.shards() == [
        ("train", "train-shard-000000.tar"),
        ("train", "train-shard-000001.tar"),
        ("val", "val-shard-000000.tar"),
    ]
    # Energon's prepare collapsed the train shards into a brace pattern: kept as written
    assert ds.split_parts["train"] == ["train-shard-{000000..000001}.tar"]
    assert ds.shard_counts == {name: len(keys) for name, keys in written.shards.items()}


def test_every_sample_comes_out_once_in_tar_order_with_energons_key(adopted):
    written, adoption, _, _ = adopted
    ds = adoption.dataset
    for split, shard in ds.shards():
        records = list(shard_records(ds, shard))
        assert [key for key, _, _ in records] == written.shards[shard]
        for key, record, media in records:
            assert record["id"] == f"{shard}/{key}" and record["split"] == split
            assert media.key(record["id"]) == key


def test_bad_samples_are_rejected_with_their_reason_and_the_good_kept(adopted):
    written, adoption, _, _ = adopted
    assert {k: r.reason for k, r in adoption.rejected.items()} == written.bad
    assert {k: row.split for k, row in adoption.rows.items()} == written.good
    for key, row in adoption.rows.items():
        assert row.key == key and row.id == f"{adoption.shard_of[key]}/{key}"
        assert [img.data for img in row.images] == written.images[key]
    # the unsafe pickle names a global: refused by name, never built
    assert "refused to load datetime.date" in adoption.rejected["unsafe-pickle"].detail
    # an image no part or marker places: Bridge would drop it unseen
    assert "only where" in adoption.rejected["unmarked-image"].detail


def test_conversations_follow_bridges_chatml_rule(adopted):
    _, adoption, _, _ = adopted

    def shape(key):
        return [
            (m["role"], [p.get("text", p["type"]) for p in m["content"]])
            for m in adoption.rows[key].conversation
        ]

    # spaces around markers go, as Bridge's normaliser strips them; typed parts stay as given
    assert shape("two-images") == [
        ("user", ["Image 1:", "image", "Image 2:", "image", "Which is taller?"]),
        ("assistant", ["Image 2."]),
    ]
    assert shape("two-turns")[2] == ("user", ["And now ", "image"])
    assert shape("from-value")[0] == ("user", ["image", "\nWhat colour?"])
    assert shape("wrapped")[0] == ("user", ["image", "Which colour?"])
    assert shape("system")[0] == ("system", ["Be brief."])


def test_adoption_writes_the_split_config_and_both_views(adopted):
    written, adoption, cfg, _ = adopted
    out = cfg.work_path / "prepare"
    split = yaml.safe_load((out / "packline_split.yaml").read_text())
    assert split["split_parts"] == adoption.dataset.split_parts
    assert sorted(split["exclude"]) == sorted(f"{adoption.shard_of[k]}/{k}" for k in written.bad)
    for name, config in ((PACKLINE_METADATASET, str(out / "packline_dataset.yaml")),
                         (BRIDGE_METADATASET, "dataset.yaml")):  # fmt: skip
        doc = yaml.safe_load((out / name).read_text())
        assert doc["__class__"] == "MetadatasetV2"
        assert doc["splits"] == {
            s: {
                "path": str(written.root),
                "dataset_config": config,
                "split_config": str(out / "packline_split.yaml"),
            }
            for s in ("train", "val")
        }
    assert dataset_path(cfg) == out / PACKLINE_METADATASET


def test_packline_reader_yields_exactly_the_good_samples_as_prepare_structured_them(adopted):
    written, adoption, cfg, before = adopted
    seen = _read(dataset_path(cfg), ConversationReader())
    assert {key: split for key, (split, _) in seen.items()} == written.good
    for key, (_, sample) in seen.items():
        row = adoption.rows[key]
        assert sample.sample_id == row.id
        assert sample.conversation == row.conversation
        assert sample.images == [img.data for img in row.images]
        assert sample.videos == [] and sample.video_headers == []
    assert file_stats(written.root) == before  # not a file of the source written


def test_packed_loaders_read_every_good_sample_of_an_adopted_dataset(adopted, tmp_path):
    written, _, cfg, before = adopted
    processor = copy_tiny_processor(tmp_path / "processor")
    settings = PackingSettings(seq_length=1024)
    keys: dict[str, list[str]] = {"train": [], "val": []}
    seen, dropped = 0, []
    train = train_loader(
        dataset_path(cfg),
        make_encoder("lazy", processor, settings),
        packing_buffer_size=4,
        repeat=False,
    )
    val = val_loader(
        dataset_path(cfg), make_encoder("lazy", processor, settings), packing_buffer_size=4
    )
    for split, loader in (("train", train), ("val", val)):
        for pack in loader:
            keys[split] += pack.batch.keys
            seen += pack.batch.seen
            dropped += [k for ks in pack.batch.dropped.values() for k in ks]
    assert dropped == []
    assert seen == len(written.good)
    assert sorted(keys["train"]) == sorted(k for k, s in written.good.items() if s == "train")
    assert sorted(keys["val"]) == sorted(k for k, s in written.good.items() if s == "val")
    assert file_stats(written.root) == before


def test_a_saved_loader_state_of_an_adopted_dataset_resumes_the_same_rows(adopted, tmp_path):
    _, _, cfg, _ = adopted
    processor = copy_tiny_processor(tmp_path / "processor")

    def loader():
        encoder = make_encoder("lazy", processor, PackingSettings(seq_length=256))
        return train_loader(dataset_path(cfg), encoder, packing_buffer_size=3)

    straight = [pack.batch.keys for pack in islice(loader(), 8)]
    first = loader()
    it = iter(first)
    head = [next(it).batch.keys for _ in range(3)]
    resumed = loader()
    resumed.restore_state_rank(first.save_state_rank())
    assert head + [pack.batch.keys for pack in islice(resumed, 5)] == straight


# --- other layouts and edge cases ---------------------------------------------------------------


def _dataset(root: Path, shards: dict[str, list[dict]], field_map: dict[str, str], **yaml_extra):
    write_shards(root, shards)
    energon_prepare(root, list(shards), {"train": "^train", "val": "^val"})
    write_bridge_yaml(root, field_map, **yaml_extra)
    return root


def _conversation(text: str = "<image>What is it?", answer: str = "A disc.") -> bytes:
    return json.dumps([user(text), reply(answer)]).encode()


def _check_all(cfg, ds: ChatMLDataset) -> dict[str, str]:
    """key → "ok" or the rejection reason, for every sample read."""
    out = {}
    for _, shard in ds.shards():
        for key, record, media in shard_records(ds, shard):
            try:
                row_context(cfg).parse(record, media)
                out[key] = "ok"
            except Exception as exc:
                out[key] = getattr(exc, "reason", repr(exc))
    return out


def test_bridges_tutorial_layout_one_png_per_sample_and_keys_with_a_dir(tmp_path):
    """``imgs: image.png`` (one image part per sample), keys naming a dir inside the tar, a
    sample without its image part (Bridge's loader fails on it), and the source's own
    exclude, which stays excluded."""
    red = png_bytes((64, 64), "red")
    ok = {"conversation.json": _conversation(), "image.png": red}
    shards = {
        "train-000.tar": [
            {"__key__": "coco/0001", **ok},
            {"__key__": "coco/0002", "conversation.json": _conversation()},
            {"__key__": "coco/0003", **ok},
            {"__key__": "excluded", **ok},
        ],
        "val-000.tar": [{"__key__": "v/0001", **ok}],
    }
    root = _dataset(
        tmp_path / "src", shards, {"imgs": "image.png", "conversation": "conversation.json"}
    )
    split_yaml = root / ".nv-meta" / "split.yaml"
    split = yaml.safe_load(split_yaml.read_text())
    split["exclude"] = ["train-000.tar/excluded"]
    split_yaml.write_text(yaml.safe_dump(split))
    cfg = make_config(tmp_path / "work", f"data.source={root}")
    adoption = adopt(cfg, root, tmp_path / "work" / "prepare")
    assert set(adoption.rows) == {"coco/0001", "coco/0003", "v/0001"}
    assert {k: r.reason for k, r in adoption.rejected.items()} == {"coco/0002": "malformed"}
    assert "'image.png'" in adoption.rejected["coco/0002"].detail
    out = yaml.safe_load((tmp_path / "work" / "prepare" / "packline_split.yaml").read_text())
    assert out["exclude"] == ["train-000.tar/excluded", "train-000.tar/coco/0002"]
    seen = _read(dataset_path(cfg), ConversationReader())
    assert {k: s for k, (s, _) in seen.items()} == {
        "coco/0001": "train",
        "coco/0003": "train",
        "v/0001": "val",
    }
    assert seen["coco/0001"][1].images == [red]


def test_a_key_twice_in_one_shard_is_rejected_for_every_copy(tmp_path):
    """Energon 7.4's prepare refuses duplicate keys; an index an older Energon wrote may hold
    them (written here by hand). An exclude names every copy, so none can stay."""
    ok = {"conversation.json": _conversation("Hi", "Hello"), "jpgs": pickle.dumps([])}
    shards = {
        "train-000.tar": [
            {"__key__": "a", **ok},
            {"__key__": "b", **ok},
            {"__key__": "a", **ok},
        ]
    }
    root = tmp_path / "src"
    write_shards(root, shards)
    meta = root / ".nv-meta"
    meta.mkdir()
    (root / "train-000.tar.idx").write_bytes(b"")
    (meta / ".info.json").write_text(json.dumps({"shard_counts": {"train-000.tar": 3}}))
    (meta / "split.yaml").write_text(yaml.safe_dump({"split_parts": {"train": ["train-000.tar"]}}))
    write_bridge_yaml(root, {"imgs": "jpgs", "conversation": "conversation.json"})
    cfg = make_config(tmp_path / "work", f"data.source={root}")
    ds = ChatMLDataset.open(root)
    got = [(key, media) for key, _, media in shard_records(ds, "train-000.tar")]
    assert [key for key, _ in got] == ["a", "b", "a"]
    assert [m.problem[0] if m.problem else "ok" for _, m in got] == [
        "duplicate_id",
        "ok",
        "duplicate_id",
    ]
    assert _check_all(cfg, ds) == {"a": "duplicate_id", "b": "ok"}


def test_a_shard_changed_since_it_was_indexed_is_refused(tmp_path):
    ok = {"conversation.json": _conversation("Hi", "Hello"), "jpgs": pickle.dumps([])}
    root = _dataset(
        tmp_path / "src",
        {"train-000.tar": [{"__key__": "a", **ok}]},
        {"imgs": "jpgs", "conversation": "conversation.json"},
    )
    write_shards(root, {"train-000.tar": [{"__key__": "a", **ok}, {"__key__": "b", **ok}]})
    ds = ChatMLDataset.open(root)
    with pytest.raises(ValueError, match="holds 2 samples, its Energon index says 1"):
        list(shard_records(ds, "train-000.tar"))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"__module__": "megatron.energon", "__class__": "CrudeWebdataset"}, "CrudeWebdataset;"),
        ({"sample_loader": "l.py:sample_loader", "part_filter": "l.py:f"}, "sample_loader"),
        ({"field_map": {"conversation": "json", "audio": "wav"}}, "maps \\['audio'\\]"),
        ({"field_map": {"conversation": "json,txt"}}, "not one part name"),
        ({"field_map": {"conversation": "json", "videos": "video.mp4"}}, "pickled frame lists"),
        ({"field_map": {"imgs": "jpgs"}}, "no field_map with a conversation part"),
    ],
)  # fmt: skip
def test_open_refuses_another_layout_saying_what_is_supported(tmp_path, change, message):
    ok = {"conversation.json": _conversation("Hi", "Hello"), "jpgs": pickle.dumps([])}
    root = _dataset(
        tmp_path / "src",
        {"train-000.tar": [{"__key__": "a", **ok}]},
        {"imgs": "jpgs", "conversation": "conversation.json"},
    )
    config_path = root / ".nv-meta" / "dataset.yaml"
    config = {**yaml.safe_load(config_path.read_text()), **change}
    config_path.write_text(yaml.safe_dump(config))
    with pytest.raises(ValueError, match=message) as info:
        ChatMLDataset.open(root)
    if "field_map" not in change or "audio" in str(change):
        assert "ChatMLWebdataset" in str(info.value)


def test_open_refuses_split_configs_it_cannot_adopt(tmp_path):
    ok = {"conversation.json": _conversation("Hi", "Hello"), "jpgs": pickle.dumps([])}
    root = _dataset(
        tmp_path / "src",
        {"train-000.tar": [{"__key__": "a", **ok}], "val-000.tar": [{"__key__": "b", **ok}]},
        {"imgs": "jpgs", "conversation": "conversation.json"},
    )
    split_yaml = root / ".nv-meta" / "split.yaml"
    for parts, message in (
        ({"test": ["val-000.tar"]}, "no train split part"),
        (
            {"train": ["train-000.tar", "val-000.tar"], "val": ["val-000.tar"]},
            "in both train and val",
        ),
        ({"train": ["train-001.tar"]}, "is not in .*info.json"),
    ):
        split_yaml.write_text(yaml.safe_dump({"split_parts": parts, "exclude": []}))
        with pytest.raises(ValueError, match=message):
            ChatMLDataset.open(root)
    # a test part is left alone
    split_yaml.write_text(
        yaml.safe_dump({"split_parts": {"train": ["train-000.tar"], "test": ["val-000.tar"]}})
    )
    assert ChatMLDataset.open(root).shards() == [("train", "train-000.tar")]


def test_write_adoption_escapes_braces_of_excluded_names(tmp_path):
    """Energon brace-expands every exclude entry: a rejected key holding braces (refused as
    a key) must name that one sample, not a pattern."""
    ok = {"conversation.json": _conversation("Hi", "Hello"), "jpgs": pickle.dumps([])}
    root = _dataset(
        tmp_path / "src",
        {"train-000.tar": [{"__key__": "a{1,2}", **ok}, {"__key__": "a1", **ok}]},
        {"imgs": "jpgs", "conversation": "conversation.json"},
    )
    cfg = make_config(tmp_path / "work", f"data.source={root}")
    ds = ChatMLDataset.open(root)
    assert _check_all(cfg, ds) == {"a{1,2}": "malformed", "a1": "ok"}
    out = tmp_path / "work" / "prepare"
    out.mkdir(parents=True)
    write_adoption(out, out, ds, ["train-000.tar/a{1,2}"])
    seen = _read(out / PACKLINE_METADATASET, ConversationReader(), splits=["train"])
    assert set(seen) == {"a1"}


def test_prepare_stops_with_exit_2_on_a_shard_changed_since_it_was_indexed(tmp_path):
    from schemas.errors import UserError
    from stages.prepare import prepare
    from tests.conftest import make_config

    ok = {"conversation.json": _conversation("Hi", "Hello"), "jpgs": pickle.dumps([])}
    root = _dataset(
        tmp_path / "src",
        {"train-000.tar": [{"__key__": "a", **ok}]},
        {"imgs": "jpgs", "conversation": "conversation.json"},
    )
    write_shards(root, {"train-000.tar": [{"__key__": "a", **ok}, {"__key__": "b", **ok}]})
    for workers in (1, 2):  # raised in this process, or in a worker
        cfg = make_config(tmp_path / f"w{workers}", f"data.source={root}")
        cfg.prepare.num_workers = workers
        with pytest.raises(UserError, match="holds 2 samples, its Energon index says 1"):
            prepare(cfg)
