"""Real checkpoints by name: ``model.path`` and ``processor.path`` may be Hugging Face Hub
repo ids, resolved from the local cache ($HF_HOME) and never downloaded unless
``model.download`` says so.

A temp ``HF_HOME`` holds the shipped tiny base in the cache's own layout (``refs/main``, a
snapshot of links into ``blobs/``, as ``huggingface_hub`` writes it): prepare, connect
(which copies the snapshot's processor) and validate run on it by its id, the model loads
from the cache, and the fingerprint hashes the snapshot's files. A repo the cache lacks is
refused before anything runs, with the command that fetches it."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from schemas.config import PROJECT_ROOT, TINY_BASE

pytestmark = pytest.mark.slow

REPO = "packline/tiny-base"


def cache_repo(home: Path, repo_id: str, files: dict[str, bytes], kind: str = "model") -> Path:
    """``home``/hub holding ``repo_id`` (a ``model`` or ``dataset`` repo) with ``files``
    (path in the repo → bytes) as ``huggingface_hub`` caches a download: blobs by hash, a
    snapshot of links into them, ``refs/main``; returns the snapshot dir."""
    repo = home / "hub" / (f"{kind}s--" + repo_id.replace("/", "--"))
    commit = "0123456789abcdef0123456789abcdef01234567"
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True)
    for name, data in sorted(files.items()):
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        link = snapshot / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    return snapshot


def _cache_with_tiny_base(home: Path) -> Path:
    """``home``/hub holding :data:`REPO`, the shipped tiny base; its snapshot dir."""
    return cache_repo(home, REPO, {src.name: src.read_bytes() for src in TINY_BASE.iterdir()})


_SCRIPT = """
import json, sys
from schemas.config import load_config
from stages.prepare import prepare
from stages.connect import connect
from stages.validate import validate
from packline.qwen.processor import load_processor
from packline.train.setup import build_model
from packline.catalog import processor_dir
work, repo = sys.argv[1], sys.argv[2]
cfg = load_config(None, [f"work_dir={work}", f"model.path={repo}", f"processor.path={repo}",
                         "data.num_train=12", "data.num_val=4", "prepare.num_workers=1",
                         "mlflow.enabled=false"])
prepare(cfg)
connect(cfg)
report = validate(cfg)
processor = load_processor(processor_dir(cfg))
model = build_model(cfg, processor).state_dict()
local = load_config(None, [f"work_dir={work}", f"model.path={sys.argv[3]}"])
reference = build_model(local, processor).state_dict()
same = {k: bool((v == reference[k]).all()) for k, v in model.items()}
print(json.dumps({"model_dir": str(cfg.model.dir), "processor_dir": str(cfg.processor.dir),
                  "inputs": {k: str(v) for k, v in cfg.inputs().items()},
                  "errors": report.metrics["validate/errors"],
                  "tensors": len(model), "same_weights": all(same.values())}))
"""


def _env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PACKLINE_WORK_LOCK")}
    return {**env, "HF_HOME": str(home), "HF_HUB_OFFLINE": "1"}


def test_a_repo_id_in_the_local_cache_runs_prepare_connect_validate_and_loads(tmp_path: Path):
    home = tmp_path / "hf"
    snapshot = _cache_with_tiny_base(home)
    result = subprocess.run(
        [sys.executable, "-c", _SCRIPT, str(tmp_path / "work"), REPO, str(TINY_BASE)],
        capture_output=True, text=True, env=_env(home), cwd=PROJECT_ROOT, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["model_dir"] == out["processor_dir"] == str(snapshot)
    assert out["inputs"] == {"processor.path": str(snapshot), "model.path": str(snapshot)}
    assert out["errors"] == 0
    assert out["tensors"] > 0 and out["same_weights"]  # the cached snapshot's weights
    copied = tmp_path / "work" / "connect" / "processor" / "tokenizer.json"
    assert copied.read_bytes() == (TINY_BASE / "tokenizer.json").read_bytes()


def test_a_repo_the_cache_lacks_is_refused_with_the_command_that_fetches_it(tmp_path: Path):
    home = tmp_path / "hf"
    (home / "hub").mkdir(parents=True)
    result = subprocess.run(
        [sys.executable, "-m", "pipelines.cli", "run", "--dryrun", f"work_dir={tmp_path / 'w'}",
         "model.path=Qwen/Qwen3-VL-2B-Instruct", "processor.path=Qwen/Qwen3-VL-2B-Instruct"],
        capture_output=True, text=True, env=_env(home), cwd=PROJECT_ROOT, timeout=300,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr[-3000:]
    err = " ".join(result.stderr.split())
    for key in ("model.path", "processor.path"):
        assert (
            f"{key} Qwen/Qwen3-VL-2B-Instruct is not in the local Hugging Face cache (HF_HOME), "
            "and packline downloads nothing unless told to; fix: run `hf download "
            "Qwen/Qwen3-VL-2B-Instruct`, or set model.download=true"
        ) in err
    assert "Traceback" not in err and not (tmp_path / "w").exists()
