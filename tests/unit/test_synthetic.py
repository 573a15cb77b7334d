"""Tests for the built-in ``shapes`` conversation set (packline.synthetic)."""

from __future__ import annotations

import hashlib
import json
import statistics
from pathlib import Path

import pytest
from PIL import Image

from packline.qwen.vision import ImageGeometry
from packline.synthetic import answer_matches, write_shapes_dataset

GOLDEN_JSONL_SHA256 = "314153fc515c389dda0738f132a07fdd16a159dc3d9cd869190f69a5661a6f52"


def _digest(out_dir: Path) -> str:
    """sha256 over conversations.jsonl and every image file, in name order."""
    h = hashlib.sha256((out_dir / "conversations.jsonl").read_bytes())
    for path in sorted((out_dir / "images").iterdir()):
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


def test_modality_fractions_within_band(big_set: tuple[Path, list[dict]]) -> None:
    _, rows = big_set
    train = [r for r in rows if r["split"] == "train"]
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


def test_answer_kinds_all_present(big_set: tuple[Path, list[dict]]) -> None:
    _, rows = big_set
    kinds = {a["kind"] for r in rows for a in r["meta"]["answers"]}
    assert kinds == {"count", "colour", "position", "describe", "compare", "text"}


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
    (The image bytes depend on zlib, so only conversations.jsonl is pinned.)"""
    write_shapes_dataset(tmp_path, num_train=20, num_val=4, seed=0)
    digest = hashlib.sha256((tmp_path / "conversations.jsonl").read_bytes()).hexdigest()
    assert digest == GOLDEN_JSONL_SHA256
