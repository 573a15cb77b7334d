"""Tests for the built-in ``shapes`` conversation set (packline.shapes.generate)."""

from __future__ import annotations

import hashlib
import json
import math
import random
import re
import statistics
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from packline.media.video import decode_frames, probe_video, write_video
from packline.qwen.vision import ImageGeometry, VideoGeometry
from packline.shapes.generate import (
    _CLIP_FRAMES,
    _CLIP_QUESTIONS,
    _CLIP_SAMPLERS,
    _EVENT_GAP,
    ANSWER_CHOICES,
    ANSWER_KINDS,
    BACKGROUND_RGB,
    CLIP_FPS,
    CLIP_KINDS,
    COLOUR_RGB,
    FIRST_MIX,
    PRETRAIN_MAX_TOKENS,
    SEEING_MIX,
    VIDEO_SHARE,
    _Clip,
    _draw_clip,
    _row_clip,
    answer_matches,
    write_pretraining_set,
    write_shapes_dataset,
)

# The tiny processor's video geometry (its sampling: 2 fps, at least 4 frames).
VIDEO_GEOMETRY = VideoGeometry().with_overrides(min_pixels=64 * 64, max_pixels=1024 * 32 * 32)

GOLDEN_JSONL_SHA256 = "5044760b68f8412b8e49fa1a10b59f15508ff264dfe4b184598b9b9966c6e82b"
# The same rows without video (video_share=0): the image and text rows as they were before
# the video rows came.
GOLDEN_NO_VIDEO_JSONL_SHA256 = "314153fc515c389dda0738f132a07fdd16a159dc3d9cd869190f69a5661a6f52"


def _digest(out_dir: Path) -> str:
    """sha256 over conversations.jsonl and every image and clip file, in name order."""
    h = hashlib.sha256((out_dir / "conversations.jsonl").read_bytes())
    for path in sorted([*(out_dir / "images").iterdir(), *(out_dir / "clips").iterdir()]):
        h.update(path.name.encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def _rows(out_dir: Path) -> list[dict]:
    with (out_dir / "conversations.jsonl").open() as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def big_set(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict]]:
    out = write_shapes_dataset(tmp_path_factory.mktemp("shapes"), num_train=400, num_val=40)
    return out, _rows(out)


def test_digest_identical_same_seed(tmp_path: Path) -> None:
    a = write_shapes_dataset(tmp_path / "a", num_train=60, num_val=10, seed=3)
    b = write_shapes_dataset(tmp_path / "b", num_train=60, num_val=10, seed=3)
    assert _digest(a) == _digest(b)
    assert len(_rows(a)) == 70
    assert len(list((a / "clips").iterdir())) == sum(bool(r.get("videos")) for r in _rows(a)) > 0


def test_digest_differs_different_seed(tmp_path: Path) -> None:
    a = write_shapes_dataset(tmp_path / "a", num_train=60, num_val=10, seed=3)
    b = write_shapes_dataset(tmp_path / "b", num_train=60, num_val=10, seed=4)
    assert _digest(a) != _digest(b)


def test_rows_independent_of_count(tmp_path: Path) -> None:
    small = _rows(write_shapes_dataset(tmp_path / "s", num_train=20, num_val=5))
    large = _rows(write_shapes_dataset(tmp_path / "l", num_train=60, num_val=10))
    assert small[:20] == large[:20]
    assert small[20:] == large[60:65]


def test_val_rows_differ_from_train_same_index(tmp_path: Path) -> None:
    rows = _rows(write_shapes_dataset(tmp_path, num_train=30, num_val=30))
    train, val = rows[:30], rows[30:]
    assert [r["split"] for r in rows] == ["train"] * 30 + ["val"] * 30
    assert val[0]["id"] == "shapes-val-000000"
    same = sum(t["conversations"] == v["conversations"] for t, v in zip(train, val, strict=True))
    assert same <= 1


def test_progress_counts_every_row(tmp_path: Path) -> None:
    calls: list[int] = []
    write_shapes_dataset(tmp_path, num_train=12, num_val=3, progress=calls.append)
    assert sum(calls) == 15


def test_write_rejects_negative_count(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="must be >= 0"):
        write_shapes_dataset(tmp_path, num_train=-1)
    with pytest.raises(ValueError, match="at least 1"):
        write_shapes_dataset(tmp_path, num_train=0, num_val=0)


def test_write_rejects_video_share_outside_unit_interval(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="video_share"):
        write_shapes_dataset(tmp_path, num_train=1, video_share=1.5)


