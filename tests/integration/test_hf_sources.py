"""Data where users keep it (issue 44): the same conversations written as a folder and as
Parquet files in each row layout (images embedded as Hugging Face ``Image`` structs), a
``save_to_disk`` Arrow folder, a Hub dataset in a temp cache and several jsonl files give
shards with the same samples; bad rows are rejected with their reason and address; a file
that is not Parquet, or names no known layout, stops the stage naming it; the source files
are never changed; the output is the same bytes for any worker count."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from schemas.config import PROJECT_ROOT
from schemas.errors import UserError
from stages.prepare import prepare
from tests.conftest import make_config, png_bytes

IMAGE = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
COLOURS = ("red", "green", "blue", "yellow", "purple", "orange")
COMMON = ("prepare.val_fraction=0", "prepare.max_reject_fraction=1", "prepare.samples_per_shard=4")


def _conversations() -> list[dict]:
    """Six conversations: one or two images each (one text-only), question and answer."""
    out = []
    for i, colour in enumerate(COLOURS):
        n = 0 if i == 5 else 1 + i % 2
        images = [png_bytes((48 + 8 * i + 4 * k, 40), colour) for k in range(n)]
        out.append(
            {"id": f"c{i}", "q": f"What colour is picture {i}?", "a": colour, "images": images}
        )
    return out


def _folder(root: Path, convs: list[dict]) -> Path:
    folder = root / "folder"
    (folder / "img").mkdir(parents=True)
    lines = []
    for c in convs:
        names = []
        for k, data in enumerate(c["images"]):
            name = f"img/{c['id']}-{k}.png"
            (folder / name).write_bytes(data)
            names.append(name)
        turns = [{"role": "user", "content": c["q"]}, {"role": "assistant", "content": c["a"]}]
        lines.append(json.dumps({"id": c["id"], "images": names, "conversations": turns}))
    (folder / "conversations.jsonl").write_text("\n".join(lines) + "\n")
    return folder


def _struct(data: bytes, name: str | None = None) -> dict:
    return {"bytes": data, "path": name}


def _rows(layout: str, convs: list[dict]) -> tuple[list[dict], pa.Schema]:
    """The conversations as table rows in ``layout``, with the schema ``datasets`` gives."""
    images = pa.list_(IMAGE)
    if layout == "messages":
        part = pa.struct([("type", pa.string()), ("text", pa.string())])
        turn = pa.struct([("role", pa.string()), ("content", pa.list_(part))])
        schema = pa.schema([("id", pa.string()), ("messages", pa.list_(turn)), ("images", images)])
        rows = [
            {
                "id": c["id"],
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "image", "text": None} for _ in c["images"]]
                        + [{"type": "text", "text": c["q"]}],
                    },
                    {"role": "assistant", "content": [{"type": "text", "text": c["a"]}]},
                ],
                "images": [_struct(d) for d in c["images"]],
            }
            for c in convs
        ]
    elif layout == "conversations":  # ShareGPT / LLaVA
        turn = pa.struct([("from", pa.string()), ("value", pa.string())])
        schema = pa.schema(
            [("id", pa.string()), ("conversations", pa.list_(turn)), ("images", images)]
        )
        rows = [
            {
                "id": c["id"],
                "conversations": [
                    {"from": "human", "value": c["q"]},
                    {"from": "gpt", "value": c["a"]},
                ],
                "images": [_struct(d) for d in c["images"]],
            }
            for c in convs
        ]
    elif layout == "texts":  # the_cauldron
        pair = pa.struct(
            [("user", pa.string()), ("assistant", pa.string()), ("source", pa.string())]
        )
        schema = pa.schema([("images", images), ("texts", pa.list_(pair))])
        rows = [
            {
                "images": [_struct(d) for d in c["images"]],
                "texts": [{"user": c["q"], "assistant": c["a"], "source": "test"}],
            }
            for c in convs
        ]
    else:  # LLaVA-OneVision: one image, or none
        turn = pa.struct([("from", pa.string()), ("value", pa.string())])
        schema = pa.schema(
            [("id", pa.string()), ("image", IMAGE), ("conversations", pa.list_(turn))]
        )
        rows = [
            {
                "id": c["id"],
                "image": _struct(c["images"][0]) if c["images"] else None,
                "conversations": [
                    {"from": "human", "value": c["q"]},
                    {"from": "gpt", "value": c["a"]},
                ],
            }
            for c in convs
            if len(c["images"]) == 1
        ]
    return rows, schema


def _write(path: Path, rows: list[dict], schema: pa.Schema, row_group_size: int = 2) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), path, row_group_size=row_group_size)
    return path


def _samples(out: Path) -> list[tuple[str, list[bytes]]]:
    """Each sample of the shards, in order: its conversation (as JSON) and its images' bytes."""
    samples: dict[str, dict] = {}
    for shard in sorted(out.glob("*.tar")):
        with tarfile.open(shard) as tar:
            for m in tar.getmembers():
                key, _, part = m.name.partition(".")
                samples.setdefault(key, {})[part] = tar.extractfile(m).read()
    out_list = []
    for parts in samples.values():
        doc = json.loads(parts["json"])
        images = [parts[p] for p in sorted(p for p in parts if p.startswith("img"))]
        out_list.append((json.dumps(doc["conversation"], sort_keys=True), images))
    return out_list


