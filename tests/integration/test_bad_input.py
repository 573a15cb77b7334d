"""Every bad input is a reason, never a traceback: real files through the real prepare.

- text that is not UTF-8 (raw bytes, a lone surrogate escape, an encoded surrogate) is
  rejected as ``text_not_utf8`` in each source kind, and a UTF-8 BOM is read as text;
- a conversation over ``prepare.max_text_chars`` is rejected as ``text_too_long``;
- two ids that map to one key are both named;
- an adopted Energon dataset's truncated or corrupt shard: its samples are rejected as
  ``shard_unreadable`` and the shard left out (or, over the reject share, exit 2 naming the
  shard and the fix), the user's files untouched;
- an adopted dataset whose split config, index or field map names a file outside its dir (an
  absolute or ``..`` shard name, a shard linked out of the dir, a part name with ``/``) is
  refused before anything is read (exit 2, naming the file and the entry), its files and
  the outside dataset's untouched; a part over ``prepare.max_media_bytes`` rejects its
  sample unread;
- anything else that breaks on a user's file is one line naming it (exit 1), its traceback
  in the stage's log.
"""

from __future__ import annotations

import io
import json
import pickle
from pathlib import Path

import pytest
import yaml

from packline.energon.chatml import SPLIT_CONFIG, ChatMLDataset
from packline.energon.files import PACKLINE_METADATASET
from pipelines.cli import main
from stages.prepare import prepare
from tests.conftest import make_config, png_bytes
from tests.integration.chatml_dataset import (
    STANDARD_FIELDS,
    _sample,
    energon_prepare,
    file_stats,
    reply,
    user,
    write_bridge_yaml,
    write_chatml_dataset,
    write_shards,
)
from tests.integration.test_hardening import _cli
from tests.machine import sha256_tree

LENIENT = ("prepare.max_reject_fraction=1",)


def _turns(question: str = "What is it?", answer: str = "A disc.") -> list[dict]:
    return [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]


def _line(sid: str, question: str = "What is it?") -> bytes:
    return json.dumps({"id": sid, "conversations": _turns(question)}).encode()


def _rejects(out: Path) -> dict[str, tuple[str, str]]:
    """id → (reason, detail) of every row of ``rejects.jsonl``."""
    rows = [json.loads(line) for line in (out / "rejects.jsonl").read_text().splitlines()]
    return {r["id"]: (r["reason"], r["detail"]) for r in rows}


def _accepted_ids(out: Path) -> set[str]:
    import pandas as pd

    return set(pd.read_parquet(out / "manifest.parquet")["id"])


# --- text that is not UTF-8, and a BOM -------------------------------------------------------


