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
