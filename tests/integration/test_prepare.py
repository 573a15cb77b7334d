from __future__ import annotations

import json
import tarfile
from pathlib import Path

import pandas as pd
import pytest
from megatron.energon import WorkerConfig, get_loader, get_train_dataset
from PIL import Image

from packline.conversations import Rejected, parse_row
from packline.energon.sample import ConversationReader
from packline.media.video import VideoHeader, probe_video, write_video
from packline.qwen.processor import copy_tiny_processor, image_geometry, video_geometry
from packline.qwen.vision import VideoGeometry
from packline.rows import video_limits
from pipelines.cli import main
from stages.prepare import prepare
from tests.conftest import make_config
from tests.integration.video_folder import (
    VIDEO_LIMITS,
    decodable_frames,
    make_video_folder,
    moving_square,
)


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
    result = prepare(cfg)
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


# --- videos ---------------------------------------------------------------------------------


def _video_prepare(tmp_path: Path):
    vf = make_video_folder(tmp_path)
    cfg = make_config(
        tmp_path / "work",
        f"data.source={vf.folder}",
        "prepare.val_fraction=0",
        "prepare.max_reject_fraction=1.0",
        *VIDEO_LIMITS,
    )
    return vf, prepare(cfg)


def _shard_members(out: Path) -> dict[str, bytes]:
    members: dict[str, bytes] = {}
    for shard in sorted(out.glob("*.tar")):
        with tarfile.open(shard) as tar:
            for info in tar.getmembers():
                members[info.name] = tar.extractfile(info).read()
    return members


def test_prepare_keeps_good_video_rows_and_rejects_each_bad_video_kind(tmp_path: Path):
    vf, result = _video_prepare(tmp_path)
    out = result.out_dir

    rejects = {
        r["id"]: r for r in map(json.loads, (out / "rejects.jsonl").read_text().splitlines())
    }
    assert {rid: r["reason"] for rid, r in rejects.items()} == {
        rid: reason for rid, (reason, _) in vf.bad.items()
    }
    for rid, (_, detail) in vf.bad.items():
        assert detail in rejects[rid]["detail"], (rid, rejects[rid]["detail"])
    m = result.metrics
    assert m["prepare/rejected_video_path_unsafe"] == 2
    assert m["prepare/rejected_video_unreadable"] == 2
    for reason in ("missing_video", "video_too_short", "too_many_videos", "too_many_frames"):
        assert m[f"prepare/rejected_{reason}"] == 1
    assert m["prepare/rejected_video_too_long"] == m["prepare/rejected_marker_count_mismatch"] == 1

    manifest = pd.read_parquet(out / "manifest.parquet").set_index("id")
    assert set(manifest.index) == set(vf.good)
    for rid, videos in vf.good.items():
        row = manifest.loc[rid]
        assert row["num_videos"] == len(videos)
        assert row["video_frames"] == sum(frames for _, frames in videos)
        assert row["video_bytes"] == sum((vf.folder / p).stat().st_size for p, _ in videos)
    assert manifest.loc["v_mixed", "num_images"] == 1
    assert m["prepare/videos"] == 11
    assert m["prepare/video_frames"] == manifest["video_frames"].sum()
    assert m["prepare/video_bytes"] == manifest["video_bytes"].sum()
    # Counted from the decoded frames: Matroska, WebM (no count in the header), the cut file.
    assert m["prepare/video_frames_counted"] == 3
    assert m["prepare/video_rotated"] == 1
    assert m["prepare/video_variable_rate"] == 1

    # The shards hold each video's original bytes and, in the JSON, its probed header.
    members = _shard_members(out)
    for rid, videos in vf.good.items():
        key = manifest.loc[rid, "key"]
        doc = json.loads(members[f"{key}.json"])
        assert [h["num_frames"] for h in doc["videos"]] == [f for _, f in videos]
        for k, (path, _) in enumerate(videos):
            ext = Path(path).suffix.lstrip(".")
            assert members[f"{key}.vid{k}.{ext}"] == (vf.folder / path).read_bytes()
            assert doc["videos"][k] == probe_video(vf.folder / path).to_dict()
    assert "v_mp4.vid0.mp4" in members
    rotated = VideoHeader.from_dict(json.loads(members["v_rot.json"])["videos"][0])
    assert (rotated.rotation, rotated.width, rotated.height) == (90, 48, 64)
    mkv = VideoHeader.from_dict(json.loads(members["v_mkv.json"])["videos"][0])
    assert mkv.counted and mkv.num_frames == 10
    # Cut short: the decoded count, never the 20 frames the header announces.
    path, announced = vf.truncated
    cut = VideoHeader.from_dict(json.loads(members["v_cut.json"])["videos"][0])
    decoded = decodable_frames((vf.folder / path).read_bytes())
    assert 0 < decoded < announced
    assert (cut.num_frames, cut.counted, cut.announced_frames) == (decoded, True, announced)
    assert cut.duration == decoded / cut.fps

    # Energon's loader gives the bytes back as ConversationSample.videos, in order.
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
    by_id = {s.sample_id: s for batch in get_loader(ds) for s in batch}
    assert set(by_id) == set(vf.good)
    for rid, videos in vf.good.items():
        sample = by_id[rid]
        assert sample.videos == [(vf.folder / p).read_bytes() for p, _ in videos]
        assert [h["num_frames"] for h in sample.video_headers] == [f for _, f in videos]
    assert by_id["v_mp4"].images == []
    user = {rid: s.conversation[0]["content"] for rid, s in by_id.items()}
    assert user["v_mp4"][0] == {"type": "video"}
    # No marker: the video before the user's text.
    assert user["v_mkv"] == [{"type": "video"}, {"type": "text", "text": "Which way does it move?"}]
    assert [p["type"] for p in user["v_mixed"]] == ["video", "text", "image", "text"]
    assert len(by_id["v_mixed"].images) == 1 and len(by_id["v_mixed"].videos) == 1
    assert [p["type"] for p in user["v_parts"]] == ["video", "text", "video", "text"]


