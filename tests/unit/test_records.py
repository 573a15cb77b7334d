"""Run logs stay readable and appendable after a kill in the middle of a record."""

from __future__ import annotations

import doctest
from pathlib import Path

from packline.train import records
from packline.train.records import append_record, drop_torn_tail, read_records


def test_docstrings_have_worked_examples():  # pytest --doctest-modules runs them
    assert any(t.examples for t in doctest.DocTestFinder().find(records))


def test_a_torn_record_is_skipped_then_cut_before_the_resume_appends(tmp_path: Path):
    log = tmp_path / "metrics.jsonl"
    assert drop_torn_tail(log) == 0  # no log yet: nothing to cut
    for step in (1, 2):
        append_record(log, {"step": step, "keys": ["k"] * 5000})  # a long record, one write
    whole = log.read_bytes()
    log.write_bytes(whole + whole.splitlines(keepends=True)[1][:-1000])  # a third record, torn
    assert [r["step"] for r in read_records(log)] == [1, 2]
    assert drop_torn_tail(log) > 0 and log.read_bytes() == whole
    append_record(log, {"step": 2, "keys": []})  # the resume replays step 2
    assert read_records(log) == [{"step": 1, "keys": ["k"] * 5000}, {"step": 2, "keys": []}]
