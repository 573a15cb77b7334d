from __future__ import annotations

import json
import re
from pathlib import Path

import pandas as pd
import pytest

from schemas.config import Algorithm
from schemas.tables import LengthsModel
from stages.base import InputError
from stages.connect import connect_processor, forecast_fill
from stages.prepare import prepare_dataset
from tests.conftest import make_config


def floor_rule(height: int, width: int) -> int:
    """A plausible but wrong cheap rule: floor to 32 px blocks instead of smart_resize."""
    return (height // 32) * (width // 32)


@pytest.fixture(scope="module")
def default_set(tmp_path_factory) -> Path:
    """The built-in set at its default size, prepared and connected once for the module."""
    work = tmp_path_factory.mktemp("default") / "work"
    cfg = make_config(work, "data.num_train=2000", "data.num_val=200", "prepare.num_workers=2")
    prepare_dataset(cfg)
    result = connect_processor(cfg)
    return result.out_dir, result, cfg


def test_connect_cheap_length_equals_processor_for_every_default_sample(default_set):
    out, result, cfg = default_set
    lengths = pd.read_parquet(out / "lengths.parquet")
    assert len(lengths) == 2200
    assert result.metrics["connect/cheap_mismatches"] == 0
    LengthsModel.validate(lengths, lazy=True)  # the table passes its pandera model
    manifest = pd.read_parquet(cfg.work_path / "prepare" / "manifest.parquet")
    merged = manifest.merge(lengths, on="key", suffixes=("_m", ""))
    assert len(merged) == 2200
    assert (merged["num_images_m"] == merged["num_images"]).all()
    assert (merged["split_m"] == merged["split"]).all()
    # The set spans the intended range: text-only rows and images up to ~1,000 tokens.
    assert (lengths["num_images"] == 0).sum() > 200
    assert lengths["image_tokens"].max() >= 900


def test_connect_forecast_is_monotone_and_bounded(default_set):
    out, result, _ = default_set
    forecast = json.loads((out / "forecast.json").read_text())
    fills = [forecast["buffers"][str(b)]["fill"] for b in (1, 16, 64, 256, 1024)]
    assert fills[0] == pytest.approx(forecast["unpacked"]["fill"])
    assert all(a <= b + 1e-9 for a, b in zip(fills, fills[1:], strict=False))
    assert fills[-1] <= forecast["lower_bound"]["fill"] + 1e-9
    assert forecast["lower_bound"]["fill"] > 0.95
    assert (out / "length_histogram.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert result.metrics["connect/forecast_fill_b64"] == pytest.approx(fills[2])


def test_connect_catches_a_wrong_cheap_rule(tmp_path: Path):
    cfg = make_config(tmp_path / "work")
    prepare_dataset(cfg)
    with pytest.raises(InputError) as info:
        connect_processor(cfg, visual_tokens=floor_rule)
    assert "cheap length rule disagrees with the processor" in info.value.header
    pattern = (
        r"^\S+: the processor counts (\d+) tokens \((\d+) image, \d+ loss\), the cheap rule (\d+)"
    )
    first = re.match(pattern, info.value.problems[0])
    assert first is not None, info.value.problems[0]
    assert first.group(1) != first.group(3)
    assert not (cfg.work_path / "connect" / "_COMPLETE.json").exists()


def test_forecast_fill_worked_example():
    # capacity 10, one buffer of 4: FFD packs [6,4] and [5,3] → 18 / 20.
    out = forecast_fill([6, 5, 4, 3], 10, [1, 4], Algorithm.ffd, seed=0)
    assert out["buffers"]["1"] == {"packs": 4, "fill": 18 / 40}
    assert out["buffers"]["4"] == {"packs": 2, "fill": 18 / 20}
    assert out["lower_bound"] == {"packs": 2, "fill": 18 / 20}
