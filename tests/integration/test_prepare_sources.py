"""prepare over its row sources: a LLaVA-style JSON file gives what the folder format gives,
the output is the same for any worker count, and memory does not grow with the rows."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from packline.bench.processes import WorkerRss
from stages.prepare import prepare
from tests.conftest import make_config, png_bytes
from tests.integration.test_prepare import make_folder
from tests.integration.video_folder import make_video_folder


def _tar_members(path: Path) -> list[tuple[str, bytes]]:
    with tarfile.open(path) as tar:
        return [(m.name, tar.extractfile(m).read()) for m in tar.getmembers()]


def _shards(out: Path) -> dict[str, list[tuple[str, bytes]]]:
    return {p.name: _tar_members(p) for p in sorted(out.glob("*.tar"))}


def _as_llava(folder: Path) -> Path:
    """The folder's rows as one LLaVA-style JSON list next to its media: a single image as
    ``image``, several as ``images``; the line that is not JSON becomes a record that is not
    an object (a JSON list cannot hold broken JSON)."""
    records = []
    for line in (folder / "conversations.jsonl").read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            records.append("not a record")
            continue
        if len(record.get("images", [])) == 1:
            record["image"] = record.pop("images")[0]
        records.append(record)
    path = folder / "llava_mix.json"
    path.write_text(json.dumps(records, indent=1))
    return path


def test_llava_json_gives_the_folder_outcome_with_each_bad_kind(tmp_path: Path):
    folder, reasons = make_folder(tmp_path)
    llava = _as_llava(folder)
    assert "'image':" in repr(json.loads(llava.read_text())[2])  # the single-image form
    common = ("prepare.val_fraction=0", "prepare.max_images=2", "prepare.max_reject_fraction=1")
    by_folder = prepare(make_config(tmp_path / "a", f"data.source={folder}", *common))
    by_llava = prepare(make_config(tmp_path / "b", f"data.source={llava}", *common))

    rejects = [
        json.loads(r) for r in (by_llava.out_dir / "rejects.jsonl").read_text().split("\n")[:-1]
    ]
    assert {r["id"]: r["reason"] for r in rejects} == reasons
    assert by_llava.metrics["prepare/rows_accepted"] == 10
    assert by_llava.summary["source_kind"] == "llava"
    assert (by_llava.out_dir / "manifest.parquet").read_bytes() == (
        by_folder.out_dir / "manifest.parquet"
    ).read_bytes()
    folder_rejects = (by_folder.out_dir / "rejects.jsonl").read_text().split("\n")[:-1]
    # the same records, but the non-object's detail (broken JSON in the folder, a string here)
    assert rejects[:-1] == [json.loads(r) for r in folder_rejects][:-1]
    assert rejects[-1]["reason"] == "malformed_json" and "got str" in rejects[-1]["detail"]
    assert _shards(by_llava.out_dir) == _shards(by_folder.out_dir)
    assert {k: v for k, v in by_llava.metrics.items()} == by_folder.metrics


def test_llava_media_dir_and_a_broken_file(tmp_path: Path):
    media = tmp_path / "coco"
    media.mkdir()
    (media / "a.png").write_bytes(png_bytes((64, 64), "red"))
    turns = [{"from": "human", "value": "<image>\nColour?"}, {"from": "gpt", "value": "red"}]
    records = [{"id": i, "image": "a.png", "conversations": turns} for i in range(4)]
    good = tmp_path / "json" / "mix.json"
    good.parent.mkdir()
    good.write_text(json.dumps(records))
    result = prepare(make_config(tmp_path / "w1", f"data.source={good}", f"data.media_dir={media}"))
    assert result.metrics["prepare/rows_accepted"] == 4

    broken = tmp_path / "json" / "broken.json"
    broken.write_text(json.dumps(records)[:-30])
    from schemas.errors import UserError

    with pytest.raises(UserError, match="broken JSON after record 3"):
        prepare(make_config(tmp_path / "w2", f"data.source={broken}", f"data.media_dir={media}"))


def test_prepare_output_is_the_same_for_one_and_two_workers(tmp_path: Path):
    images, _ = make_folder(tmp_path)
    folder = make_video_folder(tmp_path).folder  # videos too: headers probed in the workers
    shutil.copytree(images / "img", folder / "photos")
    lines = (images / "conversations.jsonl").read_text().replace("img/", "photos/").splitlines()
    lines += (folder / "conversations.jsonl").read_text().splitlines()
    # more rows than one worker task holds, over several shards
    for copy in range(3):
        lines += [line.replace('"id": "good', f'"id": "copy{copy}-good') for line in lines[:10]]
    (folder / "conversations.jsonl").write_text("\n".join(lines) + "\n")
    outs = []
    for workers in (1, 2):
        cfg = make_config(
            tmp_path / f"w{workers}",
            f"data.source={folder}",
            f"prepare.num_workers={workers}",
            "prepare.samples_per_shard=7",
            "prepare.max_images=2",
            "prepare.max_reject_fraction=1",
            "prepare.val_fraction=0.2",
            "train.backend=megatron",  # Bridge's pre-sampled frames, made in the workers
        )
        outs.append(prepare(cfg))
    one, two = (r.out_dir for r in outs)
    assert outs[0].metrics == outs[1].metrics
    assert outs[0].metrics["prepare/shards"] >= 6 and outs[0].metrics["prepare/bridge_frames"] > 0
    for name in ("manifest.parquet", "rejects.jsonl"):
        assert (one / name).read_bytes() == (two / name).read_bytes(), name
    tars = sorted(p.name for p in one.glob("*.tar*"))
    assert tars == sorted(p.name for p in two.glob("*.tar*"))
    for name in tars:
        assert (one / name).read_bytes() == (two / name).read_bytes(), name


def _llava_set(root: Path, num_rows: int) -> Path:
    """``num_rows`` LLaVA records over eight small images (cheap to check)."""
    root.mkdir(parents=True)
    colours = ["red", "green", "blue", "yellow", "purple", "orange", "white", "black"]
    for i, colour in enumerate(colours):
        (root / f"{i}.png").write_bytes(png_bytes((48 + 8 * i, 64), colour))
    with (root / "mix.json").open("w") as f:
        f.write("[")
        for i in range(num_rows):
            k = i % len(colours)
            turns = [
                {"from": "human", "value": f"<image>\nWhat colour is the disc, {i}?"},
                {"from": "gpt", "value": colours[k]},
            ]
            f.write(
                ("," if i else "")
                + json.dumps({"id": i, "image": f"{k}.png", "conversations": turns})
            )
        f.write("]")
    return root / "mix.json"


def _peak_prepare_mib(tmp_path: Path, num_rows: int) -> float:
    source = _llava_set(tmp_path / f"data{num_rows}", num_rows)
    cmd = [
        sys.executable, "-m", "pipelines.cli", "stage", "prepare",
        f"work_dir={tmp_path / f'work{num_rows}'}", f"data.source={source}",
        "prepare.samples_per_shard=500", "mlflow.enabled=false",
    ]  # fmt: skip
    with WorkerRss(interval_s=0.02) as rss:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    return rss.peak_mb


@pytest.mark.slow
def test_prepare_memory_does_not_grow_with_the_rows(tmp_path: Path):
    small = _peak_prepare_mib(tmp_path, 2000)
    large = _peak_prepare_mib(tmp_path, 8000)
    print(f"peak RSS of prepare (process tree): 2,000 rows {small:.0f} MiB, 8,000 {large:.0f}")
    assert abs(large - small) / small < 0.10, (small, large)