def _sha(paths: list[Path]) -> dict[Path, str]:
    return {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in paths}


def test_every_layout_gives_the_folder_samples(tmp_path: Path):
    convs = _conversations()
    folder = prepare(
        make_config(tmp_path / "w-folder", f"data.source={_folder(tmp_path, convs)}", *COMMON)
    )
    expected = _samples(folder.out_dir)
    assert len(expected) == 6
    for layout in ("messages", "conversations", "texts", "onevision"):
        rows, schema = _rows(layout, convs)
        # the rows over two files in a folder, row groups of two rows
        files = [
            _write(tmp_path / layout / "data" / f"train-0000{k}-of-00002.parquet", part, schema)
            for k, part in enumerate((rows[:3], rows[3:]))
        ]
        before = _sha(files)
        result = prepare(
            make_config(tmp_path / f"w-{layout}", f"data.source={tmp_path / layout}", *COMMON)
        )
        assert result.summary["source_kind"] == "parquet"
        assert result.metrics["prepare/rows_rejected"] == 0, layout
        got = _samples(result.out_dir)
        if layout == "onevision":  # its rows hold one image each
            want = [s for s in expected if len(s[1]) == 1]
        else:
            want = expected
        assert got == want, layout
        assert _sha(files) == before  # the source is only read
    # a file given by name, and a glob, read the same rows
    one = tmp_path / "conversations" / "data" / "train-00000-of-00002.parquet"
    by_name = prepare(make_config(tmp_path / "w-one", f"data.source={one}", *COMMON))
    assert _samples(by_name.out_dir) == expected[:3]
    pattern = tmp_path / "messages" / "data" / "*.parquet"
    by_glob = prepare(make_config(tmp_path / "w-glob", f"data.source={pattern}", *COMMON))
    assert _samples(by_glob.out_dir) == expected


def test_rows_without_an_id_get_a_stable_one_from_their_address(tmp_path: Path):
    rows, schema = _rows("texts", _conversations())
    path = _write(tmp_path / "src" / "cauldron.parquet", rows, schema)
    result = prepare(make_config(tmp_path / "w", f"data.source={path}", *COMMON))
    import pandas as pd

    ids = pd.read_parquet(result.out_dir / "manifest.parquet")["id"].tolist()
    assert ids == [f"cauldron-g{i // 2}-r{i % 2}" for i in range(6)]


