"""FSDP2 of a dense model over gloo with 2 ranks (``train.parallel.fsdp``, issue 43 item 3):
the same losses, gradient norms and adapters as one process on the same rows, every weight
held in halves, and checkpoints that cross between the layouts both ways."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from packline.train.distributed import torchrun_command
from stages.connect import connect
from stages.prepare import prepare
from stages.validate import validate
from tests.conftest import make_config
from tests.integration.fsdp_check import FSDP, STEPS
from tests.integration.train_helpers import check_resume_on_one_process

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
ONE_PROCESS = [o for o in FSDP if o not in ("train.parallel.fsdp=true", "train.nproc_per_node=2")]


def _launch(work: Path, mode: str, tmp_path: Path) -> dict:
    out = tmp_path / f"{mode}.json"
    run_dir = work / "train" / "packed"
    cmd = torchrun_command(
        2, "tests.integration.fsdp_check", [str(work), str(run_dir), str(out), mode]
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    subprocess.run(cmd, cwd=ROOT, env=env, check=True, timeout=600)
    return json.loads(out.read_text())


def test_fsdp2_on_two_ranks_trains_like_one_process_and_resumes_across(tmp_path, capsys):
    work = tmp_path / "work"
    cfg = make_config(work, *FSDP)
    prepare(cfg)
    connect(cfg)
    validate(cfg)

    r = _launch(work, "train", tmp_path)
    assert r["engine"] == "ShardedEngine" and r["sharding"] == "fsdp2 over 2 ranks"
    assert r["halves"]
    assert len(r["losses"]) == len(r["reference_losses"]) == STEPS
    for got, want in zip(r["losses"], r["reference_losses"], strict=True):
        assert abs(got - want) <= 1e-5, (r["losses"], r["reference_losses"])
    for got, want in zip(r["grad_norms"], r["reference_grad_norms"], strict=True):
        assert abs(got - want) <= 1e-5 * max(1.0, want)
    assert r["adapter_names_equal"] and r["adapter_max_abs_diff"] <= 1e-5

    # the FSDP2 run's sharded checkpoint loads on one process bitwise and trains one more
    # step there, whose checkpoint (one process, whole tensors) FSDP2 then resumes bitwise
    check_resume_on_one_process(work, ONE_PROCESS, step=STEPS, more=1, capsys=capsys)
    back = _launch(work, "resume", tmp_path)
    assert back["step"] == STEPS + 1
    assert back["adapters_equal"] and back["optimizer_equal"]
    assert back["optimizer_values"] > 0
