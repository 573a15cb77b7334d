from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
from megatron.energon import WorkerConfig, get_loader, get_train_dataset
from PIL import Image

from packline.energon.sample import ConversationReader
from pipelines.cli import main
from stages.prepare import prepare_dataset
from tests.conftest import make_config


def _png(path: Path, size: tuple[int, int], colour: str = "red") -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, colour).save(path)
    return path.name


def _row(rid: str, images: list[str], text: str = "<image>\nWhat colour?", **extra) -> str:
    conv = [{"role": "user", "content": text}, {"role": "assistant", "content": "red"}]
    return json.dumps({"id": rid, "images": images, "conversations": conv, **extra})


def make_folder(root: Path) -> tuple[Path, dict[str, str]]:
    """10 good rows, then one row of each bad kind; returns (folder, {bad id: reason})."""
    folder = root / "data"
    for i in range(10):
        _png(folder / "img" / f"good{i}.png", (64 + 16 * i, 96))
    _png(root / "outside.png", (64, 64))
    (folder / "img" / "garbage.png").write_bytes(b"\x89PNG\r\n\x1a\n not really a png")
    _png(folder / "img" / "sliver.png", (402, 2))  # aspect 201 > 200: the resize rule refuses it
    good = []
    for i in range(10):
        if i == 0:  # LLaVA form, no marker: the image goes before the first user text
            conv = [{"from": "human", "value": "What colour?"}, {"from": "gpt", "value": "red"}]
            good.append(
                json.dumps({"id": "good0", "images": ["img/good0.png"], "conversations": conv})
            )
        elif i == 1:  # text only, with a system turn
            conv = [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "How many sides has a square?"},
                {"role": "assistant", "content": "4"},
            ]
            good.append(json.dumps({"id": "good.1/x", "conversations": conv}))
        else:
            good.append(_row(f"good{i}", [f"img/good{i}.png"]))
    bad = {
        "missing": ("missing_image", _row("missing", ["img/nope.png"])),
        "garbage": ("image_unreadable", _row("garbage", ["img/garbage.png"])),
        "absolute": ("image_path_unsafe", _row("absolute", [str(folder / "img" / "good2.png")])),
        "escape": ("image_path_unsafe", _row("escape", ["../outside.png"])),
        "good3": ("duplicate_id", _row("good3", ["img/good3.png"])),
        "markers": (
            "marker_count_mismatch",
            _row("markers", ["img/good4.png"], "<image><image> hi"),
        ),
        "sliver": ("image_size_refused", _row("sliver", ["img/sliver.png"])),
        "many": (
            "too_many_images",
            _row("many", ["img/good5.png"] * 3, "<image><image><image> count?"),
        ),
        "noassist": (
            "no_assistant_turn",
            json.dumps({"id": "noassist", "conversations": [{"role": "user", "content": "hi"}]}),
        ),
        "role": (
            "unknown_role",
            json.dumps(
                {
                    "id": "role",
                    "conversations": [
                        {"role": "user", "content": "hi"},
                        {"role": "robot", "content": "beep"},
                    ],
                }
            ),
        ),
        "noconv": ("malformed", json.dumps({"id": "noconv"})),
    }
    lines = good + [line for _, line in bad.values()] + ["{this is not json"]
    (folder / "conversations.jsonl").write_text("\n".join(lines) + "\n")
    reasons = {rid: reason for rid, (reason, _) in bad.items()}
    reasons[None] = "malformed_json"
    return folder, reasons


def test_prepare_keeps_good_rows_and_rejects_each_bad_kind_with_reason(tmp_path: Path):
    folder, reasons = make_folder(tmp_path)
    cfg = make_config(
        tmp_path / "work",
        f"data.source={folder}",
        "prepare.val_fraction=0",
        "prepare.max_images=2",
        "prepare.max_reject_fraction=1.0",
    )
    result = prepare_dataset(cfg)
    out = result.out_dir

    rejects = [json.loads(line) for line in (out / "rejects.jsonl").read_text().splitlines()]
    assert {r["id"]: r["reason"] for r in rejects} == reasons
    assert result.metrics["prepare/rows_total"] == 22
    assert result.metrics["prepare/rows_accepted"] == 10
    assert result.metrics["prepare/rows_rejected"] == 12
    assert result.metrics["prepare/rejected_image_path_unsafe"] == 2

    manifest = pd.read_parquet(out / "manifest.parquet")
    good_ids = {"good0", "good.1/x"} | {f"good{i}" for i in range(2, 10)}
    assert set(manifest["id"]) == good_ids
    unsafe_key = manifest.loc[manifest["id"] == "good.1/x", "key"].item()
    assert unsafe_key.startswith("h") and "." not in unsafe_key

    assert (out / ".nv-meta" / "index.sqlite").is_file()
    assert (out / ".nv-meta" / "dataset.yaml").is_file()
    ds = get_train_dataset(
        out,
        split_part="train",
        worker_config=WorkerConfig(rank=0, world_size=1, num_workers=0),
        batch_size=1,
        shuffle_buffer_size=None,
        max_samples_per_sequence=None,
        task_encoder=ConversationReader(),
        repeat=False,
    )
    samples = [s for batch in get_loader(ds) for s in batch]
    keys = [s.__key__ for s in samples]
    assert sorted(keys) == sorted(manifest["key"])  # each key exactly once
    by_id = {s.sample_id: s for s in samples}
    # LLaVA row without a marker: the image part stands before the user's text.
    assert by_id["good0"].conversation[0]["content"][0] == {"type": "image"}
    assert by_id["good0"].conversation[1]["role"] == "assistant"
    assert len(by_id["good0"].images) == 1
    assert by_id["good.1/x"].images == []
    with Image.open(folder / "img" / "good7.png") as img:
        expected = img.tobytes()
    import io

    assert Image.open(io.BytesIO(by_id["good7"].images[0])).tobytes() == expected


def test_prepare_fails_with_exit_2_when_rejects_exceed_the_limit(tmp_path: Path, capsys):
    folder, _ = make_folder(tmp_path)
    code = main(
        [
            "stage",
            "prepare",
            f"work_dir={tmp_path / 'work'}",
            f"data.source={folder}",
            "prepare.max_images=2",
            "prepare.max_reject_fraction=0.2",
            "mlflow.enabled=false",
        ]
    )
    err = capsys.readouterr().err
    assert code == 2
    assert "12 of 22 rows rejected (54.5%) exceeds prepare.max_reject_fraction=0.2" in err
    assert "Traceback" not in err
    assert not (tmp_path / "work" / "prepare" / "_COMPLETE.json").exists()
    assert len((tmp_path / "work" / "prepare.rejects.jsonl").read_text().splitlines()) == 12