def _parse(row: dict, folder: Path, cfg):
    """``parse_row`` of one row under ``cfg``'s geometry and limits, up to 8 images."""
    return parse_row(
        json.dumps(row),
        folder,
        geometry=image_geometry(cfg),
        max_images=8,
        val_fraction=0.0,
        videos=video_limits(cfg),
        max_text_chars=cfg.prepare.max_text_chars,
    )


def test_video_rows_without_markers_go_after_the_images_before_the_user_text(tmp_path: Path):
    folder = tmp_path / "data"
    (folder / "img").mkdir(parents=True)
    Image.new("RGB", (64, 64), "red").save(folder / "img" / "red.png")
    write_video(folder / "a.mp4", moving_square(10), 4.0)
    row = {
        "id": "nomarkers",
        "images": ["img/red.png"],
        "videos": ["a.mp4"],
        "conversations": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Same colour?"},
            {"role": "assistant", "content": "no"},
        ],
    }
    cfg = make_config(tmp_path / "work")
    parsed = _parse(row, folder, cfg)
    assert parsed.conversation[1]["content"] == [
        {"type": "image"},
        {"type": "video"},
        {"type": "text", "text": "Same colour?"},
    ]
    assert parsed.videos[0].ext == "mp4" and parsed.videos[0].header.num_frames == 10
    doc = json.loads(parsed.sample_json())
    assert doc["videos"] == [parsed.videos[0].header.to_dict()]
    # A text-only row's document still says it has no videos.
    row = {"id": "t", "conversations": row["conversations"]}
    text_only = _parse(row, folder, cfg)
    assert json.loads(text_only.sample_json())["videos"] == []


def test_video_geometry_is_the_tiny_processors_and_a_processor_dirs_own(tmp_path: Path):
    tiny = copy_tiny_processor(tmp_path / "tiny")
    saved = json.loads((tiny / "video_preprocessor_config.json").read_text())
    cfg = make_config(tmp_path / "work")
    assert video_geometry(cfg) == VideoGeometry.from_config(saved)
    # A processor dir: its own sampling; the config's patch sizes, not its pixel bounds.
    saved.update(fps=4, min_frames=2)
    (tiny / "video_preprocessor_config.json").write_text(json.dumps(saved))
    cfg = make_config(
        tmp_path / "work",
        f"processor.path={tiny}",
        "processor.temporal_patch_size=4",
        "processor.max_pixels=8192",
    )
    geometry = video_geometry(cfg)
    assert (geometry.fps, geometry.min_frames, geometry.temporal_patch_size) == (4.0, 2, 4)
    assert geometry.max_pixels == saved["size"]["longest_edge"]


def test_a_messages_row_reads_as_its_conversations_form(tmp_path: Path):
    """The HF/OpenAI chat layout: media named in the parts, placed where they stand, the
    same row as the ``conversations`` form with ``images`` / ``videos`` beside it."""
    folder = tmp_path / "data"
    (folder / "img").mkdir(parents=True)
    Image.new("RGB", (64, 64), "red").save(folder / "img" / "red.png")
    write_video(folder / "a.mp4", moving_square(10), 4.0)
    cfg = make_config(tmp_path / "work")

    def parse(row: dict):
        return _parse(row, folder, cfg)

    messages = {
        "id": "m",
        "messages": [
            {"role": "user", "content": [
                {"type": "text", "text": "Is"},
                {"type": "image_url", "image_url": {"url": "img/red.png"}},
                {"type": "text", "text": "in"},
                {"type": "video", "video": "a.mp4"},
                {"type": "text", "text": "?"},
            ]},
            {"role": "assistant", "content": [{"type": "text", "text": "yes"}]},
        ],
    }  # fmt: skip
    conversations = {
        "id": "m",
        "images": ["img/red.png"],
        "videos": ["a.mp4"],
        "conversations": [
            {"role": "user", "content": "Is<image>in<video>?"},
            {"role": "assistant", "content": "yes"},
        ],
    }
    got, same = parse(messages), parse(conversations)
    assert got.conversation == same.conversation
    assert got.sample_json() == same.sample_json()
    assert [p["type"] for p in got.conversation[0]["content"]] == [
        "text", "image", "text", "video", "text"
    ]  # fmt: skip
    remote = {**messages, "id": "r"}
    remote["messages"][0]["content"][1] = {"type": "image", "url": "https://x.org/a.png"}
    with pytest.raises(Rejected, match="no URLs"):
        parse(remote)
    with pytest.raises(Rejected, match="no .conversations., .images. or .videos. beside it"):
        parse({**messages, "images": ["img/red.png"]})
