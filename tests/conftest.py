"""Shared fixtures: configs pointed at tmp dirs, small built-in data."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from schemas.config import PipelineConfig, load_config

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def make_config(work: Path, *overrides: str) -> PipelineConfig:
    """The default config with its work dir in ``work`` and small counts, plus overrides."""
    return load_config(
        None,
        [
            f"work_dir={work}",
            "data.num_train=60",
            "data.num_val=8",
            "prepare.num_workers=1",
            *overrides,
        ],
    )


@pytest.fixture
def small_cfg(tmp_path: Path) -> PipelineConfig:
    return make_config(tmp_path / "work")
