"""Artefacts that travel: an adapter saved by packline loads from a copy of its dir, names
its base as the user gave it and keeps the user's file modes; a work dir's MLflow store,
copied elsewhere, reads its artifacts from the copy (the original removed)."""

from __future__ import annotations

import json
import os
import shutil
import stat
from pathlib import Path

import torch
from mlflow.tracking import MlflowClient
from peft import PeftModel
from transformers import AutoModelForImageTextToText

from packline.report.summary import RunSummary
from packline.tracking import Tracker, relocate_artifacts, tracking_uri
from packline.train.adapter import TASK_TYPE, save_adapter
from packline.train.setup import apply_lora
from schemas.config import TINY_BASE
from tests.conftest import make_config


def _modes(root: Path) -> set[tuple[str, int]]:
    return {
        ("dir" if p.is_dir() else "file", stat.S_IMODE(p.stat().st_mode))
        for p in [root, *root.rglob("*")]
    }


def _summary(run: str) -> RunSummary:
    """A run's figures as the train stage records them (``result.json``)."""
    names = RunSummary.__dataclass_fields__
    values = {name: 1 for name in names}
    values.update(
        run=run,
        precision="fp32",
        eval_loss_start=2.5,
        eval_loss=1.25,
        eval_by_kind=None,
        run_id=None,
        evals=[],
        ran={
            "attention": "thd",
            "base_dtype": "float32",
            "adapter_dtype": "float32",
            "compute": "fp32",
            "activation_checkpointing": "false",
            "sharding": "none",
        },
        fill=0.97,
        real_tokens_per_s=12345.0,
        tflops_useful=0.072,
    )
    return RunSummary.from_dict(values)


def test_a_saved_adapter_travels(tmp_path: Path):
    cfg = make_config(tmp_path / "work")
    torch.manual_seed(0)
    base = AutoModelForImageTextToText.from_pretrained(TINY_BASE)
    model = apply_lora(base, cfg.lora)
    with torch.no_grad():  # LoRA B starts at zero: make the adapter change the outputs
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02)
    forecast = {
        "samples": 60,
        "tokens": 9000,
        "buffers": {"64": {"fill": 0.96, "packs": 5}},
        "unpacked": {"fill": 0.08, "rows": 60},
        "flops": {
            "epoch_executed_packed": 4.78e10,
            "epoch_executed_unpacked": 1.55e11,
            "padding_share_packed": 0.0,
            "padding_share_unpacked": 0.69,
        },
    }
    old = os.umask(0o022)
    try:
        dest = save_adapter(
            model, tmp_path / "adapter", cfg, _summary("packed"), forecast, "f" * 64
        )
    finally:
        os.umask(old)
    config = json.loads((dest / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == "models/tiny-base"  # as configs/ names it
    assert config["task_type"] == TASK_TYPE
    assert _modes(dest) == {("dir", 0o755), ("file", 0o644)}
    card = (dest / "README.md").read_text()
    assert card.startswith("---\nbase_model: models/tiny-base\nlibrary_name: peft\n")
    for text in (
        "| forecast fill (buffer 64) | 0.960 | 0.080 |",
        "| executed FLOPs per epoch | 47.8 GFLOP | 155 GFLOP |",
        "eval loss: 2.5000 → 1.2500",
        "12.3k tokens/s",
        "What trained: `thd` attention, the base in float32 and the adapters in float32 "
        "(compute fp32), activation checkpointing off, sharding: none.",
        f"fingerprint `{'f' * 64}`",
        'PeftModel.from_pretrained(base, "path/to/this/adapter")',
    ):
        assert text in card, text

    # The copy loads on a fresh base, the original gone, and computes what the model did.
    copy = tmp_path / "elsewhere" / "adapter"
    shutil.copytree(dest, copy)
    shutil.rmtree(dest)
    ids = torch.arange(1, 33).unsqueeze(0)
    with torch.no_grad():
        expected = model(input_ids=ids).logits
        fresh = AutoModelForImageTextToText.from_pretrained(TINY_BASE)
        loaded = PeftModel.from_pretrained(fresh, copy)
        got = loaded(input_ids=ids).logits
        plain = AutoModelForImageTextToText.from_pretrained(TINY_BASE)(input_ids=ids).logits
    assert (got - expected).abs().max().item() == 0.0
    assert (got - plain).abs().max().item() > 1e-3  # the adapter is loaded, not ignored


def test_a_copied_work_dir_reads_its_artifacts_from_the_copy(tmp_path: Path):
    work = tmp_path / "work"
    cfg = make_config(work)
    run = Tracker.start(cfg, "stage")
    (tmp_path / "note.txt").write_text("logged")
    run.log_artifact(tmp_path / "note.txt")
    run.end()

    copy = tmp_path / "moved" / "work"
    shutil.copytree(work, copy)
    shutil.rmtree(work)
    moved = make_config(copy)
    assert relocate_artifacts(moved) == 1
    assert relocate_artifacts(moved) == 0  # already here: nothing to rewrite
    client = MlflowClient(tracking_uri=tracking_uri(moved))
    (found,) = client.search_runs([client.get_experiment_by_name(cfg.name).experiment_id])
    assert found.info.artifact_uri == (copy / "mlartifacts").as_uri() + (f"/{run.run_id}/artifacts")
    got = client.download_artifacts(run.run_id, "note.txt", str(tmp_path / "dl"))
    assert Path(got).read_text() == "logged"
