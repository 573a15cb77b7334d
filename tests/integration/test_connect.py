from __future__ import annotations

import json
import re
from pathlib import Path

import pandas as pd
import pytest

from schemas.config import Algorithm
from schemas.errors import UserError
from schemas.tables import LengthsModel
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
    # The default config's packer: backend local, refined, one stream; the FLOPs forecast
    # packs the same stream into the same rows at the configured buffer (64).
    assert (forecast["backend"], forecast["algorithm"]) == ("local", "refined")
    assert (forecast["num_ranks"], forecast["num_workers"]) == (1, 0)
    assert result.metrics["flops/rows_packed"] == forecast["buffers"]["64"]["packs"]


def test_connect_catches_a_wrong_cheap_rule(tmp_path: Path):
    cfg = make_config(tmp_path / "work")
    prepare_dataset(cfg)
    with pytest.raises(UserError) as info:
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
    assert (out["samples"], out["tokens"], out["backend"], out["algorithm"]) == (
        4,
        18,
        "local",
        "ffd",
    )
    # Seed 0 streams the table positions [2, 0, 1, 3]. Two ranks split that stream 2 + 2:
    # [6, 6] and [4, 4] take 3 rows where one stream's buffer of 4 takes 2.
    one = forecast_fill([6, 4, 6, 4], 10, [4], "ffd", seed=0)
    two = forecast_fill([6, 4, 6, 4], 10, [4], "ffd", seed=0, num_ranks=2)
    assert one["buffers"]["4"]["packs"] == 2 and two["buffers"]["4"]["packs"] == 3
    assert two["num_ranks"] == 2
    # The stream [4, 12, 6, 5] at B=2: locally the 12 takes a slot ([4, 12] → [4]; [6, 5] →
    # 2 rows), Bridge skips it before its buffer ([4, 6] → 1 row; [5] → 1).
    local = forecast_fill([12, 6, 4, 5], 10, [2], "ffd", seed=0)
    bridge = forecast_fill([12, 6, 4, 5], 10, [2], "ffd", seed=0, backend="megatron")
    assert local["samples"] == bridge["samples"] == 3 and local["tokens"] == 15
    assert local["buffers"]["2"] == {"packs": 3, "fill": 15 / 30}
    assert bridge["buffers"]["2"] == {"packs": 2, "fill": 15 / 20}


def _hf_style_processor_dir(root: Path) -> Path:
    """A processor dir laid out like a downloaded Qwen3-VL one: preprocessor_config.json
    naming the torchvision image processor by its legacy name with Qwen3-VL's real pixel
    bounds, the video config, and a chat_template.json without {% generation %} markers."""
    from packline.qwen.processor import copy_tiny_processor

    d = copy_tiny_processor(root / "hf")
    image_cfg = json.loads((d / "preprocessor_config.json").read_text())
    image_cfg["image_processor_type"] = "Qwen2VLImageProcessorFast"
    image_cfg["size"] = {"shortest_edge": 65536, "longest_edge": 16777216}
    (d / "preprocessor_config.json").write_text(json.dumps(image_cfg))
    template = (d / "chat_template.jinja").read_text()
    template = template.replace("{%- generation -%}", "").replace("{%- endgeneration -%}", "")
    (d / "chat_template.json").write_text(json.dumps({"chat_template": template}))
    (d / "chat_template.jinja").unlink()
    return d


def test_connect_with_a_hf_style_processor_dir(tmp_path: Path):
    proc = _hf_style_processor_dir(tmp_path)
    cfg = make_config(tmp_path / "work", f"processor.path={proc}")
    prepare_dataset(cfg)
    result = connect_processor(cfg)
    lengths = pd.read_parquet(result.out_dir / "lengths.parquet")
    assert result.metrics["connect/cheap_mismatches"] == 0
    # Qwen3-VL's real minimum of 65,536 pixels upscales every image to >= 64 visual tokens.
    with_images = lengths[lengths["num_images"] > 0]
    assert (with_images["image_tokens"] >= 64 * with_images["num_images"]).all()
    assert (result.out_dir / "processor" / "preprocessor_config.json").is_file()


def test_flops_forecast_equals_an_actual_epoch_through_the_loader(default_set):
    from packline.counters import PackCounts, flops_model_for
    from packline.energon.loader import train_loader
    from packline.energon.packing import PackingSettings, make_encoder
    from packline.qwen.processor import load_processor

    out, result, cfg = default_set
    forecast = json.loads((out / "forecast.json").read_text())["flops"]
    processor_dir = out / "processor"
    model = flops_model_for(cfg, load_processor(processor_dir))
    encoder = make_encoder("lazy", processor_dir, PackingSettings.from_config(cfg.packing))
    loader = train_loader(
        cfg.work_path / "prepare",
        encoder,
        packing_buffer_size=cfg.packing.packing_buffer_size,
        repeat=False,
    )
    total = PackCounts()
    for pack in loader:
        total = total + PackCounts.of(pack.batch, model, cfg.packing.seq_length)
    assert total.flops_useful == pytest.approx(forecast["epoch_useful"], rel=0.01)
    assert total.tokens_real == forecast["tokens_real"]
    # The loader's stream order differs from the forecast's, so the packs do too: the
    # executed (padding-inclusive) figure agrees closely but not exactly.
    assert total.flops_executed == pytest.approx(forecast["epoch_executed_packed"], rel=0.02)
    # THD rows with m = 1 and no fixed width carry no padding; padded batches do.
    assert forecast["padding_share_packed"] == 0.0
    assert 0.2 < forecast["padding_share_unpacked"] < 1
    assert result.metrics["flops/saving"] == pytest.approx(forecast["saving"])
