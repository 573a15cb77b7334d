"""``packline run --dryrun`` on SLURM: the generated sbatch scripts and Bridge overrides match
the golden files in ``tests/golden/``.

Regenerate after an intended change (then review the diff):

    PACKLINE_UPDATE_GOLDEN=1 .venv/bin/python -m pytest tests/unit/test_slurm_dryrun.py
"""

from __future__ import annotations

import io
import os
import re
from pathlib import Path

import pytest

from packline.megatron.container import PACKLINE_IMAGE
from pipelines.cli import main
from pipelines.experiment import dryrun_text, write_resolved_config
from schemas.config import PROJECT_ROOT, load_config
from tests.unit.test_megatron_overrides import processor_stand_in

GOLDEN = Path(__file__).resolve().parents[1] / "golden"
CONFIGS = ["qwen3_vl_8b_lora_1node", "qwen3_vl_30b_a3b_lora_ep8_slurm"]
UPDATE = os.environ.get("PACKLINE_UPDATE_GOLDEN") == "1"


@pytest.fixture(autouse=True)
def _empty_stdin(monkeypatch):
    """NeMo-Run packages the code with invoke, which reads stdin; pytest's raises on read."""
    monkeypatch.setattr("sys.stdin", io.StringIO(""))


def normalized(text: str, work: Path) -> str:
    """Stable text: the work dir, NeMo-Run's experiment id and torchrun's random rdzv id."""
    text = text.replace(str(work), "<WORK>")
    text = re.sub(r"_\d{16,}", "_<EXPERIMENT_ID>", text)
    return re.sub(r"--rdzv-id \d+", "--rdzv-id <RDZV_ID>", text)


def cluster_args(name: str, tmp_path: Path) -> tuple[Path, list[str]]:
    return PROJECT_ROOT / "configs" / f"{name}.yaml", [
        f"work_dir={tmp_path / 'work'}",
        f"processor.path={processor_stand_in(tmp_path)}",  # for the cluster's processor dir
    ]


@pytest.mark.parametrize("name", CONFIGS)
def test_dryrun_sbatch_and_overrides_match_golden(name: str, tmp_path: Path):
    path, overrides = cluster_args(name, tmp_path)
    cfg = load_config(path, overrides)
    text = normalized(dryrun_text(cfg, write_resolved_config(cfg)), cfg.work_path)
    assert str(tmp_path) not in text
    golden = GOLDEN / f"{name}.sbatch.txt"
    if UPDATE:
        golden.write_text(text)
    assert text == golden.read_text(), f"regenerate with PACKLINE_UPDATE_GOLDEN=1 ({golden})"


def test_golden_sbatch_train_job_has_gpus_torchrun_and_container():
    text = (GOLDEN / "qwen3_vl_30b_a3b_lora_ep8_slurm.sbatch.txt").read_text()
    train = text.split("## job 4/4: train")[1].split("## train: Megatron-Bridge")[0]
    assert "#SBATCH --gpus-per-node=8" in train and "#SBATCH --kill-on-invalid-dep=yes" in train
    assert "torchrun" in train and "--nproc-per-node 8" in train
    assert f"--container-image {PACKLINE_IMAGE} " in train  # containers/Dockerfile's image
    assert "<WORK>:<WORK>" in train  # the work dir at the same path in the container
    prepare = text.split("## job 1/4: prepare")[1].split("## job 2/4")[0]
    assert "--gpus-per-node" not in prepare and "torchrun" not in prepare
    assert "model.expert_model_parallel_size=8" in text


def test_cli_dryrun_prints_scripts_and_overrides_without_submitting(tmp_path: Path, capsys):
    path, overrides = cluster_args(CONFIGS[0], tmp_path)
    assert main(["run", str(path), *overrides, "--dryrun"]) == 0
    out = capsys.readouterr().out
    assert out.count("#!/bin/bash") == 4 and "dataset.packing_buffer_size=16" in out
    assert "qwen3_vl_8b_peft_energon_config" in out
    experiments = tmp_path / "work" / "nemorun" / "experiments"
    assert not list(experiments.rglob("_DONE"))  # nothing was launched


def test_megatron_backend_on_local_executor_exits_2(tmp_path: Path, capsys):
    path, overrides = cluster_args(CONFIGS[0], tmp_path)
    assert main(["run", str(path), *overrides, "--executor", "local", "--dryrun"]) == 2
    assert "--executor slurm" in capsys.readouterr().err
