"""``scripts/build-tiny-base`` (``pipelines/tiny_base.py``, ``packline/shapes/pretrain.py``):
pretraining the tiny Qwen3-VL from a seed repeats bitwise, and what it saves is an ordinary
HF checkpoint dir that the train stage loads through ``model.path``, the code a real
checkpoint takes."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from packline.qwen.processor import copy_tiny_processor, load_processor, processor_geometry
from packline.shapes.pretrain import MANIFEST, PretrainSettings
from packline.train.setup import build_model
from pipelines.tiny_base import build_tiny_base
from schemas.config import PROJECT_ROOT, TINY_BASE, load_config
from tests.losses import assert_losses_repeat

pytestmark = pytest.mark.slow

# a small run: the steps see the same code path as the shipped base's
SMALL = PretrainSettings(steps=3, rows_per_step=1, num_rows=120, warmup_steps=1)


def test_pretraining_repeats_bitwise_and_a_seeing_phase_from_a_saved_first_is_one_build(
    tmp_path: Path,
):
    """A partial run saves nothing and repeats the steps of a whole one bitwise; building
    both phases in one go and building the seeing phase from the first phase's checkpoint
    (``--first-phase``) save the same bits; a checkpoint of other settings is refused."""
    first = build_tiny_base(tmp_path / "a", SMALL, work_dir=tmp_path / "wa", steps=2)
    assert not (tmp_path / "a").exists()  # fewer steps than the settings: no checkpoint
    second = build_tiny_base(tmp_path / "b", SMALL, work_dir=tmp_path / "wb")
    assert len(second["losses"]) == 3
    assert second["losses"][:2] == first["losses"]  # fp32, CPU, fixed threads: bitwise
    assert second["losses"][0] > second["losses"][-1]

    two = PretrainSettings(**{**asdict(SMALL), "seeing_steps": 2, "seeing_rows": 60})
    whole = build_tiny_base(tmp_path / "whole", two, work_dir=tmp_path / "w1")
    assert len(whole["losses"]) == 5 and whole["losses"][:3] == second["losses"]
    resumed = build_tiny_base(
        tmp_path / "resumed", two, work_dir=tmp_path / "w2", first_phase=tmp_path / "b"
    )
    assert resumed["losses"] == whole["losses"]  # fp32, CPU, fixed threads: bitwise
    assert resumed["sha256"] == whole["sha256"]
    other = PretrainSettings(**{**asdict(two), "lr": 1e-3})
    with pytest.raises(ValueError, match="not the first phase of these settings"):
        build_tiny_base(tmp_path / "x", other, work_dir=tmp_path / "w3", first_phase=tmp_path / "b")
    assert not (tmp_path / "w3").exists()  # refused before any rows are written


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

    _check_loads_through_model_path(out, tmp_path, f"model.path={out}")


def _check_loads_through_model_path(base: Path, tmp_path: Path, *overrides: str) -> None:
    """The config (with ``overrides``) names ``base``; the train stage's model code loads it
    whole, with the built-in processor that was saved beside it."""
    cfg = load_config(None, [f"work_dir={tmp_path / 'work'}", *overrides])
    assert Path(cfg.model.path) == base
    processor = load_processor(base)  # the built-in processor, saved beside the weights
    builtin = load_processor(copy_tiny_processor(tmp_path / "builtin"))
    assert processor.tokenizer.get_vocab() == builtin.tokenizer.get_vocab()
    assert processor_geometry(processor) == processor_geometry(builtin)
    model = build_model(cfg, processor)  # AutoModelForImageTextToText.from_pretrained
    assert type(model).__name__ == "Qwen3VLForConditionalGeneration"
    state = model.state_dict()
    saved = load_file(base / "model.safetensors")
    assert saved.keys() <= state.keys()
    for name, tensor in saved.items():
        assert torch.equal(state[name], tensor), name


def test_the_shipped_base_is_the_default_model_and_what_its_manifest_says(tmp_path: Path):
    manifest = json.loads((TINY_BASE / MANIFEST).read_text())
    assert manifest["command"] == "scripts/build-tiny-base"  # the defaults, nothing else
    # the script's defaults today (a field the manifest predates takes its default: the
    # seeing phase's, whose default of 0 steps is what the base was built with)
    settings = PretrainSettings(**manifest["settings"])
    assert settings == PretrainSettings()
    assert len(manifest["losses"]) == settings.total_steps
    weights = TINY_BASE / "model.safetensors"
    assert hashlib.sha256(weights.read_bytes()).hexdigest() == manifest["sha256"]
    assert manifest["bytes"] == weights.stat().st_size < 10 * 2**20  # small enough to commit
    _check_loads_through_model_path(TINY_BASE, tmp_path)  # configs/tiny_cpu.yaml's model.path


def test_the_shipped_base_repeats_its_first_pretraining_steps(tmp_path: Path):
    """The script's first steps, rerun from the manifest's settings, give its losses."""
    manifest = json.loads((TINY_BASE / MANIFEST).read_text())
    settings = PretrainSettings(**manifest["settings"])
    rerun = build_tiny_base(tmp_path / "base", settings, work_dir=tmp_path / "w", steps=3)
    assert not (tmp_path / "base").exists()
    recorded_on = {**manifest, "threads": settings.threads}  # the threads it pretrained on
    assert_losses_repeat(
        rerun["losses"], manifest["losses"][:3], where=recorded_on, threads=settings.threads
    )


def test_what_the_shipped_base_perceives():
    """The perception probe on the shipped base (figures of 60 pictures each in
    models/README.md): it names a lone shape's colour, counts above chance, and every
    attribute is read from as many words as pictures."""
    from transformers import AutoModelForImageTextToText

    from packline.shapes.perception import ATTRIBUTES, perception

    model = AutoModelForImageTextToText.from_pretrained(TINY_BASE, dtype=torch.float32)
    figures = perception(model, load_processor(TINY_BASE), pictures=20)
    assert tuple(figures) == ATTRIBUTES
    assert all(f["words"] == 20 and 0 < f["chance"] < 1 for f in figures.values())
    assert figures["colour"]["accuracy"] >= 0.9 > figures["colour"]["chance"]
    assert figures["count"]["accuracy"] > figures["count"]["chance"]
