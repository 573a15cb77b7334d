"""Streaming readers of the row sources prepare converts: a folder's ``conversations.jsonl``
and a LLaVA-style ``.json`` file (one list of records). Each yields ``(position, payload)``
one row at a time — the 1-based line number and the line's text, or the 1-based record
number and the decoded record — so that no list of all rows is ever held; ``on_offset``
gets the bytes read so far, for a progress bar over the file's size.

An Energon dataset adopted in place is read shard by shard instead
(:mod:`packline.energon.chatml`).

    >>> import tempfile, pathlib
    >>> d = pathlib.Path(tempfile.mkdtemp())
    >>> _ = (d / "c.jsonl").write_text('{"id": 1}\\n\\n{"id": 2}\\n')
    >>> list(jsonl_rows(d / "c.jsonl"))
    [(1, '{"id": 1}'), (3, '{"id": 2}')]
    >>> _ = (d / "l.json").write_text('[{"id": 1, "image": "a.jpg"}, {"id": 2.5}]')
    >>> list(llava_records(d / "l.json"))
    [(1, {'id': 1, 'image': 'a.jpg'}), (2, {'id': 2.5})]
    >>> list(chunked(range(5), 2))
    [[0, 1], [2, 3], [4]]
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from itertools import islice
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")


class SourceError(ValueError):
    """The source as a whole cannot be read (not a JSON list, broken JSON mid-file)."""


def jsonl_rows(
    path: Path, on_offset: Callable[[int], None] | None = None
) -> Iterator[tuple[int, str]]:
    """The non-blank lines of a jsonl file with their 1-based line numbers (undecodable
    bytes replaced: the row is then rejected as malformed JSON, not the file)."""
    with Path(path).open("rb") as f:
        for lineno, raw in enumerate(f, start=1):
            if on_offset is not None:
                on_offset(f.tell())
            line = raw.decode("utf-8", errors="replace").rstrip("\r\n")
            if line.strip():
                yield lineno, line


def llava_records(
    path: Path, on_offset: Callable[[int], None] | None = None
) -> Iterator[tuple[int, Any]]:
    """The records of a LLaVA-style JSON file (one top-level list) with their 1-based
    numbers, decoded incrementally (ijson): memory holds one record, not the file."""
    import ijson

    with Path(path).open("rb") as f:
        head = f.read(4096).lstrip()
        if not head.startswith(b"["):
            raise SourceError(f"{path}: a LLaVA-style JSON source is one list of records")
        f.seek(0)
        number = 0
        try:
            for number, record in enumerate(ijson.items(f, "item", use_float=True), start=1):
                if on_offset is not None:
                    on_offset(f.tell())
                yield number, record
        except ijson.JSONError as exc:
            raise SourceError(f"{path}: broken JSON after record {number}: {exc}") from None


def chunked(items: Iterable[T], size: int) -> Iterator[list[T]]:
    """Consecutive lists of ``size`` items (the last one shorter)."""
    it = iter(items)
    while chunk := list(islice(it, size)):
        yield chunk