def test_video_share_within_band(big_set: tuple[Path, list[dict]]) -> None:
    _, rows = big_set
    share = sum(bool(r.get("videos")) for r in rows) / len(rows)
    assert VIDEO_SHARE - 0.05 <= share <= VIDEO_SHARE + 0.05
    assert {r["meta"]["clip"]["kind"] for r in rows if r.get("videos")} == set(CLIP_KINDS)


def test_video_share_leaves_other_rows_unchanged(tmp_path: Path) -> None:
    none = _rows(write_shapes_dataset(tmp_path / "n", num_train=40, num_val=10, video_share=0))
    some = _rows(write_shapes_dataset(tmp_path / "s", num_train=40, num_val=10))
    more = _rows(write_shapes_dataset(tmp_path / "m", num_train=40, num_val=10, video_share=0.5))
    assert not any(r.get("videos") for r in none)
    assert not (tmp_path / "n" / "clips").exists()
    video_some = {r["id"] for r in some if r.get("videos")}
    video_more = {r["id"] for r in more if r.get("videos")}
    assert video_some and video_some < video_more  # a larger share adds video rows
    for a, b in zip(none, some, strict=True):
        if b["id"] not in video_some:
            assert a == b
    for a, b in zip(some, more, strict=True):
        if a["id"] in video_some:
            assert a == b


def test_modality_fractions_within_band(big_set: tuple[Path, list[dict]]) -> None:
    _, rows = big_set
    train = [r for r in rows if r["split"] == "train" and not r.get("videos")]
    text_only = sum(not r["images"] for r in train) / len(train)
    multi = sum(len(r["images"]) > 1 for r in train) / len(train)
    system = sum(r["conversations"][0]["role"] == "system" for r in train) / len(train)
    assert 0.10 <= text_only <= 0.20
    assert 0.05 <= multi <= 0.15
    assert 0.20 <= system <= 0.40
    assert max(len(r["images"]) for r in train) == 3