def test_a_changed_file_changes_prepare_fingerprint(tmp_path: Path):
    from packline.fingerprints import stage_fingerprint

    rows, schema = _rows("messages", _conversations())
    path = _write(tmp_path / "src" / "data" / "train.parquet", rows, schema)
    cfg = make_config(tmp_path / "w", f"data.source={tmp_path / 'src'}")
    before = stage_fingerprint(cfg, "prepare")
    assert stage_fingerprint(cfg, "prepare") == before
    _write(path, rows[:-1], schema)  # one row fewer
    assert stage_fingerprint(cfg, "prepare") != before


def test_bad_rows_are_rejected_with_reason_and_address(tmp_path: Path):
    convs = _conversations()
    rows, schema = _rows("conversations", convs)
    (tmp_path / "src" / "pics").mkdir(parents=True)
    (tmp_path / "src" / "pics" / "a.png").write_bytes(png_bytes((40, 40), "red"))
    turns = rows[0]["conversations"]
    rows += [
        {"id": "null", "conversations": turns, "images": [_struct(None)]},
        {"id": "garbage", "conversations": turns, "images": [_struct(b"not an image")]},
        {"id": "by-path", "conversations": turns, "images": [_struct(None, "pics/a.png")]},
        {"id": "missing", "conversations": turns, "images": [_struct(None, "pics/nope.png")]},
        {"id": "escape", "conversations": turns, "images": [_struct(None, "../outside.png")]},
        {"id": "no-turns", "conversations": None, "images": []},
        {"id": "c0", "conversations": turns, "images": [_struct(convs[0]["images"][0])]},
    ]
    path = _write(tmp_path / "src" / "mixed.parquet", rows, schema, row_group_size=5)
    before = _sha([path])
    result = prepare(make_config(tmp_path / "w", f"data.source={path}", *COMMON))
    rejects = [
        json.loads(line) for line in (result.out_dir / "rejects.jsonl").read_text().splitlines()
    ]
    by_id = {r["id"]: r for r in rejects}
    assert {i: r["reason"] for i, r in by_id.items()} == {
        "null": "image_null",
        "garbage": "image_unreadable",
        "missing": "missing_image",
        "escape": "image_path_unsafe",
        "no-turns": "missing_column",
        "c0": "duplicate_id",
    }
    # the reject names the file, row group and row; rejects.jsonl's line counts the rows
    assert by_id["null"]["detail"].startswith("mixed.parquet row group 1 row 1: ")
    assert by_id["null"]["line"] == 7
    assert "<12 embedded bytes>" in by_id["garbage"]["detail"]
    assert result.metrics["prepare/rows_accepted"] == 7  # six conversations and by-path
    assert _sha([path]) == before


def test_a_broken_file_or_an_unknown_layout_stops_prepare_naming_it(tmp_path: Path):
    rows, schema = _rows("conversations", _conversations())
    good = _write(tmp_path / "a" / "good.parquet", rows, schema)
    truncated = tmp_path / "a" / "truncated.parquet"
    truncated.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    with pytest.raises(UserError) as err:
        prepare(make_config(tmp_path / "w1", f"data.source={tmp_path / 'a'}", *COMMON))
    assert f"{truncated}: not a readable Parquet file" in str(err.value)

    other = pa.table({"prompt": ["hi"], "dialog": [[{"from": "human", "value": "hi"}]]})
    pq.write_table(other, tmp_path / "b.parquet")
    with pytest.raises(UserError) as err:
        prepare(make_config(tmp_path / "w2", f"data.source={tmp_path / 'b.parquet'}"))
    text = str(err.value)
    assert "has the columns ['dialog', 'prompt']" in text
    assert "fix: map the conversation column with data.columns, e.g. " in text
    assert "data.columns={conversations: dialog}" in text  # its list column, named
    assert not (tmp_path / "w2" / "prepare").exists()  # nothing half-published
    with pytest.raises(UserError, match=r"names \{'images': 'pics'\} but the file has no such"):
        prepare(
            make_config(
                tmp_path / "w3",
                f"data.source={tmp_path / 'b.parquet'}",
                "data.columns={conversations: dialog, images: pics}",
            )
        )


