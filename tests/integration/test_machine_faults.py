"""Faults of the machine are reasons, not bugs: the real CLI in subprocesses, on real mounts.

- a work dir on a small tmpfs that fills: exit 2 naming the device and how much the stage
  needs, nothing half-published, the user's files unchanged, and the rerun on a larger
  device succeeds;
- a work dir mounted read-only: exit 2 naming it, nothing changed, the rerun read-write
  succeeds;
- a source this user may not read (root without the capabilities that override file
  modes): exit 2 before anything runs, then the rerun once it is readable succeeds;
- a damaged MLflow store: every command that opens it names it and the fix, and leaves its
  bytes as they were; moved aside, the next run starts a new one.

Each skips, saying why, only where mounting or dropping capabilities is impossible
(``tests/machine.py``); CI runs as root.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
from pathlib import Path

import pytest

from pipelines.cli import main
from schemas.config import load_config
from stages.prepare import prepare
from tests.machine import read_only, remount, run_cli, sha256_tree, tmpfs

pytestmark = pytest.mark.slow

SMALL = ["data.num_train=40", "data.num_val=4", "prepare.num_workers=1"]


def _noise_folder(root: Path, rows: int, side: int = 96) -> Path:
    """A conversation folder of ``rows`` rows, each with its own PNG of random pixels
    (incompressible: about ``3 * side**2`` bytes each)."""
    from PIL import Image

    folder = root / "data"
    (folder / "img").mkdir(parents=True)
    rng = random.Random(0)
    lines = []
    for i in range(rows):
        pixels = bytes(rng.getrandbits(8) for _ in range(3 * side * side))
        Image.frombytes("RGB", (side, side), pixels).save(folder / "img" / f"{i}.png")
        turns = [
            {"from": "human", "value": "<image>\nWhat is it?"},
            {"from": "gpt", "value": "Noise."},
        ]
        lines.append(
            json.dumps({"id": f"n{i}", "images": [f"img/{i}.png"], "conversations": turns})
        )
    (folder / "conversations.jsonl").write_text("\n".join(lines) + "\n")
    return folder


def _no_traceback(result) -> str:
    err = result.stdout + result.stderr
    assert "Traceback" not in err and "a bug in packline" not in err, err[-3000:]
    return " ".join(err.split())


def test_a_work_dir_that_fills_names_the_device_and_what_it_needs_then_reruns_on_more_room(
    tmp_path: Path,
):
    folder = _noise_folder(tmp_path, rows=120)  # ~3.4 MB of images: shards need as much
    before = sha256_tree(folder)
    with tmpfs(tmp_path / "small", size="2m") as mnt:
        work = mnt / "work"
        args = [f"work_dir={work}", f"data.source={folder}", "prepare.num_workers=1"]
        result = run_cli(["run", *args])
        assert result.returncode == 2, result.stderr[-3000:]
        err = _no_traceback(result)
        assert f"no space left on the device holding {work}: prepare had written" in err
        assert (
            "of the way through 'prepare conversations.jsonl': that step alone needs about" in err
        )
        assert "fix: free at least" in err and "or choose a work_dir on a larger device" in err
        assert "prepare failed: a fault of the machine, not of packline" in err
        assert not (work / "prepare").exists()  # nothing half-published
        assert not list(work.rglob(".tmp-*")) and not list(work.rglob(".old-*"))
        assert sha256_tree(folder) == before
        remount(mnt, size="64m")  # the fix: room
        assert main(["stage", "prepare", *args]) == 0
        record = json.loads((work / "prepare" / "_COMPLETE.json").read_text())
        assert record["metrics"]["prepare/rows_accepted"] == 120
    assert sha256_tree(folder) == before


def test_a_read_only_work_dir_is_named_and_left_as_it_was_then_reruns_read_write(
    tmp_path: Path,
):
    work = tmp_path / "work"
    prepare(load_config(None, [f"work_dir={work}", *SMALL]))
    before = sha256_tree(work)
    with read_only(work):
        result = run_cli(["stage", "prepare", f"work_dir={work}", *SMALL, "--force"])
        assert result.returncode == 2, result.stderr[-3000:]
        err = _no_traceback(result)
        assert f"cannot write {work}/.packline.lock: its file system is mounted read-only" in err
        assert "fix: choose a work_dir on a writable file system" in err
        assert sha256_tree(work) == before
    assert main(["stage", "prepare", f"work_dir={work}", *SMALL, "--force"]) == 0


def test_a_source_this_user_may_not_read_and_a_work_dir_it_may_not_write_are_named(
    tmp_path: Path,
):
    """As root without the capabilities that override file modes, as any user is."""
    folder = _noise_folder(tmp_path, rows=4, side=16)
    before = sha256_tree(folder)
    rows = folder / "conversations.jsonl"
    rows.chmod(0)
    runs = tmp_path / "runs"
    runs.mkdir(mode=0o555)  # not writable, even for its owner
    work = runs / "work"
    args = [
        "stage",
        "prepare",
        f"work_dir={work}",
        f"data.source={folder}",
        "prepare.num_workers=1",
    ]
    result = run_cli(args, without_dac=True)
    assert result.returncode == 2, result.stderr[-3000:]
    err = _no_traceback(result)
    assert f"data.source: cannot read {rows} (permission denied for root)" in err
    assert "fix: make it readable for this user (chmod/chown)" in err
    rows.chmod(0o644)
    result = run_cli(args, without_dac=True)
    assert result.returncode == 2, result.stderr[-3000:]
    err = _no_traceback(result)
    assert f"permission denied writing {work} (as root); fix: make the work dir writable" in err
    assert not work.exists() and sha256_tree(folder) == before
    runs.chmod(0o755)
    again = run_cli(args, without_dac=True)
    assert again.returncode == 0, again.stderr[-3000:]
    assert sha256_tree(folder) == before


def test_a_damaged_mlflow_store_is_named_by_every_command_that_opens_it_and_never_changed(
    tmp_path: Path, capsys
):
    work = tmp_path / "work"
    assert run_cli(["stage", "prepare", f"work_dir={work}", *SMALL]).returncode == 0
    store = work / "mlflow.db"
    data = bytearray(store.read_bytes())
    data[100:4096] = os.urandom(3996)  # a page of the schema overwritten
    store.write_bytes(bytes(data))
    digest = hashlib.sha256(store.read_bytes()).hexdigest()
    result = run_cli(["stage", "prepare", f"work_dir={work}", *SMALL, "--force"], timeout=120)
    assert result.returncode == 2, result.stderr[-3000:]
    outputs = {"stage": _no_traceback(result)}
    for command in (["compare"], ["ui", "--port", "0"]):  # the CLI in this process
        assert main([*command, f"work_dir={work}", *SMALL]) == 2
        err = capsys.readouterr().err
        assert "Traceback" not in err
        outputs[command[0]] = " ".join(err.split())
    for command, err in outputs.items():
        assert f"the MLflow store is damaged (1 problem(s)): - {store} is not a readable" in err
        assert f"fix: move it aside to start a new one (mv {store} {store}.broken" in err
        assert hashlib.sha256(store.read_bytes()).hexdigest() == digest, command
    store.rename(store.with_name("mlflow.db.broken"))
    assert main(["stage", "prepare", f"work_dir={work}", *SMALL, "--force"]) == 0
    assert store.is_file()
