"""The sources prepare reads, one module per format behind one reader interface
(:class:`Reader`, :func:`reader`): a folder's ``conversations.jsonl`` and several jsonl
files (:mod:`~packline.sources.jsonl`), a LLaVA-style ``.json`` file
(:mod:`~packline.sources.llava`), the built-in set (:mod:`~packline.sources.synthetic`),
Parquet files and ``save_to_disk`` Arrow folders (:mod:`~packline.sources.parquet`,
:mod:`~packline.sources.arrow`, over :mod:`~packline.sources.tables`), and an Energon
dataset adopted in place (:mod:`~packline.sources.energon`). Which one ``data.source`` names
is :func:`schemas.config.source_kind`'s to say.

A reader yields ``(position, payload)`` one row at a time — so that no list of all rows is
ever held — with the bytes read so far for a progress bar; a payload is what a worker
checks (:mod:`packline.rows`): a jsonl line's text, a LLaVA record, a table's or one of
several files' row with its own address and media folder. Text must be UTF-8 (a BOM at the
start is skipped); a row that is not stays in the stream as :class:`NotUtf8` (or with the
surrogates Python's ``surrogateescape`` gives), so that prepare rejects that row alone
(``text_not_utf8``), not the file.

    >>> list(chunked(range(5), 2))
    [[0, 1], [2, 3], [4]]
    >>> sorted(k.value for k in READERS)
    ['arrow', 'energon', 'folder', 'jsonl', 'llava', 'parquet', 'synthetic']
"""

from __future__ import annotations

import codecs
import contextlib
import hashlib
import importlib
from collections.abc import Callable, Iterable, Iterator
from itertools import islice
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, TypeVar

from schemas.config import PipelineConfig, SourceKind

if TYPE_CHECKING:
    from packline.conversations import MediaSource

T = TypeVar("T")


BOM = codecs.BOM_UTF8


class SourceError(ValueError):
    """The source as a whole cannot be read (not a JSON list, broken JSON mid-file)."""


class NotUtf8(NamedTuple):
    """A jsonl line that is not UTF-8: where its first undecodable byte is."""

    detail: str


@contextlib.contextmanager
def _naming(path: Path) -> Iterator[None]:
    """An ``OSError`` reading the open file ``path`` names it (a read error on a file
    object carries no file name): a fault of the machine is reported with its path."""
    try:
        yield
    except OSError as exc:
        if exc.filename is None:
            exc.filename = str(path)
        raise


class Reader(Protocol):
    """What every source format answers (one module each, registered in :data:`READERS`)."""

    #: the payloads are decoded JSON values in LLaVA's record form, not jsonl text
    llava_records: bool

    def rows(
        self, cfg: PipelineConfig, source: Path, on_offset: Callable[[int], None] | None
    ) -> tuple[Path, int, Iterator[tuple[int, Any]]]:
        """What is read (named in the progress bar and in errors), its bytes in all, and
        the ``(position, payload)`` stream of its rows; ``source``: :func:`resolve_source`."""

    def media(self, cfg: PipelineConfig, source: Path) -> MediaSource | None:
        """The media source every row's media paths resolve against, or None when each row
        carries its own (a table's row, one of several files' line, an adopted sample)."""

    def fingerprint(self, cfg: PipelineConfig) -> list[Any]:
        """What prepare's output depends on in the source (files' sizes and times)."""


#: Each source format's reader, by the module that holds it (imported when asked for).
READERS = {
    SourceKind.folder: "packline.sources.jsonl:FOLDER",
    SourceKind.jsonl: "packline.sources.jsonl:JSONL",
    SourceKind.llava: "packline.sources.llava:LLAVA",
    SourceKind.synthetic: "packline.sources.synthetic:SYNTHETIC",
    SourceKind.parquet: "packline.sources.parquet:PARQUET_READER",
    SourceKind.arrow: "packline.sources.arrow:ARROW_READER",
    SourceKind.energon: "packline.sources.energon:ENERGON",
}


def reader(kind: SourceKind) -> Reader:
    """The reader of source format ``kind``."""
    module, _, name = READERS[kind].partition(":")
    return getattr(importlib.import_module(module), name)


def chunked(
    items: Iterable[T], size: int, weight: Callable[[T], int] | None = None
) -> Iterator[list[T]]:
    """Consecutive lists of ``size`` items (the last one shorter); with ``weight``, of
    items until their weights reach ``size`` (an item that weighs ``size`` alone is a list
    of its own: a table's chunk a worker reads whole).

    >>> list(chunked([1, 5, 1, 1, 1], 3, weight=lambda n: n))
    [[1, 5], [1, 1, 1]]
    """
    it = iter(items)
    if weight is None:
        while chunk := list(islice(it, size)):
            yield chunk
        return
    chunk, total = [], 0
    for item in it:
        chunk.append(item)
        total += weight(item)
        if total >= size:
            yield chunk
            chunk, total = [], 0
    if chunk:
        yield chunk


def hash_tree(root: Path, *, content: bool = False) -> str:
    """Fingerprint of every file under ``root``: relative path, size and mtime — or the bytes
    themselves with ``content=True`` (for small dirs such as a processor)."""
    h = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        rel = path.relative_to(root).as_posix()
        h.update(rel.encode())
        if content:
            h.update(path.read_bytes())
        else:
            st = path.stat()
            h.update(f"{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()


def resolve_source(cfg: PipelineConfig) -> Path:
    """What to read: the user's folder, LLaVA JSON file or Energon dataset, or the built-in
    set generated once into the work dir (in a temp dir of this process, checked whole —
    every row and the media it names — before it is marked complete and renamed into place;
    a copy found incomplete is generated again)."""
    if cfg.data.kind is not SourceKind.synthetic:
        return cfg.inputs()["data.source"]  # a Hub dataset's cached snapshot, a glob's dir
    return reader(SourceKind.synthetic).generate(cfg)
