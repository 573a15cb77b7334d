from __future__ import annotations

from pathlib import Path

from pipelines.experiment import stages_to_launch
from stages.base import invalidate_from, read_record
from stages.connect import connect
from stages.prepare import prepare
from stages.runner import run_stage
from stages.validate import validate
from tests.conftest import make_config


def test_stage_records_decide_what_reruns(tmp_path: Path):
    work = tmp_path / "work"
    cfg = make_config(work, "data.num_train=30", "data.num_val=4", "mlflow.enabled=false")
    assert stages_to_launch(cfg) == ["prepare", "connect", "validate", "train"]
    prepare(cfg)
    assert stages_to_launch(cfg) == ["connect", "validate", "train"]
    connect(cfg)
    assert stages_to_launch(cfg) == ["validate", "train"]
    validate(cfg)
    assert stages_to_launch(cfg) == ["train"]

    # A setting only connect reads reruns connect and what follows; prepare's record matches.
    longer = make_config(work, "data.num_train=30", "data.num_val=4", "packing.seq_length=4096")
    assert stages_to_launch(longer) == ["connect", "validate", "train"]
    # A setting only validate and train read leaves connect's record matching.
    targets = make_config(
        work, "data.num_train=30", "data.num_val=4", "lora.target_modules=[q_proj]"
    )
    assert stages_to_launch(targets) == ["validate", "train"]
    # A data setting reruns everything.
    more = make_config(work, "data.num_train=31", "data.num_val=4")
    assert stages_to_launch(more) == ["prepare", "connect", "validate", "train"]

    # --from connect drops connect's record (and those after it), keeps prepare's.
    here = cfg.work_path
    before = read_record(here, "prepare")
    invalidate_from(here, "connect")
    assert read_record(here, "connect") is None and read_record(here, "prepare") == before
    assert read_record(here, "validate") is None
    assert stages_to_launch(cfg) == ["connect", "validate", "train"]

    # run_stage skips an up-to-date stage without touching its outputs.
    result = run_stage(cfg, "prepare")
    assert result.skipped and read_record(here, "prepare") == before
    forced = run_stage(cfg, "prepare", force=True)
    assert not forced.skipped
    assert read_record(here, "prepare")["finished_at"] >= before["finished_at"]
