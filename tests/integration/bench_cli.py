"""Run ``packline bench WHAT --json`` as a user does: a subprocess on a config of its own."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def run_bench(what: str, config_yaml: str, tmp: Path, *options: str) -> tuple[dict, Path, Path]:
    """(the printed JSON object, the config path, the work dir) of ``bench what`` on a
    config written from ``config_yaml`` under ``tmp``, with the bench's own ``options``."""
    config = tmp / "small.yaml"
    config.write_text(config_yaml)
    work = tmp / "bench"
    cmd = [sys.executable, "-m", "pipelines.cli", "bench", what, "--json", *options]
    out = subprocess.run(
        [*cmd, "--config", str(config), "--work-dir", str(work)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout), config, work
