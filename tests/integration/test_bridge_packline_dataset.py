"""Megatron-Bridge trains with packline's packer: packline's dataset for Bridge, run by Bridge
main's own data path (the vendored archive, module files unchanged: ``tests/bridge_data.py``)
in a subprocess (``tests/integration/bridge_main_packs.py``).

- ``get_dataset_provider`` returns its protocol adapter for packline's ``DatasetProvider``
  (a Bridge bump that drops the protocol fails here), and Bridge's ``EnergonMultiModalDataModule``
  built by it yields packline's packs;
- for every pack packline's encoder emits, Bridge's stock ``QwenVLTaskEncoder`` given the same
  member samples in the same order makes bitwise identical batch tensors, over text-only,
  image, multi-image and video samples;
- Bridge's train loader saved with samples carried over and restored yields the same next 20
  packs.

All with FLOPs balance on (``packing.balance: flops``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from packline.megatron.fields import CLASSES
from packline.megatron.overrides import PACKLINE_DATASET_CLASS
from stages.connect import connect
from stages.prepare import prepare
from tests.bridge_data import bridge_main_tree
from tests.conftest import make_config

ROOT = Path(__file__).resolve().parents[2]
MEGATRON = (
    "train.backend=megatron",
    "mlflow.enabled=false",
    "lora.target_modules=[q_proj,k_proj,v_proj,o_proj]",
    "packing.packing_buffer_size=16",
    # CP 2: every conversation aligned to 4 tokens, so the padded THD boundaries are compared
    "packing.context_parallel=2",
    "packing.balance=flops",  # FLOPs balance too, through Bridge's data path
    "data.num_train=160",
    "data.num_val=8",
)
NUM_PACKS = 30

pytestmark = pytest.mark.slow


def test_bridge_trains_on_packlines_packs_bitwise_as_its_own_encoder_makes_them(tmp_path: Path):
    overrides = [f"work_dir={tmp_path / 'work'}", *MEGATRON]
    cfg = make_config(tmp_path / "work", *MEGATRON)
    prepare(cfg)
    connect(cfg)
    (tmp_path / "overrides.json").write_text(json.dumps(overrides))
    out = tmp_path / "report.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(bridge_main_tree()), str(ROOT)])}
    script = ROOT / "tests/integration/bridge_main_packs.py"
    result = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "overrides.json"), str(out), str(NUM_PACKS)],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads(out.read_text())

    assert report["is_dataset_provider"] and report["provider"] == "protocol_adapter"
    assert report["balance_target"] > 0  # packline's encoder balances by connect's FLOPs
    # the field table validate checks overrides against (no Bridge import) has them all
    _, plain, nested = CLASSES[PACKLINE_DATASET_CLASS]
    shipped = {*plain.split(), *nested} - {"dataloader_type"}  # DataloaderConfig's, redeclared
    assert report["fields"] == sorted(shipped)

    lengths = pd.read_parquet(cfg.work_path / "connect" / "lengths.parquet").set_index("key")
    packs = report["packs"]
    assert len(packs) == NUM_PACKS
    for pack in packs:
        assert pack["differs"] == [], pack["keys"]
        assert pack["lengths"] == [int(lengths.loc[k, "total_tokens"]) for k in pack["keys"]]
        assert pack["tokens"] <= cfg.packing.seq_length
    compared = {name for pack in packs for name in pack["compared"]}
    assert compared >= {
        "input_ids", "labels", "loss_mask", "position_ids", "cu_seqlens_q", "cu_seqlens_kv",
        "cu_seqlens_q_padded", "cu_seqlens_kv_padded", "visual_inputs.pixel_values",
        "visual_inputs.image_grid_thw", "visual_inputs.pixel_values_videos",
        "visual_inputs.video_grid_thw",
    }, compared  # fmt: skip
    members = lengths.loc[[k for p in packs for k in p["keys"]]]
    assert (members["num_images"] == 0).any() and (members["num_videos"] == 0).any()  # text
    assert (members["num_images"] == 1).any() and (members["num_images"] >= 2).any()
    assert (members["num_videos"] >= 1).any()
    assert sum(len(p["keys"]) > 1 for p in packs) > NUM_PACKS // 2  # packed, not one per row

    assert report["carried_at_save"]
    assert report["resumed"]["got"] == report["resumed"]["expected"]
