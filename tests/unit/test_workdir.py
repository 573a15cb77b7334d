"""packline/workdir.py: what packline removes (only what it made) and the temp dirs a
killed run leaves."""

from __future__ import annotations

from pathlib import Path

import pytest

from packline.workdir import (
    MARKER,
    claim_dir,
    is_owned,
    new_temp_dir,
    remove_owned,
    remove_stale_temps,
)
from schemas.errors import UserError


def test_stale_temps_are_removed_at_both_levels_and_a_users_lookalike_is_kept(tmp_path: Path):
    work = tmp_path / "work"
    top = new_temp_dir(work, ".tmp-prepare-")
    (top / "nested").mkdir()
    (top / "nested" / "x").write_text("partial")
    inner = new_temp_dir(work / "source", ".tmp-shapes-")
    old = new_temp_dir(work, ".old-train-")
    mine = work / ".tmp-mine"  # the user's, without packline's marker
    mine.mkdir()
    (mine / "keep.txt").write_text("keep")
    removed = remove_stale_temps(work)
    assert sorted(removed) == sorted([top, inner, old])
    assert not top.exists() and not inner.exists() and not old.exists()
    assert (mine / "keep.txt").read_text() == "keep"
    assert sorted(p.name for p in work.iterdir()) == [".tmp-mine", "source"]


def test_remove_owned_and_claim_dir_refuse_a_users_dir(tmp_path: Path):
    theirs = tmp_path / "train"
    theirs.mkdir()
    (theirs / "data.bin").write_bytes(b"x")
    with pytest.raises(UserError, match="not made by packline"):
        remove_owned(theirs)
    with pytest.raises(UserError, match="not made by packline"):
        claim_dir(theirs, "train")
    assert (theirs / "data.bin").read_bytes() == b"x" and not (theirs / MARKER).exists()
    link = tmp_path / "link"
    link.symlink_to(theirs)
    with pytest.raises(UserError, match="a symbolic link"):
        remove_owned(link)
    assert (theirs / "data.bin").is_file()
    empty = tmp_path / "empty"
    empty.mkdir()
    assert claim_dir(empty, "train") == empty and is_owned(empty)
    remove_owned(empty)
    assert not empty.exists()


def test_a_forked_child_does_not_keep_the_lock_of_its_killed_parent(tmp_path: Path):
    """A loader worker forked while its stage holds the work dir's lock: after the stage is
    killed the next run takes the lock at once, the worker still alive."""
    import os
    import signal
    import subprocess
    import sys

    from packline.workdir import LOCK_ENV, hold

    work = tmp_path / "work"
    script = (
        "import os, sys, time\n"
        "from packline.workdir import hold\n"
        f"with hold({str(work)!r}, command='the killed one'):\n"
        "    child = os.fork()\n"
        "    if child == 0:\n"
        "        os.close(1), os.close(2)\n"  # the test reads the parent's output to its end
        "        time.sleep(60)\n"
        "        os._exit(0)\n"
        "    print(child, flush=True)\n"
        "    os.kill(os.getpid(), 9)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != LOCK_ENV}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env)
    child = int(done.stdout.split()[0])
    try:
        os.kill(child, 0)  # still alive
        with hold(work, command="the next one"):
            pass
    finally:
        os.kill(child, signal.SIGKILL)