def test_columns_named_otherwise_are_mapped_and_a_system_prompt_goes_first(tmp_path: Path):
    convs = _conversations()
    rows, _ = _rows("conversations", convs)
    turn = pa.struct([("from", pa.string()), ("value", pa.string())])
    schema = pa.schema(
        [("uid", pa.string()), ("dialog", pa.list_(turn)), ("pictures", pa.list_(IMAGE)),
         ("sys", pa.string()), ("conversations", pa.string())]
    )  # fmt: skip
    mapped = [
        {"uid": r["id"], "dialog": r["conversations"], "pictures": r["images"],
         "sys": "Answer in one word.", "conversations": "not the conversation"}
        for r in rows
    ]  # fmt: skip
    path = _write(tmp_path / "src" / "mine.parquet", mapped, schema)
    result = prepare(
        make_config(
            tmp_path / "w",
            f"data.source={path}",
            "data.columns={id: uid, conversations: dialog, images: pictures, system: sys}",
            *COMMON,
        )
    )
    assert result.metrics["prepare/rows_rejected"] == 0
    import pandas as pd

    assert pd.read_parquet(result.out_dir / "manifest.parquet")["id"].tolist() == [
        c["id"] for c in convs
    ]
    folder = prepare(
        make_config(tmp_path / "w-folder", f"data.source={_folder(tmp_path, convs)}", *COMMON)
    )
    system = {"role": "system", "content": [{"type": "text", "text": "Answer in one word."}]}
    want = [
        (json.dumps([system, *json.loads(conv)], sort_keys=True), images)
        for conv, images in _samples(folder.out_dir)
    ]
    assert _samples(result.out_dir) == want


