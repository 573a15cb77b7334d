"""Each fault of the machine, made for real (a tmpfs that fills, a read-only mount, a path
under a file, a loop of links, sqlite on a full device), is a reason with its path and
fix (``packline/faults.py``); anything else is not one. Bad values of the CLI's own options
are usage errors, and a config whose work dir or source cannot be one is refused at load."""

from __future__ import annotations

import errno
import os
import sqlite3
import threading
from pathlib import Path

import pytest

from packline.faults import WRITTEN, discard_partial, machine_fault, quiet_thread_faults
from packline.progress import progress
from pipelines.cli import main
from schemas.config import load_config
from schemas.errors import UserError
from tests.machine import remount, tmpfs


def _fill(path: Path) -> OSError:
    """Write ``path`` until its device is full; the real error."""
    with pytest.raises(OSError) as info, path.open("wb") as f:
        while True:
            f.write(b"\0" * 65536)
            f.flush()
    return info.value


def test_a_full_device_is_named_with_what_the_stage_wrote_and_how_far_it_got(tmp_path: Path):
    with tmpfs(tmp_path / "small", size="256k") as mnt:
        partial = mnt / ".tmp-prepare-1"
        partial.mkdir()
        with progress(disable=True) as bar:  # the stage's progress when the device filled
            task = bar.add_task("prepare conversations.jsonl", total=100)
            bar.update(task, completed=25)
        exc = _fill(partial / "train-000000.tar")
        assert exc.errno == errno.ENOSPC
        discard_partial(partial, exc)  # what a failing stage does with its output
        assert not partial.exists() and getattr(exc, WRITTEN) >= 200_000
        (problem,) = machine_fault(exc, mnt, stage="prepare").problems
        assert problem.startswith(f"no space left on the device holding {mnt}: prepare had")
        assert (
            "25% of the way through 'prepare conversations.jsonl': that step alone needs" in problem
        )
        assert "fix: free at least" in problem
        # sqlite says the same in its own words (MLflow's store on that device)
        con = sqlite3.connect(mnt / "mlflow.db")
        with pytest.raises(sqlite3.OperationalError) as info:
            con.execute("CREATE TABLE t (x BLOB)")
            _fill(mnt / "ballast")
            while True:
                con.execute("INSERT INTO t VALUES (zeroblob(65536))")
                con.commit()
        con.close()
        assert "full" in str(info.value)
        (problem,) = machine_fault(info.value, mnt).problems
        assert problem.startswith(f"no space left on the device holding {mnt} (")


def test_a_read_only_mount_a_file_in_the_path_and_a_loop_are_each_named(tmp_path: Path):
    with tmpfs(tmp_path / "ro", size="64k") as mnt:
        remount(mnt, read_only=True)
        with pytest.raises(OSError) as info:
            (mnt / "work").mkdir()
        (problem,) = machine_fault(info.value, mnt / "work").problems
        assert problem == (
            f"cannot write {mnt / 'work'}: its file system is mounted read-only; fix: choose a "
            "work_dir on a writable file system, or remount it read-write"
        )
    blocker = tmp_path / "runs"
    blocker.write_text("not a dir")
    with pytest.raises(OSError) as info:
        (blocker / "x" / "work").mkdir(parents=True)
    (problem,) = machine_fault(info.value).problems
    assert problem.startswith(f"cannot use {blocker / 'x' / 'work'} as a directory: {blocker} is")
    (tmp_path / "a.png").symlink_to(tmp_path / "b.png")
    (tmp_path / "b.png").symlink_to(tmp_path / "a.png")
    with pytest.raises(OSError) as info:
        (tmp_path / "a.png").read_bytes()
    assert (
        machine_fault(info.value)
        .problems[0]
        .endswith("is a loop of symbolic links; fix: point the link at a real file or dir")
    )


def test_nemo_runs_log_copy_on_a_full_device_is_one_line_not_a_traceback(
    tmp_path: Path, capsys, monkeypatch
):
    """torchx's Tee (NeMo-Run's local executor copies a task's output to its log with it)
    writes from a thread; /dev/full fails every write with ENOSPC, as a full work dir does.
    Any other exception in a thread goes to the hook that was there before."""
    from torchx.schedulers.streams import Tee

    others: list[BaseException | None] = []

    def recorder(args: threading.ExceptHookArgs) -> None:
        others.append(args.exc_value)

    monkeypatch.setattr(threading, "excepthook", recorder)
    source = tmp_path / "stdout.log"
    source.write_bytes(b"a stage's output\n")

    def bug():
        raise ValueError("a real bug")

    with quiet_thread_faults():
        tee = Tee(open("/dev/full", "wb", buffering=0), str(source))  # noqa: SIM115 - Tee closes it
        tee.thread.join(timeout=30)
        thread = threading.Thread(target=bug)
        thread.start()
        thread.join()
    assert not tee.thread.is_alive()
    err = capsys.readouterr().err
    assert err.startswith("note: background thread ") and err.count("\n") == 1, err
    assert "(_start_thread)' stopped: No space left on device" in err
    assert [type(e) for e in others] == [ValueError]
    assert threading.excepthook is recorder  # restored on the way out


def test_what_is_not_a_fault_of_the_machine_is_not_called_one(tmp_path: Path):
    assert machine_fault(ValueError("a bug")) is None
    with pytest.raises(OSError) as info:
        (tmp_path / "nowhere").read_bytes()
    assert machine_fault(info.value) is None  # ENOENT: the code's own business
    wrapped = RuntimeError("while logging")
    wrapped.__cause__ = OSError(errno.EROFS, os.strerror(errno.EROFS), str(tmp_path))
    assert machine_fault(wrapped) is not None  # found down the chain


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["ui", "--port", "70000"], "argument --port: 70000 is not in 0..65535"),
        (["ui", "--port", "x"], "argument --port: 'x' is not an integer"),
        (["chat", "--max-new-tokens", "0"], "argument --max-new-tokens: 0 is not in >= 1"),
        (["bench", "data", "--samples", "-5"], "argument --samples: -5 is not in >= 1"),
    ],
)
def test_a_cli_value_out_of_range_is_a_usage_error(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_a_work_dir_that_is_a_file_and_a_source_that_is_a_fifo_are_refused_at_load(tmp_path):
    afile = tmp_path / "runs"
    afile.write_text("mine")
    fifo_folder = tmp_path / "data"
    fifo_folder.mkdir()
    os.mkfifo(fifo_folder / "conversations.jsonl")
    with pytest.raises(UserError) as info:
        load_config(None, [f"work_dir={afile}/tiny", f"data.source={fifo_folder}"])
    assert info.value.problems == [
        f"data.source: {fifo_folder}/conversations.jsonl is a FIFO (named pipe), not a regular "
        "file: prepare reads the file whole, its size first; fix: write the rows to a regular "
        "file",
        f"work_dir {afile}/tiny lies under {afile}, which is a file, not a directory; fix: "
        "choose another work_dir, or move that file away",
    ]
    assert afile.read_text() == "mine"
