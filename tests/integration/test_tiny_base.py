"""``scripts/build-tiny-base`` (``pipelines/tiny_base.py``, ``packline/pretrain.py``):
pretraining the tiny Qwen3-VL from a seed repeats bitwise, and what it saves is an ordinary
HF checkpoint dir that the train stage loads through ``model.path``, the code a real
checkpoint takes."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from packline.pretrain import MANIFEST, PretrainSettings
from packline.qwen.processor import load_processor
from packline.train.setup import build_model
from pipelines.tiny_base import build_tiny_base
from schemas.config import PROJECT_ROOT, load_config

pytestmark = pytest.mark.slow

# a small run: the steps see the same code path as the shipped base's
SMALL = PretrainSettings(steps=3, rows_per_step=1, num_rows=120, warmup_steps=1)


def test_pretraining_repeats_bitwise_and_a_partial_run_saves_nothing(tmp_path: Path):
    first = build_tiny_base(tmp_path / "a", SMALL, work_dir=tmp_path / "wa", steps=2)
    assert not (tmp_path / "a").exists()  # fewer steps than the settings: no checkpoint
    second = build_tiny_base(tmp_path / "b", SMALL, work_dir=tmp_path / "wb")
    assert len(second["losses"]) == 3
    assert second["losses"][:2] == first["losses"]  # fp32, CPU, fixed threads: bitwise
    assert second["losses"][0] > second["losses"][-1]


def test_the_script_saves_a_checkpoint_that_model_path_loads(tmp_path: Path):
    out = tmp_path / "base"
    args = [f"--{k}={v}" for k, v in (("steps", 3), ("rows-per-step", 1), ("num-rows", 120))]
    done = subprocess.run(
        [sys.executable, str(PROJECT_ROOT / "scripts" / "build-tiny-base"), str(out), *args],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "3 steps" in done.stdout and "sha256" in done.stdout
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["settings"]["steps"] == 3 and len(manifest["losses"]) == 3
    assert manifest["command"].startswith("scripts/build-tiny-base")
    weights = out / "model.safetensors"
    assert hashlib.sha256(weights.read_bytes()).hexdigest() == manifest["sha256"]
    assert manifest["bytes"] == weights.stat().st_size

    cfg = load_config(None, [f"work_dir={tmp_path / 'work'}", f"model.path={out}"])
    processor = load_processor(out)  # the built-in processor, saved beside the weights
    model = build_model(cfg, processor)  # AutoModelForImageTextToText.from_pretrained
    assert type(model).__name__ == "Qwen3VLForConditionalGeneration"
    state = model.state_dict()
    saved = load_file(weights)
    assert saved.keys() <= state.keys()
    for name, tensor in saved.items():
        assert torch.equal(state[name], tensor), name