def _cli(home: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PACKLINE_WORK_LOCK")}
    env.update(HF_HOME=str(home), HF_HUB_OFFLINE="1")  # read at huggingface_hub's import
    return subprocess.run(
        [sys.executable, "-m", "pipelines.cli", *args],
        capture_output=True, text=True, env=env, cwd=PROJECT_ROOT, timeout=600,
    )  # fmt: skip


def test_a_hub_dataset_id_is_read_from_the_local_cache_with_its_splits(tmp_path: Path):
    """A dataset repo in a temp HF_HOME, in huggingface_hub's cache layout: its
    train/validation files give packline's splits; the_cauldron-style configs are
    subfolders (data.subset); a repo the cache lacks is refused with the command that
    fetches it, and data.download=true under HF_HUB_OFFLINE fails naming it too."""
    from tests.integration.test_hub import cache_repo

    rows, schema = _rows("texts", _conversations())

    def parquet(part: list[dict]) -> bytes:
        sink = pa.BufferOutputStream()
        pq.write_table(pa.Table.from_pylist(part, schema=schema), sink)
        return sink.getvalue().to_pybytes()

    home = tmp_path / "hf"
    cache_repo(
        home,
        "acme/cauldron",
        {
            "README.md": b"# a dataset card\n",
            "colours/train-00000-of-00001.parquet": parquet(rows[:4]),
            "colours/validation-00000-of-00001.parquet": parquet(rows[4:]),
            "other/train-00000-of-00001.parquet": parquet(rows[:1]),
        },
        kind="dataset",
    )
    work = tmp_path / "w"
    done = _cli(home, "stage", "prepare", f"work_dir={work}", "data.source=acme/cauldron",
                "data.subset=colours", "mlflow.enabled=false")  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    import pandas as pd

    manifest = pd.read_parquet(work / "prepare" / "manifest.parquet")
    assert manifest["split"].tolist() == ["train"] * 4 + ["val"] * 2
    assert manifest["id"].tolist()[-1] == "colours/validation-00000-of-00001-g0-r1"

    missing = _cli(home, "stage", "prepare", f"work_dir={tmp_path / 'w2'}", "data.source=acme/nope")
    assert missing.returncode == 2
    err = " ".join(missing.stderr.split())
    assert "fix: run `hf download --repo-type dataset acme/nope`" in err, err
    fetch = _cli(home, "stage", "prepare", f"work_dir={tmp_path / 'w3'}", "data.source=acme/nope",
                 "data.download=true")  # fmt: skip
    assert fetch.returncode == 2, fetch.stderr[-3000:]
    err = " ".join(fetch.stderr.split())
    assert "data.source acme/nope could not be downloaded" in err and "Traceback" not in err


def test_data_columns_names_are_checked_at_load(tmp_path: Path):
    from schemas.config import load_config

    rows, schema = _rows("texts", _conversations())
    path = _write(tmp_path / "a.parquet", rows, schema)
    with pytest.raises(UserError) as err:
        load_config(None, [f"data.source={path}", "data.columns={pictures: images}"])
    assert "data.columns: 'pictures' is none of packline's names" in str(err.value)
    with pytest.raises(UserError) as err:
        load_config(None, ["data.columns={images: pics}"])  # the built-in set
    assert "data.columns maps the columns of a Parquet or Arrow source only" in str(err.value)


def test_the_shards_are_the_same_bytes_for_one_and_two_workers(tmp_path: Path):
    rows, schema = _rows("messages", _conversations() * 4)
    for k, row in enumerate(rows):
        row["id"] = f"{row['id']}-{k}"
    source = _write(tmp_path / "src" / "train.parquet", rows, schema, row_group_size=5)
    outs = []
    for workers in (1, 2):
        cfg = make_config(
            tmp_path / f"w{workers}", f"data.source={source}", f"prepare.num_workers={workers}",
            "prepare.samples_per_shard=7", "prepare.val_fraction=0.25",
        )  # fmt: skip
        outs.append(prepare(cfg).out_dir)
    names = sorted(p.name for p in outs[0].glob("*.tar"))
    assert len(names) > 2 and names == sorted(p.name for p in outs[1].glob("*.tar"))
    for name in [*names, "manifest.parquet", "rejects.jsonl"]:
        assert (outs[0] / name).read_bytes() == (outs[1] / name).read_bytes(), name


def _save_to_disk(root: Path, splits: dict[str, list[dict]], schema: pa.Schema) -> Path:
    """A DatasetDict as ``datasets``' ``save_to_disk`` lays it out: ``dataset_dict.json``,
    a folder per split with its ``state.json`` and Arrow IPC stream files (batches of 2)."""
    root.mkdir(parents=True)
    (root / "dataset_dict.json").write_text(json.dumps({"splits": list(splits)}))
    for split, rows in splits.items():
        (root / split).mkdir()
        name = "data-00000-of-00001.arrow"
        with pa.OSFile(str(root / split / name), "wb") as sink:
            with pa.ipc.new_stream(sink, schema) as writer:
                for start in range(0, len(rows), 2):
                    writer.write_table(pa.Table.from_pylist(rows[start : start + 2], schema=schema))
        state = {"_data_files": [{"filename": name}], "_split": split, "_fingerprint": "0"}
        (root / split / "state.json").write_text(json.dumps(state))
        (root / split / "dataset_info.json").write_text("{}")
    return root


def _lengths(cfg) -> list[tuple]:
    """connect's lengths of every sample, in the manifest's order, keys aside."""
    import pandas as pd

    from stages.connect import connect

    lengths = pd.read_parquet(connect(cfg).out_dir / "lengths.parquet")
    keys = pd.read_parquet(cfg.work_path / "prepare" / "manifest.parquet")["key"].tolist()
    by_key = lengths.set_index("key")
    columns = ["split", "text_tokens", "image_tokens", "total_tokens", "loss_tokens", "image_grids"]
    return [tuple(by_key.loc[key, columns]) for key in keys]


def test_a_save_to_disk_folder_gives_the_folder_samples_splits_and_lengths(tmp_path: Path):
    convs = _conversations()
    splits = "prepare.val_fraction=0", "prepare.max_reject_fraction=0"
    folder_cfg = make_config(tmp_path / "w-folder", f"data.source={_folder(tmp_path, convs)}")
    rows, schema = _rows("texts", convs)  # no ids: the rows get theirs from their address
    for row, conv in zip(rows, convs, strict=True):
        row["split"] = "val" if conv["id"] in ("c4", "c5") else "train"
    folder_rows = (folder_cfg.data.source + "/conversations.jsonl",)
    for path in folder_rows:  # the same splits in the folder's rows
        lines = [json.loads(line) for line in Path(path).read_text().splitlines()]
        for line in lines:
            line["split"] = "val" if line["id"] in ("c4", "c5") else "train"
        Path(path).write_text("".join(json.dumps(line) + "\n" for line in lines))
    folder = prepare(folder_cfg)
    schema = schema.append(pa.field("split", pa.string()))
    arrow = _save_to_disk(tmp_path / "saved", {"train": rows[:4], "validation": rows[4:]}, schema)
    arrow_cfg = make_config(tmp_path / "w", f"data.source={arrow}", *splits)
    result = prepare(arrow_cfg)
    assert result.summary["source_kind"] == "arrow"
    assert _samples(result.out_dir) == _samples(folder.out_dir)
    import pandas as pd

    manifest = pd.read_parquet(result.out_dir / "manifest.parquet")
    assert manifest["split"].tolist() == ["train"] * 4 + ["val"] * 2  # the folders' splits
    assert manifest["id"].tolist()[0] == "train/data-00000-of-00001-g0-r0"
    # connect measures the same lengths (keys aside) from either
    assert _lengths(arrow_cfg) == _lengths(folder_cfg)
    # a bad row's address names its batch
    rows, schema = _rows("messages", convs)
    rows[1]["images"] = [_struct(None)] * len(rows[1]["images"])
    broken = _save_to_disk(tmp_path / "saved2", {"train": rows}, schema)
    result = prepare(make_config(tmp_path / "w2", f"data.source={broken}", *COMMON))
    reject = json.loads((result.out_dir / "rejects.jsonl").read_text())
    assert reject["reason"] == "image_null"
    assert reject["detail"].startswith("data-00000-of-00001.arrow batch 0 row 1: ")


def test_several_jsonl_files_by_glob_read_each_rows_media_beside_its_file(tmp_path: Path):
    convs = _conversations()
    whole = _folder(tmp_path, convs)
    expected = _samples(
        prepare(make_config(tmp_path / "w-folder", f"data.source={whole}", *COMMON)).out_dir
    )
    lines = (whole / "conversations.jsonl").read_text().splitlines()
    for name, part in (("a", lines[:4]), ("b", lines[4:])):
        shutil.copytree(whole / "img", tmp_path / "parts" / name / "img")
        (tmp_path / "parts" / name / "rows.jsonl").write_text("\n".join(part) + "\n")
    bad = json.dumps({"id": "gone", "images": ["img/gone.png"], "conversations": [
        {"role": "user", "content": "?"}, {"role": "assistant", "content": "!"}]})  # fmt: skip
    with (tmp_path / "parts" / "b" / "rows.jsonl").open("a") as f:
        f.write(bad + "\n")
    pattern = tmp_path / "parts" / "*" / "rows.jsonl"
    result = prepare(make_config(tmp_path / "w", f"data.source={pattern}", *COMMON))
    assert result.summary["source_kind"] == "jsonl"
    assert _samples(result.out_dir) == expected
    reject = json.loads((result.out_dir / "rejects.jsonl").read_text())
    assert reject["reason"] == "missing_image" and reject["line"] == 7
    assert reject["detail"].startswith("rows.jsonl line 3: ")
    one = tmp_path / "parts" / "a" / "rows.jsonl"
    by_name = prepare(make_config(tmp_path / "w1", f"data.source={one}", *COMMON))
    assert _samples(by_name.out_dir) == expected[:4]
