"""An Energon dataset in Megatron-Bridge's ChatML layout as ``data.source``, as a user runs
it: ``packline run``'s prepare adopts it in place (every sample checked, the bad ones in
``rejects.jsonl`` with their reason and left out by prepare's own split config, no shard
copied or rewritten), and its connect, validate and a short training run take the good ones
(tutorial page 2 runs ``packline stage prepare`` alone on such a dataset). The dataset is
written by webdataset's writer and indexed by Energon's own prepare
(``tests/integration/chatml_dataset.py``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from itertools import islice
from pathlib import Path

import pandas as pd
import pytest

from tests.integration.chatml_dataset import file_stats, write_chatml_dataset

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
PACKLINE = [sys.executable, "-m", "pipelines.cli"]
QUICK_TRAIN = [
    "train.max_steps=2",
    "train.save_every=1",
    "train.global_batch_size=2",
    "train.eval_samples=2",
]


def _packline(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*PACKLINE, *args],
        capture_output=True,
        text=True,
        env={**os.environ, "COLUMNS": "160"},
        timeout=600,
        cwd=ROOT,
    )


def test_an_energon_chatml_dataset_is_adopted_in_place_through_the_whole_pipeline(tmp_path):
    written = write_chatml_dataset(tmp_path / "source")
    before = file_stats(written.root)
    work = tmp_path / "work"
    # 10 of the 24 samples are bad on purpose
    common = [f"work_dir={work}", f"data.source={written.root}", "prepare.max_reject_fraction=0.5"]

    run = _packline("run", *common, *QUICK_TRAIN)
    assert run.returncode == 0, run.stderr[-3000:]
    out = work / "prepare"
    shard_of = {key: shard for shard, keys in written.shards.items() for key in keys}
    rejects = [json.loads(line) for line in (out / "rejects.jsonl").read_text().splitlines()]
    assert {r["id"]: r["reason"] for r in rejects} == {
        f"{shard_of[key]}/{key}": reason for key, reason in written.bad.items()
    }
    manifest = pd.read_parquet(out / "manifest.parquet")
    assert dict(zip(manifest["key"], manifest["split"], strict=True)) == written.good
    for row in manifest.itertuples():
        assert row.shard == shard_of[row.key] and row.id == f"{row.shard}/{row.key}"
        assert row.num_images == len(written.images[row.key])
    assert not list(out.rglob("*.tar"))  # adopted in place: no shard copied
    assert {"packline.yaml", "bridge.yaml"} <= {p.name for p in out.iterdir()}

    lengths = pd.read_parquet(work / "connect" / "lengths.parquet")
    assert dict(zip(lengths["key"], lengths["split"], strict=True)) == written.good
    report = json.loads((work / "validate" / "report.json").read_text())
    assert report["ok"], report["errors"]
    train_keys = {key for key, split in written.good.items() if split == "train"}
    for mode in ("packed", "unpacked"):
        lines = (work / "train" / mode / "metrics.jsonl").read_text().splitlines()
        steps = [json.loads(line) for line in lines]
        assert [s["step"] for s in steps] == [1, 2]
        trained = [key for s in steps for key in s["keys"]]
        assert trained and set(trained) <= train_keys, trained
    assert file_stats(written.root) == before  # not a shard rewritten, not a file touched

    # the training stream reads the adopted dataset's good train samples, and only those
    from packline.train.setup import training_stream
    from schemas.config import load_config

    cfg = load_config(None, [*common, *QUICK_TRAIN])
    seen: set[str] = set()
    for row in islice(training_stream(cfg).rows(), 40):
        seen.update(row.keys)
        if seen >= train_keys:
            break
    assert seen == train_keys
