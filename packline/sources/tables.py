"""Tables as a source: Parquet files (:mod:`packline.sources.parquet`) and Arrow files as
``datasets``' ``save_to_disk`` writes them (:mod:`packline.sources.arrow`), each read one
chunk at a time (a row group, a record batch), a slice of rows at a time, so memory stays
flat in the number of rows. Each row becomes a :class:`TableRow`: the row in the form
:func:`packline.conversations.parse_record` reads (:mod:`packline.sources.layouts`), its
address (file, chunk, row) for ``rejects.jsonl`` and the folder its media paths are
relative to. Images and videos may be bytes, Hugging Face ``Image``/``Video`` structs
(``{"bytes", "path"}``) or paths (:class:`EmbeddedMedia`); embedded bytes go to the shards
as they are, no temp file.

A file that cannot be read as its format, or is truncated, stops the stage as bad input
naming the file (:class:`~packline.sources.SourceError`); a file whose columns name no known
layout likewise, with the columns found and the mapping to write. A format is a
:class:`TableFormat`: how to read a file's schema and its chunks.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from packline.conversations import FolderMedia, MediaSource, Rejected
from packline.sources import SourceError
from packline.sources.layouts import layout_of, layout_problem, to_record

if TYPE_CHECKING:
    import pyarrow as pa

#: Rows converted to Python objects at a time (a slice of a chunk).
ROWS_PER_SLICE = 64


@dataclass(frozen=True)
class TableRow:
    """One row of a table source: ``record`` in parse_record's form, or ``rejected`` when
    its layout already refused it; ``where`` its file, chunk and row."""

    where: str
    folder: str
    record: dict[str, Any] | None = None
    rejected: Rejected | None = None


def _media_name(ref: Any) -> str:
    """How a reject names an embedded image or video: its path, else its size."""
    if isinstance(ref, dict):
        if ref.get("path"):
            return str(ref["path"])
        data = ref.get("bytes")
        return f"<{len(data):,} embedded bytes>" if data is not None else "<null>"
    if isinstance(ref, (bytes, bytearray)):
        return f"<{len(ref):,} embedded bytes>"
    return str(ref)


_SNIFF = ((b"\x1aE\xdf\xa3", "webm"), (b"RIFF", "avi"), (b"OggS", "ogv"))


def _video_suffix(data: bytes) -> str:
    """A video's file suffix from its first bytes (``""`` when unknown)."""
    if data[4:8] == b"ftyp":
        return "mov" if data[8:10] == b"qt" else "mp4"
    return next((ext for magic, ext in _SNIFF if data.startswith(magic)), "")


@dataclass
class EmbeddedMedia(MediaSource):
    """A Parquet row's media: bytes, an HF ``{"bytes", "path"}`` struct (its bytes when
    present, else its path) or a path relative to the file's folder (read as a folder's
    file is: :class:`~packline.conversations.FolderMedia`). A null entry is
    ``<kind>_null``; bytes over ``max_bytes`` are ``<kind>_size_refused``."""

    folder: Path
    max_bytes: int = 1 << 30

    def read(self, ref: Any, sid: str, kind: str) -> tuple[bytes, str]:
        path = None
        data = ref
        if isinstance(ref, dict):
            data, path = ref.get("bytes"), ref.get("path")
            if data is None and path:
                return FolderMedia(self.folder, self.max_bytes).read(path, sid, kind)
        elif isinstance(ref, str):
            return FolderMedia(self.folder, self.max_bytes).read(ref, sid, kind)
        if data is None:
            raise Rejected(f"{kind}_null", f"the {kind} entry holds neither bytes nor a path", sid)
        if not isinstance(data, (bytes, bytearray)):
            raise Rejected(
                "wrong_type",
                f"the {kind} entry is a {type(data).__name__}, not bytes or a path",
                sid,
            )
        if len(data) > self.max_bytes:
            raise Rejected(
                f"{kind}_size_refused",
                f"{_media_name(ref)}: over prepare.max_media_bytes {self.max_bytes:,}",
                sid,
            )
        suffix = Path(path).suffix.lower().lstrip(".") if path else ""
        if kind == "video" and not suffix:
            suffix = _video_suffix(data)
        return bytes(data), suffix

    def name(self, ref: Any) -> str:
        return _media_name(ref)


