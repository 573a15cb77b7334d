"""The per-step logs of a training run (``metrics.jsonl``, ``eval.jsonl``): one JSON
record per line, appended as the run goes, readable while it runs and after it was killed.

A SIGKILL, or a reader polling the file, can meet a record half written: its line then has
no newline yet. So a record counts only once its newline is there — :func:`read_records`
skips an unterminated tail — and a resumed run first cuts such a tail off
(:func:`drop_torn_tail`), so its own next record starts on a line of its own instead of
gluing onto the fragment. A resumed run logs the steps it replays again; the last record
of a step wins.

>>> import tempfile, pathlib
>>> log = pathlib.Path(tempfile.mkdtemp()) / "metrics.jsonl"
>>> append_record(log, {"step": 1, "loss": 2.5})
>>> with log.open("a") as f:  # killed in the middle of the next record
...     _ = f.write('{"step": 2, "lo')
>>> read_records(log)
[{'step': 1, 'loss': 2.5}]
>>> drop_torn_tail(log)
15
>>> append_record(log, {"step": 2, "loss": 2.0}); append_record(log, {"step": 1, "loss": 9.0})
>>> read_records(log)
[{'step': 1, 'loss': 9.0}, {'step': 2, 'loss': 2.0}]
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

__all__ = ["append_record", "drop_torn_tail", "read_records"]


def append_record(path: Path, record: dict[str, Any]) -> None:
    """Append ``record`` as one line, in one ``write`` of an ``O_APPEND`` descriptor (no
    buffer that could flush half a record)."""
    data = (json.dumps(record) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        written = os.write(fd, data)
        while written < len(data):  # a short write: finish the same record
            written += os.write(fd, data[written:])
    finally:
        os.close(fd)


def read_records(path: Path) -> list[dict[str, Any]]:
    """The complete records of ``path`` in step order, the last record of a step winning;
    an unterminated last line (a record still being written, or torn) is skipped; none
    when there is no file (a run without eval writes no eval records)."""
    if not Path(path).is_file():
        return []
    *complete, _tail = Path(path).read_text().split("\n")
    by_step: dict[int, dict[str, Any]] = {}
    for line in complete:
        if line.strip():
            rec = json.loads(line)
            by_step[rec["step"]] = rec
    return [by_step[k] for k in sorted(by_step)]


def drop_torn_tail(path: Path) -> int:
    """Cut ``path`` back to its last complete line; returns the bytes cut (0 when none, or
    when the file does not exist)."""
    path = Path(path)
    if not path.exists():
        return 0
    data = path.read_bytes()
    keep = data.rfind(b"\n") + 1
    if keep < len(data):
        with path.open("r+b") as f:
            f.truncate(keep)
    return len(data) - keep