def test_jsonl_bytes_that_are_not_utf8_reject_that_row_and_a_bom_is_text(tmp_path: Path):
    folder = tmp_path / "data"
    folder.mkdir()
    lines = [
        b"\xef\xbb\xbf" + _line("bom"),  # a BOM before the first row
        _line("ok"),
        _line("latin1").replace(b"What", b"Caf\xe9 what"),  # Latin-1, not UTF-8
        _line("escaped", "\ud800 a lone surrogate escape"),  # json.dumps writes \\ud800
        _line("emoji", "\U0001f600 fine"),
    ]
    (folder / "conversations.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    out = prepare(make_config(tmp_path / "work", f"data.source={folder}", *LENIENT))
    rejects = _rejects(out.out_dir)
    assert set(rejects) == {None, "escaped"}  # the Latin-1 line has no readable id
    column = lines[2].index(b"\xe9") + 1
    assert rejects[None] == ("text_not_utf8", f"byte 0xe9 at column {column} is not UTF-8")
    assert rejects["escaped"] == (
        "text_not_utf8",
        "conversations[0].content: a lone surrogate U+D800 at character 1 is not UTF-8",
    )
    assert _accepted_ids(out.out_dir) == {"bom", "ok", "emoji"}
    assert out.metrics["prepare/rejected_text_not_utf8"] == 2


def test_llava_bytes_that_are_not_utf8_reject_that_record_and_a_bom_is_text(tmp_path: Path):
    records = [
        json.dumps({"id": "ok", "conversations": _turns()}).encode(),
        json.dumps({"id": "latin1", "conversations": _turns("Caf_ here?")}).encode(),
        json.dumps({"id": "escaped", "conversations": _turns("\udcff here")}).encode(),
        json.dumps({"id": "after", "conversations": _turns()}).encode(),
    ]
    records[1] = records[1].replace(b"Caf_", b"Caf\xe9")
    path = tmp_path / "src" / "mix.json"
    path.parent.mkdir()
    path.write_bytes(b"\xef\xbb\xbf[" + b",\n".join(records) + b"]")
    out = prepare(make_config(tmp_path / "work", f"data.source={path}", *LENIENT))
    rejects = _rejects(out.out_dir)
    assert rejects == {
        "latin1": (
            "text_not_utf8",
            "conversations[0].content: the byte 0xe9 at character 4 is not UTF-8",
        ),
        "escaped": (
            "text_not_utf8",
            "conversations[0].content: the byte 0xff at character 1 is not UTF-8",
        ),
    }
    assert _accepted_ids(out.out_dir) == {"ok", "after"}  # the records after it are read


def test_an_adopted_samples_text_that_is_not_utf8_is_rejected_and_a_bom_read(tmp_path: Path):
    root = tmp_path / "ds"
    image = png_bytes((48, 48), "red")

    def conversation(question: str) -> bytes:
        return json.dumps([user(f"<image>{question}"), reply("Red.")]).encode()

    samples = [
        _sample("ok", conversation("What colour?"), [image]),
        _sample("bom", b"\xef\xbb\xbf" + conversation("What colour?"), [image]),
        _sample("latin1", conversation("Caf_ colour?").replace(b"_", b"\xe9"), [image]),
        # a surrogate encoded as UTF-8 bytes (CESU-8): JSON reads it, it is not UTF-8
        _sample("cesu", conversation("X colour?").replace(b"X", b"\xed\xa0\x80"), [image]),
    ]
    write_shards(root, {"train-0.tar": samples})
    energon_prepare(root, ["train-0.tar"], {"train": "^train-0[.]tar$"})
    write_bridge_yaml(root, STANDARD_FIELDS)
    before = file_stats(root)
    out = prepare(make_config(tmp_path / "work", f"data.source={root}", *LENIENT))
    rejects = _rejects(out.out_dir)
    assert rejects["train-0.tar/latin1"][0] == "text_not_utf8"
    assert "byte 0xe9" in rejects["train-0.tar/latin1"][1]
    assert rejects["train-0.tar/cesu"] == (
        "text_not_utf8",
        "conversations[0].content: a lone surrogate U+D800 at character 8 is not UTF-8",
    )
    assert _accepted_ids(out.out_dir) == {"train-0.tar/ok", "train-0.tar/bom"}
    assert file_stats(root) == before


# --- unbounded text ---------------------------------------------------------------------------


def test_a_conversation_over_max_text_chars_is_rejected_before_any_tokenizer(tmp_path: Path):
    folder = tmp_path / "data"
    folder.mkdir()
    # 'user', 'assistant' and the answer 'A disc.' count too: 20 characters
    lines = [_line("short"), _line("long", "x" * 5_000), _line("edge", "y" * 980)]
    (folder / "conversations.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    cfg = make_config(
        tmp_path / "work", f"data.source={folder}", "prepare.max_text_chars=1000", *LENIENT
    )
    out = prepare(cfg)
    assert _rejects(out.out_dir) == {
        "long": (
            "text_too_long",
            "the conversation holds 5020 characters of text, prepare.max_text_chars is 1000",
        )
    }
    assert _accepted_ids(out.out_dir) == {"short", "edge"}  # 1000 characters: at the bound


# --- two ids, one key -------------------------------------------------------------------------


def test_two_ids_that_map_to_one_key_are_both_named(tmp_path: Path):
    from packline.conversations import key_for_id

    folder = tmp_path / "data"
    folder.mkdir()
    hashed = key_for_id("a.b")  # 'a.b' is not a safe key: its key is a hash
    lines = [_line("a.b"), _line(hashed), _line("plain"), _line("plain")]
    (folder / "conversations.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    out = prepare(make_config(tmp_path / "work", f"data.source={folder}", *LENIENT))
    rows = [json.loads(x) for x in (out.out_dir / "rejects.jsonl").read_text().splitlines()]
    assert [(r["line"], r["id"], r["detail"]) for r in rows] == [
        (
            2,
            hashed,
            f"ids {hashed!r} and the id at line 1 map to the same key {hashed!r} (the hash of "
            "an id that is not a safe name)",
        ),
        (4, "plain", "id 'plain' already seen (line 3)"),
    ]


def test_an_energon_key_in_two_shards_names_both_ids(tmp_path: Path):
    root = tmp_path / "ds"
    image = png_bytes((48, 48), "red")
    conv = json.dumps([user("<image>What colour?"), reply("Red.")]).encode()
    shards = {
        "train-0.tar": [_sample("a", conv, [image]), _sample("b", conv, [image])],
        "train-1.tar": [_sample("c", conv, [image]), _sample("a", conv, [image])],
    }
    write_shards(root, shards)
    # Energon 7.4's prepare refuses a key twice; an older Energon's index may hold one
    # (written here by hand, as test_chatml_adoption does).
    meta = root / ".nv-meta"
    meta.mkdir()
    for name in shards:
        (root / f"{name}.idx").write_bytes(b"")
    (meta / ".info.json").write_text(json.dumps({"shard_counts": dict.fromkeys(shards, 2)}))
    (meta / "split.yaml").write_text(yaml.safe_dump({"split_parts": {"train": list(shards)}}))
    write_bridge_yaml(root, STANDARD_FIELDS)
    out = prepare(make_config(tmp_path / "work", f"data.source={root}", *LENIENT))
    assert _rejects(out.out_dir)["train-1.tar/a"] == (
        "duplicate_id",
        "ids 'train-1.tar/a' and 'train-0.tar/a' (position 1) map to the same key 'a' (an "
        "Energon key names one sample in the whole dataset)",
    )


# --- an adopted dataset's unreadable shard ----------------------------------------------------


@pytest.mark.parametrize(
    "damage, why",
    [
        # cut off inside a header: tarfile reads fewer samples, the index says the file is short
        (lambda data: data[: len(data) // 2 + 100], "truncated: 30820 bytes, its index places"),
        # a header's bytes overwritten: tarfile refuses the file
        (lambda data: data[:1024] + b"\xff" * 512 + data[1536:], "ReadError: "),
    ],
    ids=["truncated", "bad-header"],
)
def test_an_unreadable_shard_is_a_reason_and_the_users_files_are_untouched(
    tmp_path, damage, why, capsys
):
    """The CLI in this process (a subprocess would spend most of its time importing)."""
    written = write_chatml_dataset(tmp_path / "ds")
    shard = "train-shard-000001.tar"
    path = written.root / shard
    path.write_bytes(damage(path.read_bytes()))
    before = file_stats(written.root)
    work = tmp_path / "work"
    code = main(["stage", "prepare", f"work_dir={work}", f"data.source={written.root}"])
    stderr = capsys.readouterr().err
    assert code == 2, stderr[-3000:]
    assert "Traceback" not in stderr
    err = " ".join(stderr.split())
    assert f"shard {shard} cannot be read ({why}" in err
    assert f"fix: restore it (or write it again and run `energon prepare {written.root}`)" in err
    assert "'shard_unreadable': 10" in err
    assert file_stats(written.root) == before

    args = ["stage", "prepare", f"work_dir={work}", f"data.source={written.root}", *LENIENT]
    assert main(args) == 0, capsys.readouterr().err[-3000:]
    out = work / "prepare"
    rejects = _rejects(out)
    lost = {sid for sid, (reason, _) in rejects.items() if reason == "shard_unreadable"}
    assert lost == {f"{shard}/{key}" for key in written.shards[shard]}
    split = yaml.safe_load((out / SPLIT_CONFIG).read_text())
    assert shard in split["exclude"]  # left out whole: no loader opens it
    assert not any(e.startswith(f"{shard}/") for e in split["exclude"])
    record = json.loads((out / "_COMPLETE.json").read_text())
    assert record["summary"]["adopted"]["unreadable_shards"] == [shard]
    assert file_stats(written.root) == before
    # Energon reads the adopted view without the shard.
    from megatron.energon import WorkerConfig, get_loader, get_train_dataset

    from packline.energon.sample import ConversationReader

    ds = get_train_dataset(
        out / PACKLINE_METADATASET,
        split_part="train",
        worker_config=WorkerConfig(rank=0, world_size=1, num_workers=0),
        batch_size=1,
        shuffle_buffer_size=None,
        max_samples_per_sequence=None,
        repeat=False,
        task_encoder=ConversationReader(),
    )
    keys = {sample.__key__ for (sample,) in get_loader(ds)}
    good_train = {k for k, s in written.good.items() if s == "train"}
    assert keys == good_train - set(written.shards[shard])
    assert ChatMLDataset.open(written.root).shard_counts[shard] == 10


# --- anything else: one line naming the input ----------------------------------------------


@pytest.mark.slow
def test_an_input_output_error_on_a_users_file_is_named_as_the_machines(tmp_path: Path):
    folder = tmp_path / "data"
    folder.mkdir()
    # A file no read succeeds on (EIO): the device's or file system's refusal, not a bug.
    (folder / "conversations.jsonl").symlink_to("/proc/self/mem")
    work = tmp_path / "work"
    result = _cli("stage", "prepare", f"work_dir={work}", f"data.source={folder}")
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr and "a bug in packline" not in result.stderr
    err = " ".join(result.stderr.split())
    assert f"reading {folder}/conversations.jsonl failed with an input/output error" in err
    assert "fix: check the device (dmesg), or copy the file to a healthy one" in err
    assert not (work / "prepare").exists() and not list(work.glob(".tmp-*"))


def test_an_unexpected_failure_on_a_users_file_is_one_line_naming_it(tmp_path: Path):
    """A bug (injected: ``tests/integration/bug_in_prepare.py``) is one line naming the
    input and the log that holds its traceback, exit 1."""
    import subprocess
    import sys

    from tests.machine import cli_env

    folder = tmp_path / "data"
    folder.mkdir()
    (folder / "conversations.jsonl").write_bytes(_line("a") + b"\n" + _line("b") + b"\n")
    work = tmp_path / "work"
    result = subprocess.run(
        [sys.executable, "-m", "tests.integration.bug_in_prepare", "stage", "prepare",
         f"work_dir={work}", f"data.source={folder}", "prepare.num_workers=1"],
        capture_output=True, text=True, env=cli_env(), timeout=600,
    )  # fmt: skip
    assert result.returncode == 1, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, result.stderr[-3000:]
    log = work / "logs" / "prepare.log"
    assert lines[0] == (
        f"error: packline failed on data.source {folder}: KeyError: 'injected' — a bug in "
        f"packline, please report it with the traceback in {log}"
    )
    assert "Traceback (most recent call last)" in log.read_text()
    assert not (work / "prepare").exists() and not list(work.glob(".tmp-*"))


# --- an adopted dataset's paths stay inside it; its parts are sized before they are read ---


def _tiny_energon(root: Path, keys: tuple[str, ...]) -> Path:
    """A one-shard Energon dataset in Bridge's layout (``train-0.tar``, one image a sample)."""
    conversation = json.dumps([user("<image>What colour?"), reply("Red.")]).encode()
    image = png_bytes((48, 48), "red")
    write_shards(root, {"train-0.tar": [_sample(k, conversation, [image]) for k in keys]})
    energon_prepare(root, ["train-0.tar"], {"train": "^train-0[.]tar$"})
    write_bridge_yaml(root, STANDARD_FIELDS)
    return root


def _point_split_at(name: str):
    """Damage: the train split part names ``name``, which the index counts too (as a
    careless or hostile dataset would write it: before, prepare read that file)."""

    def damage(root: Path, other: Path) -> None:
        meta = root / ".nv-meta"
        entry = name.format(other=other)
        (meta / "split.yaml").write_text(yaml.safe_dump({"split_parts": {"train": [entry]}}))
        info = json.loads((meta / ".info.json").read_text())
        info["shard_counts"][entry] = 2
        (meta / ".info.json").write_text(json.dumps(info))

    return damage


def _escaping_info(root: Path, other: Path) -> None:
    info = json.loads((root / ".nv-meta" / ".info.json").read_text())
    info["shard_counts"]["../other/train-0.tar"] = 2
    (root / ".nv-meta" / ".info.json").write_text(json.dumps(info))


def _linked_shard(root: Path, other: Path) -> None:
    (root / "train-0.tar").unlink()
    (root / "train-0.tar").symlink_to(other / "train-0.tar")


def _field_map_path(root: Path, other: Path) -> None:
    write_bridge_yaml(root, {**STANDARD_FIELDS, "imgs": "../other/jpgs"})


def _linked_metadata(root: Path, other: Path) -> None:
    (root / ".nv-meta" / "split.yaml").unlink()
    (root / ".nv-meta" / "split.yaml").symlink_to(other / ".nv-meta" / "split.yaml")


def _billion_shards(root: Path, other: Path) -> None:
    split = {"split_parts": {"train": ["train-{0..999999999}.tar"]}}
    (root / ".nv-meta" / "split.yaml").write_text(yaml.safe_dump(split))


@pytest.mark.parametrize(
    "damage, problems",
    [
        (
            _point_split_at("{other}/train-0.tar"),
            [
                "{meta}/split.yaml: split_parts.train entry '{other}/train-0.tar' is an "
                "absolute path; fix: name shards relative to the dataset dir, inside it (run "
                "energon prepare on the dataset where its shards are)",
                "{meta}/.info.json: shard_counts entry '{other}/train-0.tar' is an absolute path",
            ],
        ),
        (
            _point_split_at("../other/train-0.tar"),
            [
                "{meta}/split.yaml: split_parts.train entry '../other/train-0.tar' escapes the "
                "dataset dir {root}; fix: name shards relative to the dataset dir",
                "{meta}/.info.json: shard_counts entry '../other/train-0.tar' escapes the "
                "dataset dir {root};",
            ],
        ),
        (
            _escaping_info,
            [
                "{meta}/.info.json: shard_counts entry '../other/train-0.tar' escapes the "
                "dataset dir {root}; fix: name shards relative to the dataset dir",
            ],
        ),
        (
            _linked_shard,
            [
                "{meta}/split.yaml: split_parts.train entry 'train-0.tar' escapes the dataset "
                "dir {root} (a symbolic link to {other}/train-0.tar); fix: copy the file into "
                "the dataset dir in place of the link",
                "{meta}/.info.json: shard_counts entry 'train-0.tar' escapes the dataset dir",
            ],
        ),
        (
            _field_map_path,
            [
                "{meta}/dataset.yaml: field_map imgs: '../other/jpgs' is a path, not a part "
                "name (the suffix of a tar member after its key, e.g. jpgs or "
                "conversation.json); fix: name the part only",
            ],
        ),
        (
            _linked_metadata,
            [
                "{root}: '.nv-meta/split.yaml' escapes the dataset dir {root} (a symbolic "
                "link to {other}/.nv-meta/split.yaml)",
            ],
        ),
        (
            _billion_shards,
            [
                "{meta}/split.yaml and {meta}/.info.json name 1,000,000,001 shards and excludes "
                "(brace patterns expanded), more than 1,000,000; fix: name the shards the "
                "dataset holds",
            ],
        ),
    ],
    ids=[
        "absolute-split-entry",
        "dotdot-split-entry",
        "info-entry",
        "linked-shard",
        "field-map",
        "linked-metadata",
        "brace-billion",
    ],
)
def test_an_adopted_dataset_naming_a_file_outside_it_is_refused_before_reading(
    tmp_path: Path, damage, problems, capsys
):
    """The CLI in this process (the refusal comes before any heavy work: a subprocess
    would spend its time importing)."""
    root = _tiny_energon(tmp_path / "ds", ("a", "b")).resolve()
    other = _tiny_energon(tmp_path / "other", ("x", "y")).resolve()  # a valid one beside it
    meta = root / ".nv-meta"
    kept = {p: p.read_bytes() for p in [root / "train-0.tar", *meta.iterdir()] if p.is_file()}
    damage(root, other)
    before = sha256_tree(root), sha256_tree(other)
    work = tmp_path / "work"

    code = main(["stage", "prepare", f"work_dir={work}", f"data.source={root}"])
    err = capsys.readouterr().err

    assert code == 2, err[-3000:]
    assert "Traceback" not in err
    assert "prepare: the Energon dataset cannot be adopted" in err
    lines = [line[4:] for line in err.splitlines() if line.startswith("  - ")]
    assert len(lines) == len(problems), err[-3000:]
    for line, problem in zip(lines, problems, strict=True):
        assert line.startswith(problem.format(meta=meta, root=root, other=other)), line
    assert (sha256_tree(root), sha256_tree(other)) == before
    assert not (work / "prepare").exists()

    # the fix: the dataset's own files back, each link replaced by the file it stood for
    for path, data in kept.items():
        path.unlink()
        path.write_bytes(data)
    assert main(["stage", "prepare", f"work_dir={work}", f"data.source={root}"]) == 0
    assert _accepted_ids(work / "prepare") == {"train-0.tar/a", "train-0.tar/b"}
    assert sha256_tree(other) == before[1]


def test_an_adopted_part_over_max_media_bytes_is_rejected_unread(tmp_path: Path):
    import random

    from PIL import Image

    root = tmp_path / "ds"
    noise = random.Random(0).randbytes(64 * 64 * 3)  # PNG does not compress it
    buffer = io.BytesIO()
    Image.frombytes("RGB", (64, 64), noise).save(buffer, format="PNG")
    big = buffer.getvalue()
    small = png_bytes((48, 48), "red")
    conversation = json.dumps([user("<image>What colour?"), reply("Red.")]).encode()
    long_conversation = json.dumps([user("<image>" + "x" * 3000), reply("Red.")]).encode()
    samples = [
        _sample("ok", conversation, [small]),
        _sample("big", conversation, [big]),
        _sample("long", long_conversation, [small]),
        _sample("after", conversation, [small]),
    ]
    write_shards(root, {"train-0.tar": samples})
    energon_prepare(root, ["train-0.tar"], {"train": "^train-0[.]tar$"})
    write_bridge_yaml(root, STANDARD_FIELDS)
    before = sha256_tree(root)
    cfg = make_config(
        tmp_path / "work", f"data.source={root}", "prepare.max_media_bytes=2000", *LENIENT
    )
    out = prepare(cfg)
    big_part = len(pickle.dumps([big]))
    assert _rejects(out.out_dir) == {
        "train-0.tar/big": (
            "image_size_refused",
            f"part 'jpgs' of train-0.tar/big: {big_part:,} bytes, over "
            "prepare.max_media_bytes 2,000",
        ),
        "train-0.tar/long": (
            "text_too_long",
            f"part 'conversation.json' of train-0.tar/long: {len(long_conversation):,} "
            "bytes, over prepare.max_media_bytes 2,000",
        ),
    }
    assert _accepted_ids(out.out_dir) == {"train-0.tar/ok", "train-0.tar/after"}
    assert sha256_tree(root) == before
