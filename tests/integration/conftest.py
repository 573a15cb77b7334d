"""Fixtures of the integration tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from stages.connect import connect
from stages.prepare import prepare
from stages.validate import validate
from tests.conftest import make_config
from tests.integration.train_helpers import SMALL


@pytest.fixture(scope="session")
def work(tmp_path_factory) -> Path:
    """A prepared and connected small set, shared by the train tests (read-only)."""
    work = tmp_path_factory.mktemp("train") / "work"
    cfg = make_config(work, *SMALL)
    prepare(cfg)
    connect(cfg)
    validate(cfg)
    return work
