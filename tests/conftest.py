"""Shared fixtures: configs pointed at tmp dirs, small built-in data."""

from __future__ import annotations

import io
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from packline.cache import CACHE_DIR_ENV
from schemas.config import PipelineConfig, load_config

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    # Several xdist workers share the cores: each gets its share of torch's intra-op threads
    # (and so does every subprocess it starts, which inherits the variable), or their OpenMP
    # threads oversubscribe the cores and a training test runs 3x slower (measured on 2
    # cores: 637 s instead of 190 s). Set before torch loads.
    _share = len(os.sched_getaffinity(0)) // _WORKERS
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, _share)))


@pytest.fixture(scope="session", autouse=True)
def packline_cache(tmp_path_factory) -> Iterator[Path]:
    """packline's cache in a dir of this test session: the tiny processor is built once per
    session, for real, then copied (subprocesses inherit the variable); nothing reaches
    ``~/.cache``."""
    path = tmp_path_factory.mktemp("packline-cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(CACHE_DIR_ENV, str(path))
        yield path


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


def png_bytes(size: tuple[int, int], colour: str) -> bytes:
    """A PNG of ``size`` with a ``colour`` disc on grey (a real image file's bytes)."""
    from PIL import Image, ImageDraw

    img = Image.new("RGB", size, "grey")
    ImageDraw.Draw(img).ellipse([8, 8, size[0] // 2, size[1] // 2], fill=colour)
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()