class TableFormat(Protocol):
    """How a source format's files are read (a Parquet file, an Arrow stream)."""

    #: what a file's chunk is called in a reject's address ("row group", "batch")
    unit: str

    def schema(self, path: Path) -> pa.Schema:
        """The file's schema, read without its rows; raise :class:`SourceError` when the
        file cannot be read as this format."""

    def chunks(self, path: Path) -> Iterator[tuple[pa.Table, int]]:
        """The file's chunks in order, each with the bytes of the file read so far;
        :class:`SourceError` for a chunk that cannot be read."""

    def chunk_rows(self, path: Path) -> list[tuple[int, int]] | None:
        """Each chunk's rows and the bytes up to its end, from the file's metadata, when a
        chunk can be read on its own (:meth:`read_chunk`); None when only in order."""

    def read_chunk(self, path: Path, chunk: int) -> pa.Table:
        """Chunk ``chunk`` of the file (:class:`SourceError` when it cannot be read)."""


def _renamed(names: list[str], columns: dict[str, str]) -> list[str]:
    """A table's column names under ``data.columns`` (packline's name → the table's): a
    mapped column takes packline's name, a column already holding that name gives it up."""
    taken = {table: name for name, table in columns.items()}
    return [taken.get(n, f"{n} (unused)" if n in columns else n) for n in names]


def check_files(
    files: list[Path], fmt: TableFormat, columns: dict[str, str] | None = None
) -> dict[Path, str]:
    """Each file's layout, read from its schema alone (its columns renamed by
    ``data.columns``); a file that is not Parquet, lacks a mapped column or names no known
    layout stops the stage (:class:`SourceError`), every such file said at once."""
    columns = columns or {}
    layouts: dict[Path, str] = {}
    problems = []
    for path in files:
        try:
            schema = fmt.schema(path)
        except SourceError as exc:
            problems.append(str(exc))
            continue
        absent = {name: col for name, col in columns.items() if col not in schema.names}
        if absent:
            problems.append(
                f"{path}: data.columns names {absent} but the file has no such column (its "
                f"columns: {schema.names}); fix: map each name to one of them"
            )
            continue
        names = _renamed(schema.names, columns)
        if (layout := layout_of(names)) is None:
            lists = [f.name for f in schema if str(f.type).startswith(("list", "large_list"))]
            problems.append(layout_problem(schema.names, str(path), lists))
        else:
            layouts[path] = layout
    if problems:
        raise SourceError("\n".join(problems))
    return layouts


#: A split's names in Hugging Face's file names (``train-00000-of-00002.parquet``,
#: ``validation.parquet``, ``<config>/test/0000.parquet``), as packline's splits.
SPLIT_NAMES = {"train": "train", "training": "train", "validation": "val", "valid": "val"}
SPLIT_NAMES |= {"val": "val", "dev": "val", "test": "test"}


def named_split(path: Path, root: Path) -> str | None:
    """The split a file's name (or a folder between ``root`` and it) names: ``train``,
    ``val`` or ``test``; None when none does.

    >>> named_split(Path("/d/data/train-00000-of-00002.parquet"), Path("/d"))
    'train'
    >>> named_split(Path("/d/vqav2/validation/0000.parquet"), Path("/d"))
    'val'
    >>> named_split(Path("/dev/x/mine.parquet"), Path("/dev/x")) is None
    True
    """
    try:
        inside = path.relative_to(root)
    except ValueError:
        inside = Path(path.name)
    for name in (path.stem, *reversed(inside.parent.parts)):
        head = re.split(r"[-_.]", name.lower(), maxsplit=1)[0]
        if head in SPLIT_NAMES:
            return SPLIT_NAMES[head]
    return None


def file_splits(files: list[Path], root: Path) -> dict[Path, str | None]:
    """Each file's split by its name (:func:`named_split`), when the files hold a held-out
    split: a ``test`` file is read as ``val`` when no file names a validation split, and left
    out (``"skip"``) when one does. A file naming none, and every file of a source with
    training files only, keeps its rows' own ``split`` (else ``prepare.val_fraction`` by the
    hash of their id).

    >>> file_splits([Path("/d/train-0.parquet"), Path("/d/test-0.parquet")], Path("/d"))
    {PosixPath('/d/train-0.parquet'): 'train', PosixPath('/d/test-0.parquet'): 'val'}
    >>> file_splits([Path("/d/train-0.parquet")], Path("/d"))
    {PosixPath('/d/train-0.parquet'): None}
    """
    named = {path: named_split(path, root) for path in files}
    if not {"val", "test"} & set(named.values()):
        return dict.fromkeys(files)
    has_val = "val" in named.values()
    return {p: ("skip" if has_val else "val") if s == "test" else s for p, s in named.items()}


@dataclass(frozen=True)
class ChunkWork:
    """One chunk of a table file that a worker reads and checks itself (a Parquet row group:
    :meth:`TableFormat.chunk_rows` says a format's chunks can be read one by one), so the
    files' chunks are split among prepare's workers; ``first`` is the position of its first
    row, ``rows`` its row count (the task's weight)."""

    fmt: Any
    path: Path
    chunk: int
    first: int
    rows: int
    layout: str
    split: str | None
    columns: tuple[tuple[str, str], ...]
    name: str


