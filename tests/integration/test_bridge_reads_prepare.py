"""Megatron-Bridge's own data code reads what prepare writes, and trains on connect's lengths.

Bridge's data-path modules from the pinned wheel, unchanged (``tests/bridge_data.py``), run in a
subprocess (``tests/integration/bridge_read.py``): its ``ChatMLWebdataset`` loads every sample
of both splits through ``<work>/prepare/bridge.yaml``, its builder makes the Qwen-VL encoder
from packline's overrides, and its encoder gives each sample's sequence. For
``train.backend: megatron`` connect must have measured exactly that: the same length, loss
tokens, image grids, video grids and video tokens, for every sample — on the built-in set
(text-only, one-, two- and three-image rows, video rows), on a user folder whose ``<image>``
markers stand in mid-text, which Bridge's encoder moves before the text, and on a user
folder of video rows (an odd frame count, a rotated clip, a video beside an image, two
videos, a clip cut by a low ``max_num_frames``). Each video reaches Bridge's encoder as the
frames packline's own sampler picks, pixel for pixel. And an Energon dataset already in
Bridge's ChatML layout, adopted in place, reads through ``bridge.yaml`` as exactly the
samples prepare accepted.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from PIL import Image

from packline.catalog import BRIDGE_VIDEOS, dataset_dir, processor_dir
from packline.conversations import key_for_id
from packline.media.video import decode_frames, probe_video, write_video
from packline.megatron.overrides import bridge_overrides
from packline.packing.forecast import simulate_packing
from packline.qwen.processor import copy_tiny_processor, video_geometry
from packline.rules.data import DATA_RULES
from packline.rules.inputs import load_inputs
from packline.sources import resolve_source
from stages.connect import connect
from stages.prepare import prepare
from stages.validate import upstream
from tests.bridge_data import PLACEHOLDERS, bridge_data_tree
from tests.bridge_source import IndexUnreachable
from tests.conftest import make_config
from tests.integration.chatml_dataset import adopt, file_stats, write_chatml_dataset

ROOT = Path(__file__).resolve().parents[2]
MEGATRON = (
    "train.backend=megatron",
    # Bridge's own dataset config and packer (its FFD bins are checked against the forecast);
    # packline's packer in Bridge: test_bridge_packline_dataset.py
    "packing.packer=bridge",
    "packing.max_carry_rounds=0",
    "packing.algorithm=ffd",
    "mlflow.enabled=false",
    "lora.target_modules=[q_proj,k_proj,v_proj,o_proj]",
)

pytestmark = pytest.mark.slow


def _tree() -> Path:
    try:
        return bridge_data_tree()
    except IndexUnreachable as exc:
        pytest.skip(f"cannot download the pinned Megatron-Bridge wheels from the index: {exc}")


def _bridge_read(cfg, tmp_path: Path) -> dict:
    """Bridge's view of every sample, and its FFD bins per buffer (see bridge_read.py)."""
    tree = _tree()
    overrides = tmp_path / "overrides.json"
    overrides.write_text(json.dumps(bridge_overrides(cfg)))
    out = tmp_path / "bridge.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree), str(ROOT)])}
    result = subprocess.run(
        [sys.executable, str(ROOT / "tests/integration/bridge_read.py"), str(overrides), str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(out.read_text())


def _source_images(folder: Path) -> dict[str, list[list]]:
    """key → [width, height, sha1 of the RGB pixels] of each image, in the row's order."""
    out = {}
    for line in (folder / "conversations.jsonl").read_text().splitlines():
        if not line.strip():
            continue
        row = json.loads(line)
        images = []
        for rel in row.get("images") or []:
            with Image.open(folder / rel) as img:
                rgb = img.convert("RGB")
                images.append([*rgb.size, hashlib.sha1(rgb.tobytes()).hexdigest()])
        out[key_for_id(str(row["id"]))] = images
    return out


def _source_videos(folder: Path, cfg) -> dict[str, list[list]]:
    """key → [frames, width, height, sha1 over the frames' RGB pixels] of each video, in the
    row's order: the frames the configured processor samples from the file, decoded upright."""
    geometry = video_geometry(cfg)
    out = {}
    for line in (folder / "conversations.jsonl").read_text().splitlines():
        if not line.strip():
            continue
        row = json.loads(line)
        videos = []
        for rel in row.get("videos") or []:
            data = (folder / rel).read_bytes()
            h = probe_video(data)
            frames = decode_frames(
                data, geometry.sample_indices(h.num_frames, h.fps), rotation=h.rotation
            )
            digest = hashlib.sha1()
            for frame in frames:
                digest.update(frame.tobytes())
            videos.append([len(frames), h.width, h.height, digest.hexdigest()])
        out[key_for_id(str(row["id"]))] = videos
    return out


def _check(cfg, tmp_path: Path, source: Path) -> tuple[pd.DataFrame, dict[str, dict]]:
    bridge_out = _bridge_read(cfg, tmp_path)
    seen = bridge_out["samples"]
    lengths = pd.read_parquet(cfg.work_path / "connect" / "lengths.parquet")
    manifest = pd.read_parquet(cfg.work_path / "prepare" / "manifest.parquet")
    assert set(seen) == set(manifest["key"]) == set(lengths["key"])
    assert {s["sample_type"] for s in seen.values()} == {"ChatMLSample"}
    expected_images = _source_images(source)
    expected_videos = _source_videos(source, cfg)
    for row in lengths.itertuples():
        bridge = seen[row.key]
        assert bridge["split"] == row.split, row.key
        # images arrive in order, as the source row lists them (exact pixels); each video as
        # the frames packline's sampler picks from the file (exact pixels, upright)
        assert bridge["images"] == expected_images[row.key], row.key
        assert bridge["videos"] == expected_videos[row.key], row.key
        assert bridge["length"] == row.total_tokens, row.key
        assert bridge["loss_tokens"] == row.loss_tokens, row.key
        assert bridge["image_grids"] == json.loads(row.image_grids), row.key
        assert bridge["video_grids"] == json.loads(row.video_grids), row.key
        assert bridge["video_tokens"] == row.video_tokens, row.key
    # Bridge's first_fit_decreasing over those lengths and the forecast simulator, buffer by
    # buffer in Energon's stream order: the same packs (alignment 1 here)
    buffer_size = bridge_out["buffer_size"]
    assert buffer_size == cfg.packing.packing_buffer_size
    stream = [seen[k]["length"] for k in bridge_out["train_order"]]
    forecast = simulate_packing(
        stream,
        capacity=cfg.packing.seq_length,
        buffer_size=buffer_size,
        algorithm="ffd",
        backend="megatron",
    )
    bridge_bins = bridge_out["ffd_bins"]
    assert forecast.packs_per_round == [len(b) for b in bridge_bins]
    simulated = [sorted(sorted(stream[i] for i in g) for g in r.groups) for r in forecast.rounds]
    assert simulated == [sorted(sorted(b) for b in bins) for bins in bridge_bins]
    return lengths, seen


def test_bridge_reads_the_built_in_set_at_connects_lengths(tmp_path: Path):
    cfg = make_config(tmp_path / "work", *MEGATRON, "packing.packing_buffer_size=16")
    prepare(cfg)
    connect(cfg)
    lengths, _ = _check(cfg, tmp_path, resolve_source(cfg))
    assert set(lengths["num_images"]) >= {0, 1, 2}  # text-only, single- and multi-image rows
    assert lengths["num_videos"].sum() > 0  # the built-in set's video rows


def _picture(path: Path, size: tuple[int, int], colour: str) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    img = Image.new("RGB", size, colour)
    img.paste("white", (size[0] // 4, size[1] // 4, size[0] // 2, size[1] // 2))
    img.save(path)
    return f"img/{path.name}"


def _user_folder(root: Path) -> Path:
    """Rows whose markers stand in mid-text, a LLaVA row, a text-only row; image sizes whose
    token counts differ between one resize and Bridge's two (149×234 among them)."""
    folder = root / "data"
    img = folder / "img"
    a = _picture(img / "a.png", (149, 234), "red")
    b = _picture(img / "b.jpg", (640, 480), "blue")
    c = _picture(img / "c.png", (1000, 750), "green")
    d = _picture(img / "d.png", (37, 301), "purple")

    def user(text):
        return {"role": "user", "content": text}

    def reply(text):
        return {"role": "assistant", "content": text}

    rows = [
        {
            "id": "mid-text",
            "images": [a, b],
            "conversations": [
                user("Image 1: <image> Image 2: <image> Which one is bigger?"),
                reply("Image 2."),
            ],
        },
        {
            "id": "two-turns",
            "images": [c, d],
            "conversations": [
                user("Look at <image> first."),
                reply("I see a green picture."),
                user("And now <image>: what colour is it?"),
                reply("Purple."),
            ],
        },
        {
            "id": "end-marker",
            "images": [d],
            "conversations": [user("What colour is this? <image>"), reply("Purple.")],
        },
        {
            "id": "llava",
            "images": [b],
            "conversations": [
                {"from": "human", "value": "Describe the picture."},
                {"from": "gpt", "value": "A blue picture with a white square."},
            ],
        },
        {
            "id": "text-only",
            "conversations": [
                {"role": "system", "content": "Be brief."},
                user("How many sides has a square?"),
                reply("4"),
            ],
        },
    ]
    for i, row in enumerate(rows):
        row["split"] = "val" if i == 2 else "train"
    (folder / "conversations.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return folder


def test_bridge_reads_a_user_folder_with_mid_text_markers_at_connects_lengths(tmp_path: Path):
    folder = _user_folder(tmp_path)
    cfg = make_config(tmp_path / "work", *MEGATRON, f"data.source={folder}")
    prepare(cfg)
    connect(cfg)
    lengths, seen = _check(cfg, tmp_path, folder)
    moved = dict(zip(lengths["key"], lengths["images_moved"], strict=True))
    # Bridge moves the images of the rows whose markers are not already first in their turn
    assert moved == {
        "mid-text": True,
        "two-turns": True,
        "end-marker": True,
        "llava": False,
        "text-only": False,
    }
    assert seen["text-only"]["images"] == [] and seen["text-only"]["image_grids"] == []


def _clip(folder: Path, name: str, num_frames: int, height: int, width: int, **kwargs) -> str:
    """A clip of a white square moving right over noise (the noise keeps frames apart)."""
    rng = np.random.default_rng(num_frames * 1000 + height + width)
    frames = rng.integers(0, 96, (num_frames, height, width, 3), dtype=np.uint8)
    for t in range(num_frames):
        x = (4 * t) % max(width - 8, 1)
        frames[t, height // 4 : height // 4 + 8, x : x + 8] = 255
    (folder / "clips").mkdir(parents=True, exist_ok=True)
    write_video(folder / "clips" / name, frames, kwargs.pop("fps", 4.0), **kwargs)
    return f"clips/{name}"


def _video_folder(root: Path) -> Path:
    """Video rows at the tiny processor's sampling (2 fps, at least 4 frames): an odd count
    (7 frames at 2 fps), a rotated phone clip, a video beside an image (the video after the
    text, so Bridge moves it), two videos of other sizes in one turn (a wide and a tall one,
    which qwen-vl-utils upscales), a clip of 12 sampled frames (over the run's
    ``max_num_frames`` 8), a larger clip, and a text-only row."""
    folder = root / "videos"
    odd = _clip(folder, "odd.mp4", 7, 48, 64, fps=2.0)
    rotated = _clip(folder, "rotated.mp4", 6, 48, 64, rotation=90)
    wide = _clip(folder, "wide.mp4", 10, 32, 320)
    tall = _clip(folder, "tall.mp4", 8, 160, 96)
    long = _clip(folder, "long.mp4", 24, 64, 96)  # 6 s at 4 fps: 12 frames at 2 fps
    large = _clip(folder, "large.mkv", 10, 240, 320)
    image = _picture(folder / "img" / "red.png", (64, 64), "red")

    def row(rid, videos, text, images=(), split="train"):
        turns = [{"role": "user", "content": text}, {"role": "assistant", "content": "right"}]
        return {
            "id": rid,
            "videos": videos,
            "images": list(images),
            "conversations": turns,
            "split": split,
        }

    rows = [
        row("odd", [odd], "<video>\nWhich way does it move?"),
        row("rotated", [rotated], "<video>\nWhich way?", split="val"),
        row("mixed", [odd], "Is the square in <video> the colour of <image>?", [image]),
        row("two", [wide, tall], "<video> and <video>: same way?"),
        row("long", [long], "<video>\nHow many squares?"),
        row("large", [large], "Describe <video>"),
        {
            "id": "text",
            "conversations": [
                {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello"},
            ],
        },
    ]
    (folder / "conversations.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return folder


def test_bridge_reads_video_rows_at_connects_lengths(tmp_path: Path):
    folder = _video_folder(tmp_path)
    cfg = make_config(
        tmp_path / "work",
        *MEGATRON,
        f"data.source={folder}",
        "megatron.extra_overrides=[dataset.task_encoder.max_num_frames=8]",
    )
    prepare(cfg)
    connect(cfg)
    lengths, seen = _check(cfg, tmp_path, folder)
    by_key = lengths.set_index("key")
    # Bridge keeps every pre-sampled frame (2 fps of 4-fps clips, at least 4) but the long
    # clip's last 4 (max_num_frames 8); an odd count is padded by qwen-vl-utils, so the
    # grids' t is ceil(frames / 2)
    counts = {k: json.loads(v) for k, v in by_key["video_frame_counts"].items()}
    assert counts == {
        "odd": [7],
        "rotated": [4],
        "mixed": [7],
        "two": [5, 4],
        "long": [8],
        "large": [5],
        "text": [],
    }
    assert [g[0] for g in json.loads(by_key.loc["odd", "video_grids"])] == [4]
    assert seen["rotated"]["videos"][0][1:3] == [48, 64]  # upright: 48 wide, 64 high
    # what connect reports of Bridge's handling, and validate's warnings from it
    report = json.loads((cfg.work_path / "connect" / BRIDGE_VIDEOS).read_text())
    assert (report["videos"], report["max_num_frames"], report["do_sample_frames"]) == (7, 8, False)
    assert report["truncated"] == {
        "videos": 1,
        "samples": 1,
        "examples": ["long"],
        "frames_dropped": 4,
    }
    assert report["resampled"]["videos"] == 0
    assert report["timestamps"]["videos"] == 7  # positions over 24 fps: none is right
    findings, _ = DATA_RULES.run(load_inputs(cfg, upstream(cfg)))
    warned = {f.rule: f for f in findings if f.rule.startswith("megatron.video")}
    assert set(warned) == {"megatron.video_frames", "megatron.video_timestamps"}
    cut = warned["megatron.video_frames"]
    assert cut.setting == "megatron.extra_overrides" and cut.severity == "warning"
    assert cut.message.startswith("1 of 7 videos (1 samples, e.g. long) have more pre-sampled")
    assert "set it to 12" in cut.fix
    assert "7 of 7 videos get other timestamps" in warned["megatron.video_timestamps"].message


def _digests(images: list[bytes]) -> list[list]:
    out = []
    for data in images:
        with Image.open(io.BytesIO(data)) as img:
            rgb = img.convert("RGB")
            out.append([*rgb.size, hashlib.sha1(rgb.tobytes()).hexdigest()])
    return out


def test_bridge_reads_exactly_the_good_samples_of_an_adopted_chatml_dataset(tmp_path: Path):
    """An Energon dataset in Bridge's own ChatML layout, adopted in place: Bridge's
    ``ChatMLWebdataset`` (the source's own ``dataset.yaml``) through prepare's ``bridge.yaml``
    gives exactly the samples prepare accepted (the bad ones excluded by prepare's split
    config: none fails, none is skipped), each with its own images, its media placed as
    packline's conversation places them, and Bridge's Qwen-VL encoder makes a sequence of
    each; not a file of the source changes."""
    written = write_chatml_dataset(tmp_path / "source")
    before = file_stats(written.root)
    cfg = make_config(tmp_path / "work", *MEGATRON, f"data.source={written.root}")
    adoption = adopt(cfg, written.root, dataset_dir(cfg))
    copy_tiny_processor(processor_dir(cfg))
    seen = _bridge_read(cfg, tmp_path)["samples"]
    assert {key: s["split"] for key, s in seen.items()} == written.good
    assert {s["sample_type"] for s in seen.values()} == {"ChatMLSample"}
    for key, sample in seen.items():
        row = adoption.rows[key]
        assert sample["images"] == _digests([img.data for img in row.images]), key
        assert sample["conversation"] == [
            [m["role"], [p.get("text", p["type"]) for p in m["content"]]] for m in row.conversation
        ], key
        assert sample["length"] > 0 and sample["loss_tokens"] > 0, key
        assert len(sample["image_grids"]) == len(row.images), key
    assert file_stats(written.root) == before


def test_the_placeholders_are_only_the_listed_names():
    """Nothing of Bridge's data path is replaced: the tree holds its files byte for byte and
    the few placeholder modules listed in tests/bridge_data.py."""
    tree = _tree()
    from tests.bridge_data import MODULES
    from tests.bridge_source import fetch_sources

    src = fetch_sources()
    for rel in MODULES:
        assert (tree / rel).read_bytes() == (src / rel).read_bytes(), rel
    written = {str(p.relative_to(tree)) for p in tree.rglob("*.py") if p.name != "__init__.py"}
    assert written == set(MODULES) | set(PLACEHOLDERS)
    assert all((p.stat().st_size == 0) for p in tree.rglob("__init__.py"))