def test_rows_consistent_markers_images_answers(big_set: tuple[Path, list[dict]]) -> None:
    out, rows = big_set
    for row in rows:
        conv = row["conversations"]
        markers = sum(m["content"].count("<image>") for m in conv if m["role"] == "user")
        assert markers == len(row["images"]), row["id"]
        videos = sum(m["content"].count("<video>") for m in conv if m["role"] == "user")
        assert videos == len(row.get("videos", [])) <= 1, row["id"]
        if videos:  # one clip, in the first user message
            assert not row["images"], row["id"]
            assert "<video>" in next(m for m in conv if m["role"] == "user")["content"]
            assert row["videos"] == [f"clips/{row['id']}.mp4"]
            header = probe_video(out / row["videos"][0])
            assert header.num_frames == row["meta"]["clip"]["num_frames"], row["id"]
            assert _CLIP_FRAMES[0] <= header.num_frames <= _CLIP_FRAMES[1]
            assert header.fps == row["meta"]["clip"]["fps"] == CLIP_FPS
            assert header.width % 32 == 0 and header.height % 32 == 0
            sampled = VIDEO_GEOMETRY.num_sampled(header.num_frames, header.fps)
            size = (header.height, header.width)
            assert VIDEO_GEOMETRY.resized(sampled, *size) == size  # the processor keeps it
        roles = [m["role"] for m in conv if m["role"] != "system"]
        assert roles == ["user", "assistant"] * (len(roles) // 2), row["id"]
        assert 1 <= len(roles) // 2 <= 4
        for i, rel in enumerate(row["images"]):
            assert rel == f"images/{row['id']}-{i}.png"
            with Image.open(out / rel) as im:
                im.load()
                assert im.format == "PNG" and im.mode == "RGB"
                assert min(im.size) >= 128 and max(im.size) <= 2.4 * min(im.size)
        assert len(row["meta"]["answers"]) == len(roles) // 2
        for ans in row["meta"]["answers"]:
            msg = conv[ans["turn"]]
            assert msg["role"] == "assistant", row["id"]
            assert ans["answer"].lower() in msg["content"].lower(), row["id"]
            assert answer_matches(ans["answer"], msg["content"], ans["kind"]), row["id"]
            assert ans["answer"] in ANSWER_CHOICES.get(ans["kind"], (ans["answer"],))


def test_answer_kinds_all_present(big_set: tuple[Path, list[dict]]) -> None:
    _, rows = big_set
    kinds = {a["kind"] for r in rows for a in r["meta"]["answers"]}
    assert kinds == set(ANSWER_KINDS)


def test_visual_tokens_span_long_tail(big_set: tuple[Path, list[dict]]) -> None:
    out, rows = big_set
    tokens = []
    off_grid = 0
    for row in rows:
        for rel in row["images"]:
            with Image.open(out / rel) as im:
                w, h = im.size
            tokens.append(ImageGeometry().visual_tokens(h, w))
            off_grid += w % 32 != 0 or h % 32 != 0
    assert min(tokens) <= 20
    assert max(tokens) >= 900
    assert max(tokens) <= 1024
    assert off_grid > len(tokens) // 2  # the resize rule's rounding really runs
    # Skewed towards small images: the median is far below the mean.
    assert statistics.median(tokens) < 100
    assert statistics.median(tokens) < statistics.mean(tokens) / 1.5


def test_answer_lengths_long_tail(big_set: tuple[Path, list[dict]]) -> None:
    _, rows = big_set
    lengths = sorted(
        len(m["content"]) for r in rows for m in r["conversations"] if m["role"] == "assistant"
    )
    assert lengths[len(lengths) // 2] <= 10  # most answers are a word or a number
    assert lengths[-1] >= 1000  # a few detailed descriptions run to hundreds of tokens


def test_answer_matches_count_accepts_digit_and_word() -> None:
    assert answer_matches("3", "3", "count")
    assert answer_matches("3", "There are three shapes.", "count")
    assert answer_matches("0", "There are none.", "count")
    assert not answer_matches("3", "There are 4 shapes.", "count")
    assert not answer_matches("3", "I cannot tell.", "count")


def test_answer_matches_colour_rejects_extra_colour() -> None:
    assert answer_matches("red", "The circle is RED.", "colour")
    assert not answer_matches("red", "It is red or blue.", "colour")
    assert not answer_matches("red", "blue", "colour")


def test_answer_matches_position_variants() -> None:
    assert answer_matches("top left", "It is in the upper-left corner.", "position")
    assert answer_matches("centre", "In the center.", "position")
    assert answer_matches("top", "top middle", "position")
    assert not answer_matches("top left", "top right", "position")
    assert not answer_matches("left", "bottom left", "position")


def test_answer_matches_describe_requires_every_shape() -> None:
    expected = "There are 2 shapes: a red circle at the top left and a blue star in the centre."
    assert answer_matches(expected, expected, "describe")
    reordered = "A blue star is in the middle; a big red circle sits at the top-left."
    assert answer_matches(expected, reordered, "describe")
    assert not answer_matches(expected, reordered.replace("top-left", "bottom"), "describe")
    assert not answer_matches(expected, "There is a red circle at the top left.", "describe")


def test_answer_matches_compare_ordinals_and_tie() -> None:
    assert answer_matches("the first image", "Image 1 has more.", "compare")
    assert answer_matches("the second image", "The 2nd one.", "compare")
    assert not answer_matches("the first image", "The second image.", "compare")
    assert not answer_matches("the first image", "They have the same number.", "compare")
    assert answer_matches("they have the same number", "Both are equal.", "compare")


def test_answer_matches_text_number_and_word() -> None:
    assert answer_matches("6", "A hexagon has six sides.", "text")
    assert answer_matches("hexagon", "The hexagon.", "text")
    assert not answer_matches("hexagon", "A pentagon.", "text")
    assert answer_matches("green", "They are green.", "text")
    assert not answer_matches("green", "They are red.", "text")


def test_answer_matches_rejects_unknown_kind() -> None:
    with pytest.raises(ValueError, match="unknown answer kind"):
        answer_matches("3", "3", "size")


def test_small_set_matches_golden_hash(tmp_path: Path) -> None:
    """Pins the generator's text output: a change to the built-in set must be deliberate.
    (The image and clip bytes depend on zlib and libx264, so only conversations.jsonl is
    pinned.)"""
    write_shapes_dataset(tmp_path / "v", num_train=20, num_val=4, seed=0)
    digest = hashlib.sha256((tmp_path / "v" / "conversations.jsonl").read_bytes()).hexdigest()
    assert digest == GOLDEN_JSONL_SHA256
    write_shapes_dataset(tmp_path / "n", num_train=20, num_val=4, seed=0, video_share=0)
    digest = hashlib.sha256((tmp_path / "n" / "conversations.jsonl").read_bytes()).hexdigest()
    assert digest == GOLDEN_NO_VIDEO_JSONL_SHA256


# --------------------------------------------------------------------------- video


def test_answer_matches_direction_variants() -> None:
    assert answer_matches("left", "left", "direction")
    assert answer_matches("left", "It moves to the left.", "direction")
    assert answer_matches("left", "The red circle moves from right to left.", "direction")
    assert answer_matches("up", "Upwards, to the top.", "direction")
    assert answer_matches("down", "It goes from the top to the bottom.", "direction")
    assert not answer_matches("left", "right", "direction")
    assert not answer_matches("left", "left or right", "direction")
    assert not answer_matches("up", "It does not move.", "direction")


def test_answer_matches_order_first_shape_named() -> None:
    assert answer_matches("circle", "The red circle appears first.", "order")
    assert answer_matches("star", "Stars.", "order")
    assert not answer_matches("circle", "The square, then the circle.", "order")
    assert not answer_matches("circle", "I cannot tell.", "order")


def test_answer_matches_count_time_uses_number_rule() -> None:
    assert answer_matches("2", "There are two shapes at the end.", "count_time")
    assert answer_matches("0", "There are none at the start.", "count_time")
    assert not answer_matches("2", "3", "count_time")


def test_answer_matches_colour_change_names_end_colour() -> None:
    assert answer_matches("blue", "blue", "colour_change")
    assert answer_matches("blue", "It turns blue.", "colour_change")
    assert answer_matches("blue", "The square turns from red to blue.", "colour_change")
    assert answer_matches("blue", "It changes from red into blue.", "colour_change")
    assert not answer_matches("blue", "It turns red.", "colour_change")
    assert not answer_matches("blue", "red and blue", "colour_change")
    assert not answer_matches("blue", "It turns from blue to red.", "colour_change")


def test_sampled_frames_catch_every_event_gap() -> None:
    """The clips' timing rests on this: at the default 2-fps sampling of a 4-fps clip of
    6-16 frames, the first and last frames are sampled and any _EVENT_GAP consecutive frames
    hold a sampled one."""
    for num_frames in range(_CLIP_FRAMES[0], _CLIP_FRAMES[1] + 1):
        idx = VIDEO_GEOMETRY.sample_indices(num_frames, CLIP_FPS)
        assert idx[0] == 0 and idx[-1] == num_frames - 1
        assert np.diff(idx).max() <= _EVENT_GAP, (num_frames, idx)
        assert len(idx) < num_frames  # the processor really drops frames


_PALETTE_RGB = {**COLOUR_RGB, **{f"bg:{k}": v for k, v in BACKGROUND_RGB.items()}}


def _nearest_colour(rgb: np.ndarray) -> str:
    return min(_PALETTE_RGB, key=lambda name: math.dist(_PALETTE_RGB[name], rgb))


def _colour_at(frame: np.ndarray, cx: int, cy: int) -> str:
    """The palette colour (or ``bg:<background>``) closest to a 3x3 patch's mean."""
    patch = frame[cy - 1 : cy + 2, cx - 1 : cx + 2].reshape(-1, 3).astype(float)
    return _nearest_colour(patch.mean(axis=0))


def _pixel_facts(clip: _Clip, frames: np.ndarray, indices: np.ndarray) -> dict:
    """What the decoded, sampled frames show; the clip gives only where to look (shape
    centres) and which colour the subject starts with."""
    facts: dict = {}
    if clip.kind == "move":
        mover = clip.frames[0][-1]
        want = np.asarray(COLOUR_RGB[mover.colour], dtype=float)
        centroids = []
        for frame in frames:
            mask = np.linalg.norm(frame.astype(float) - want, axis=-1) < 50
            assert mask.sum() > 50
            ys, xs = np.nonzero(mask)
            centroids.append((xs.mean(), ys.mean()))
        (x0, y0), (x1, y1) = centroids[0], centroids[-1]
        dx, dy = x1 - x0, y1 - y0
        if abs(dx) >= abs(dy):
            facts["direction"] = "right" if dx > 0 else "left"
            steps = np.diff([c[0] for c in centroids]) * np.sign(dx)
            assert abs(dx) >= 20 and abs(dy) <= 3, (dx, dy)
        else:
            facts["direction"] = "down" if dy > 0 else "up"
            steps = np.diff([c[1] for c in centroids]) * np.sign(dy)
            assert abs(dy) >= 20 and abs(dx) <= 3, (dx, dy)
        assert steps.min() > 0  # a steady move, every sampled frame further on
    if clip.kind == "appear":
        sprites = {s.kind: s for sprites in clip.frames for s in sprites}
        shown = {
            kind: [_colour_at(f, s.cx, s.cy) == s.colour for f in frames]
            for kind, s in sprites.items()
        }
        first_seen = {kind: seen.index(True) for kind, seen in shown.items()}
        assert len(set(first_seen.values())) == len(first_seen)  # no two appear together
        facts["order"] = sorted(first_seen, key=first_seen.get)
        facts["count_start"] = sum(seen[0] for seen in shown.values())
        facts["count_end"] = sum(seen[-1] for seen in shown.values())
        facts["count_all"] = len(first_seen)
    else:  # a move or colour clip: the same shapes in every frame
        counts = {
            sum(_colour_at(frames[j], s.cx, s.cy) == s.colour for s in clip.frames[t])
            for j, t in enumerate(indices)
        }
        assert len(counts) == 1, counts
        facts["count"] = counts.pop()
    if clip.kind == "colour":
        s = clip.frames[0][-1]
        facts["colour_start"] = _colour_at(frames[0], s.cx, s.cy)
        facts["colour_end"] = _colour_at(frames[-1], s.cx, s.cy)
        assert facts["colour_start"] != facts["colour_end"]
    return facts


def _expected(question: str, kind: str, facts: dict) -> str:
    """The answer the sampled frames give to ``question``."""
    if kind == "direction":
        return facts["direction"]
    if kind == "order":
        word = re.search(r"appears (first|second|third|last)", question).group(1)
        order = facts["order"]
        return order[-1] if word == "last" else order[("first", "second", "third").index(word)]
    if kind == "count_time":
        if "end" in question or "last frame" in question:
            return str(facts["count_end"])
        if "start" in question or "first frame" in question:
            return str(facts["count_start"])
        return str(facts["count_all"])
    if kind == "colour_change":
        return facts["colour_end"]
    if kind == "colour":
        return facts["colour_start"]
    assert kind == "count", kind
    return str(facts["count"])


def _decode_sampled(path: Path, clip: _Clip) -> tuple[np.ndarray, np.ndarray]:
    indices = VIDEO_GEOMETRY.sample_indices(clip.num_frames, clip.fps)
    return decode_frames(path, indices), indices


@pytest.mark.parametrize("kind", CLIP_KINDS)
def test_clip_answers_match_decoded_sampled_frames(tmp_path: Path, kind: str) -> None:
    """Every question a clip kind asks, on clips of every frame count, is answered by what
    the processor's sampled frames show after the H.264 round trip."""
    checked = 0
    for i in range(2 * (_CLIP_FRAMES[1] - _CLIP_FRAMES[0] + 1)):
        num_frames = _CLIP_FRAMES[0] + i % (_CLIP_FRAMES[1] - _CLIP_FRAMES[0] + 1)
        rng = random.Random(f"clip-test:{kind}:{i}")
        clip = _CLIP_SAMPLERS[kind](rng, num_frames, rng.choice(list(BACKGROUND_RGB)))
        pixels = _draw_clip(clip)
        assert pixels.shape == (num_frames, clip.height, clip.width, 3)
        path = write_video(tmp_path / f"{kind}-{i}.mp4", pixels, clip.fps)
        frames, indices = _decode_sampled(path, clip)
        facts = _pixel_facts(clip, frames, indices)
        firsts, follow_ups = _CLIP_QUESTIONS[kind]
        for _, fn in firsts + follow_ups:
            for j in range(4):
                turn = fn(random.Random(j), clip)
                assert turn.answer == _expected(turn.question, turn.kind, facts), turn
                assert answer_matches(turn.answer, turn.reply, turn.kind), turn
                checked += 1
    assert checked >= 100


def test_video_rows_answers_match_their_clips(tmp_path: Path) -> None:
    """Rows of an all-video set: each answer in ``meta`` is what the row's own clip file
    shows at the processor's sampled frames."""
    out = write_shapes_dataset(tmp_path, num_train=36, num_val=6, seed=5, video_share=1.0)
    rows = _rows(out)
    assert all(r["videos"] and not r["images"] for r in rows)
    for row in rows:
        split, index = row["split"], int(row["id"].rsplit("-", 1)[1])
        _, clip = _row_clip(5, split, index)
        frames, indices = _decode_sampled(out / row["videos"][0], clip)
        facts = _pixel_facts(clip, frames, indices)
        for ans in row["meta"]["answers"]:
            question = row["conversations"][ans["turn"] - 1]["content"]
            assert ans["answer"] == _expected(question, ans["kind"], facts), row["id"]


# --- the tiny base's pretraining mix ------------------------------------------------------------


def test_pretraining_mix_is_captions_statements_and_text_chat(tmp_path: Path) -> None:
    out = write_pretraining_set(tmp_path / "a", num_train=300, num_val=20)
    rows = _rows(out)
    assert [r["split"] for r in rows] == ["train"] * 300 + ["val"] * 20
    chat = [r for r in rows if "?" in r["conversations"][0]["content"]]
    text = [r for r in rows if not r["images"]]
    assert abs(len(chat) / len(rows) - FIRST_MIX.chat_share) < 0.07
    assert abs((len(text) - len(chat)) / len(rows) - FIRST_MIX.text_share) < 0.07
    for r in rows:
        user, assistant = r["conversations"]
        assert (user["role"], assistant["role"]) == ("user", "assistant")
        assert "?" not in assistant["content"]
        assert user["content"].count("<image>") == len(r["images"]) <= 1
    for r in chat:  # the only questions: text-only, never about a picture
        assert not r["images"]
        assert not any(k in r["conversations"][0]["content"] for k in ("image", "picture"))
    for r in rows:
        if r["images"]:
            reply = r["conversations"][1]["content"]
            with Image.open(out / r["images"][0]) as img:
                assert (img.width // 32) * (img.height // 32) <= PRETRAIN_MAX_TOKENS
            n = int(re.search(r"(\d+) shapes?", reply).group(1))  # the caption counts them
            assert 1 <= n <= 6
    # deterministic, and a row does not depend on how many are written
    again = write_pretraining_set(tmp_path / "b", num_train=100, num_val=0)
    assert _rows(again) == rows[:100]
    for r in rows[:100]:
        for image in r["images"]:
            assert (again / image).read_bytes() == (out / image).read_bytes()


def test_the_seeing_mix_has_fewer_shapes_per_picture_and_large_lone_ones(tmp_path: Path) -> None:
    """The second pretraining phase's pictures: a ``lone_share`` of one large shape in the
    centre of a small picture, a ``cut_share`` cut to one or two shapes anywhere in the grid,
    the rest whole; no caption in detail, no question; a ``prompted_share`` of the captions
    follow a label that says which statement comes ("Colours:" -> each kind's colour)."""
    out = write_pretraining_set(tmp_path, num_train=400, seed=1, mix=SEEING_MIX)
    rows = _rows(out)
    pictures = [r for r in rows if r["images"]]
    share = 1 - SEEING_MIX.text_share - SEEING_MIX.chat_share
    assert abs(len(pictures) / len(rows) - share) < 0.07
    shapes, lone, cells, labels = [], 0, set(), Counter()
    for r in pictures:
        prompt, reply = (m["content"] for m in r["conversations"])
        assert "?" not in prompt + reply and "pixels" not in reply  # no question, no detail
        label = prompt.split("\n")[-1]
        labels[label] += 1
        if label == "Colours:":
            assert re.fullmatch(r"(The [a-z]+( [a-z ]+)? is [a-z]+\. ?)+", reply), reply
        elif label == "Positions:":
            assert re.fullmatch(r"(The [a-z]+ [a-z]+ is (at|on|in) the [a-z ]+\. ?)+", reply)
        counted = re.search(r"(\d+) shapes?", reply)
        if not counted:
            continue
        n = int(counted.group(1))
        shapes.append(n)
        with Image.open(out / r["images"][0]) as img:
            assert (img.width // 32) * (img.height // 32) <= PRETRAIN_MAX_TOKENS
            if n == 1 and img.width <= 256 and img.height <= 256 and "centre" in reply:
                lone += 1
        if n == 1:
            cells.update(p for p in ("top left", "bottom right", "on the left") if p in reply)
    few = sum(n <= 2 for n in shapes) / len(shapes)
    assert few > (SEEING_MIX.cut_share + SEEING_MIX.lone_share) * 0.8
    assert lone / len(shapes) > SEEING_MIX.lone_share * 0.5
    assert len(cells) == 3  # a cut keeps shapes from anywhere in the grid, not the first ones
    assert max(shapes) >= 5  # and whole pictures remain
    prompted = sum(labels[label] for label in ("Count:", "Counts:", "Colours:", "Positions:"))
    assert abs((prompted + labels["Shapes:"]) / len(pictures) - SEEING_MIX.prompted_share) < 0.1
