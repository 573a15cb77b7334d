"""Every setting has its range, declared once on its field, checked at load and listed all at
once: each numeric setting of the schema refuses the first value outside its range (and a
float ``inf`` / ``nan``), naming the key and the fix; the cross-file limits (the model's
context length, the processor's pixel bounds, a packing round's memory) are refused with
them; the CLI lists every bad value of one config together, exit 2, no traceback."""

from __future__ import annotations

import json
import subprocess
import sys
import typing
from dataclasses import fields, is_dataclass
from pathlib import Path

import pytest

from schemas import config as schema
from schemas.config import PROJECT_ROOT, PipelineConfig, load_config
from schemas.errors import UserError
from schemas.ranges import Range, field_range


def _settings(cls: type = PipelineConfig, prefix: str = "") -> list[tuple[str, object, type]]:
    """(dotted key, field, type hint) of every leaf setting of the schema."""
    hints = typing.get_type_hints(cls, vars(schema))
    out = []
    for f in fields(cls):
        key = f"{prefix}.{f.name}" if prefix else f.name
        hint = hints[f.name]
        args = typing.get_args(hint)
        if type(None) in args:  # int | None: the range is of the int
            (hint,) = [a for a in args if a is not type(None)]
        if is_dataclass(hint):
            out += _settings(hint, key)
        else:
            out.append((key, f, hint))
    return out


def _numeric(hint: object) -> bool:
    return (
        hint in (int, float) or typing.get_origin(hint) is list and typing.get_args(hint) == (int,)
    )


NUMERIC = [(key, f, hint) for key, f, hint in _settings() if _numeric(hint)]


def test_every_numeric_setting_declares_its_range():
    missing = [key for key, f, hint in NUMERIC if field_range(f) is None]
    assert missing == []
    assert len(NUMERIC) >= 50  # every count, size, rate and bound of the schema


def _just_outside(rng: Range, hint: object) -> list[str]:
    """Override values just outside ``rng`` (the override syntax)."""
    if typing.get_origin(hint) is list:
        out = ["[]"] if rng.nonempty else []
        if rng.each_ge is not None:
            out.append(f"[{int(rng.each_ge) - 1}]")
        return out
    out = []
    if rng.ge is not None:
        out.append(str(rng.ge - 1 if hint is int else rng.ge - 1e-9))
    if rng.gt is not None:
        out.append(str(rng.gt))
    if rng.le is not None:
        out.append(str(rng.le + 1 if hint is int else rng.le + 1e-9))
    if rng.lt is not None:
        out.append(str(rng.lt))
    if hint is float:
        out += ["inf", "nan", "-inf"]
    return out


CASES = [(key, value) for key, f, hint in NUMERIC for value in _just_outside(field_range(f), hint)]


@pytest.mark.parametrize(("key", "value"), CASES, ids=[f"{k}={v}" for k, v in CASES])
def test_a_value_just_outside_a_range_is_refused_at_load_with_its_fix(key: str, value: str):
    with pytest.raises(UserError) as info:
        load_config(None, [f"{key}={value}"])
    mine = [p for p in info.value.problems if p.startswith(f"{key} must be")]
    assert len(mine) == 1, info.value.problems
    assert f"; fix: set {key} to " in mine[0]


def test_the_bound_itself_is_accepted():
    cfg = load_config(
        None,
        ["prepare.val_fraction=0", "train.weight_decay=0", "connect.num_workers=0",
         "train.adam_beta2=0.5", "validate.min_forecast_fill=1", "data.video_share=1"],
    )  # fmt: skip
    assert cfg.prepare.val_fraction == 0 and cfg.validate.min_forecast_fill == 1


def test_a_model_whose_context_is_huge_is_bounded_by_a_packing_rounds_memory(tmp_path: Path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(
        json.dumps({"model_type": "qwen3_vl", "text_config": {"max_position_embeddings": 10**12}})
    )
    with pytest.raises(UserError) as info:
        load_config(None, [f"model.path={model}", f"packing.seq_length={10**11}"])
    (problem,) = info.value.problems
    assert problem.startswith("packing.seq_length 100,000,000,000 with buffers of up to 1,024")
    assert "GiB, more than half of this machine's" in problem and "; fix: " in problem
    assert load_config(None, [f"model.path={model}", "packing.seq_length=200000"])


#: A careless user's config: every value below is one the pipeline cannot run with.
EVERY_BAD_VALUE = {
    "train.lr=inf": "train.lr must be a finite number > 0, got inf",
    "train.grad_clip=nan": "train.grad_clip must be a finite number > 0, got nan",
    "train.weight_decay=nan": "train.weight_decay must be a finite number >= 0, got nan",
    "train.adam_beta1=1.0": "train.adam_beta1 must be in (0, 1), got 1",
    "train.warmup_steps=-1": "train.warmup_steps must be >= 0, got -1",
    "train.num_workers=-1": "train.num_workers must be >= 0, got -1",
    "connect.num_workers=-2": "connect.num_workers must be >= 0, got -2",
    "train.save_every=0": "train.save_every must be >= 1, got 0",
    "train.eval_every=-1": "train.eval_every must be >= 0, got -1",
    "train.eval_samples=-3": "train.eval_samples must be >= 0, got -3",
    "lora.target_modules=[]": "lora.target_modules and lora.target_parameters are both empty",
    "lora.alpha=0": "lora.alpha must be > 0, got 0",
    "lora.rank=0": "lora.rank must be > 0, got 0",
    "processor.max_pixels=2000": "processor.max_pixels 2,000 is below the processor's own "
    "min_pixels",
    "packing.seq_length=1000000000": "packing.seq_length 1,000,000,000 exceeds the model's "
    "context length 128,000",
}


def test_validate_names_every_bad_value_of_a_config_at_once(tmp_path: Path):
    result = subprocess.run(
        [sys.executable, "-m", "pipelines.cli", "stage", "validate", f"work_dir={tmp_path}",
         *EVERY_BAD_VALUE],
        capture_output=True, text=True, cwd=PROJECT_ROOT, timeout=300,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr[-3000:]
    err = result.stderr
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.startswith("  - ")]
    for expected in EVERY_BAD_VALUE.values():
        assert sum(expected in line for line in lines) == 1, (expected, err)
    assert all("; fix: " in line for line in lines), lines
    # plus the packing round's memory at 10^9 tokens: one line per problem, none twice
    assert len(lines) == len(set(lines)) == len(EVERY_BAD_VALUE) + 1
    assert not (tmp_path / "validate").exists()