def chunk_rows(work: ChunkWork) -> Iterator[tuple[int, TableRow]]:
    """The rows of ``work``'s chunk, read here (in the worker)."""
    table = work.fmt.read_chunk(work.path, work.chunk)
    yield from _rows_of(table, work, work.first)


def _rows_of(table, work: ChunkWork, first: int) -> Iterator[tuple[int, TableRow]]:
    """``(position, row)`` of each row of a chunk's ``table`` (positions from ``first``)."""
    path, folder = work.path, str(work.path.parent)
    if work.columns:
        table = table.rename_columns(_renamed(table.column_names, dict(work.columns)))
    position = first - 1
    for start in range(0, table.num_rows, ROWS_PER_SLICE):
        for offset, row in enumerate(table.slice(start, ROWS_PER_SLICE).to_pylist()):
            position += 1
            index = start + offset
            where = f"{path.name} {work.fmt.unit} {work.chunk} row {index}"
            default_id = f"{work.name}-g{work.chunk}-r{index}"  # g: the chunk
            try:
                record = to_record(row, work.layout, default_id=default_id)
                if work.split is not None:
                    record.setdefault("split", work.split)
            except Rejected as rej:
                yield position, TableRow(where, folder, rejected=rej)
                continue
            yield position, TableRow(where, folder, record)


def table_rows(
    files: list[Path],
    fmt: TableFormat,
    on_offset: Callable[[int], None] | None = None,
    root: Path | None = None,
    columns: dict[str, str] | None = None,
) -> Iterator[tuple[int, TableRow | ChunkWork]]:
    """``(position, payload)`` of ``files`` in order (positions 1-based, counted over the
    files): a :class:`ChunkWork` per chunk where the format reads chunks one by one (the
    worker that gets it reads its rows), else each row as :class:`TableRow`, read here.
    ``on_offset`` gets the bytes handed out or read so far (over the files' total size, for
    a progress bar). A file's name may give its rows their split (:func:`file_splits`;
    ``root``: the folder the source names); ``columns``: ``data.columns``."""
    columns = dict(columns or {})
    layouts = check_files(files, fmt, columns)
    root = root or files[0].parent
    splits = file_splits(files, root)
    files = [path for path in files if splits[path] != "skip"]
    position = 0
    base = 0  # the bytes of the files read whole
    for path in files:
        try:  # unique among the source's files: datasets names each split's file alike
            name = path.relative_to(root).with_suffix("").as_posix()
        except ValueError:
            name = path.stem
        work = dict(fmt=fmt, path=path, layout=layouts[path], split=splits[path], name=name)
        work["columns"] = tuple(sorted(columns.items()))
        sizes = fmt.chunk_rows(path)
        if sizes is not None:  # the workers read the chunks
            for chunk, (rows, done) in enumerate(sizes):
                yield position + 1, ChunkWork(chunk=chunk, first=position + 1, rows=rows, **work)
                position += rows
                if on_offset is not None:
                    on_offset(base + done)
        else:
            for chunk, (table, done) in enumerate(fmt.chunks(path)):
                piece = ChunkWork(chunk=chunk, first=position + 1, rows=table.num_rows, **work)
                yield from _rows_of(table, piece, piece.first)
                position += piece.rows
                if on_offset is not None:
                    on_offset(base + done)
                del table
        base += path.stat().st_size
        if on_offset is not None:
            on_offset(base)


class TableReader:
    """A table source read in ``fmt`` (:data:`~packline.sources.parquet.PARQUET_READER`,
    :data:`~packline.sources.arrow.ARROW_READER`): :class:`TableRow` payloads, each with its
    own media folder."""

    llava_records = False

    def __init__(self, fmt: TableFormat):
        self.fmt = fmt

    def rows(self, cfg, source: Path, on_offset):
        files = cfg.data.table_files()
        size = sum(f.stat().st_size for f in files)
        root = source if source.is_dir() else files[0].parent
        rows = table_rows(files, self.fmt, on_offset, root, cfg.data.columns)
        return Path(cfg.data.source), size, rows

    def media(self, cfg, source: Path) -> None:
        return None  # each row's: embedded, or its file's folder

    def fingerprint(self, cfg) -> list[Any]:
        """Each file's size and modification time (media named by path are not in it)."""
        return [f"{p}:{p.stat().st_size}:{p.stat().st_mtime_ns}" for p in cfg.data.table_files()]
