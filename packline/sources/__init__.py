"""Streaming readers of the row sources prepare converts: a folder's ``conversations.jsonl``
and a LLaVA-style ``.json`` file (one list of records). Each yields ``(position, payload)``
one row at a time — the 1-based line number and the line's text, or the 1-based record
number and the decoded record — so that no list of all rows is ever held; ``on_offset``
gets the bytes read so far, for a progress bar over the file's size.

Text must be UTF-8 (a BOM at the start is skipped). A row that is not stays in the stream,
so that prepare rejects that row alone (``text_not_utf8``), not the file: a jsonl line as
:class:`NotUtf8`, a LLaVA record with each undecodable byte as the lone surrogate Python's
``surrogateescape`` gives it (a ``\\ud800``-style escape in the JSON text decodes to a lone
surrogate too); :func:`packline.conversations.text_problem` finds either.

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
    >>> _ = (d / "b.jsonl").write_bytes(b'\\xef\\xbb\\xbf{"id": 1}\\n{"id": "\\xff"}\\n')
    >>> list(jsonl_rows(d / "b.jsonl"))
    [(1, '{"id": 1}'), (2, NotUtf8(detail='byte 0xff at column 9 is not UTF-8'))]
    >>> _ = (d / "b.json").write_bytes(b'\\xef\\xbb\\xbf[{"id": "a\\xffb"}, {"id": "\\\\ud800"}]')
    >>> list(llava_records(d / "b.json"))
    [(1, {'id': 'a\\udcffb'}), (2, {'id': '\\ud800'})]
    >>> list(chunked(range(5), 2))
    [[0, 1], [2, 3], [4]]
"""

from __future__ import annotations

import codecs
import contextlib
import io
from collections.abc import Callable, Iterable, Iterator
from itertools import islice
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

from schemas.config import PipelineConfig, SourceKind

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


def jsonl_rows(
    path: Path, on_offset: Callable[[int], None] | None = None
) -> Iterator[tuple[int, str | NotUtf8]]:
    """The non-blank lines of a jsonl file with their 1-based line numbers; a line that is
    not UTF-8 as :class:`NotUtf8` (the row is rejected, not the file)."""
    with Path(path).open("rb") as f, _naming(path):
        for lineno, raw in enumerate(f, start=1):
            if on_offset is not None:
                on_offset(f.tell())
            if lineno == 1 and raw.startswith(BOM):
                raw = raw[len(BOM) :]
            try:
                line = raw.decode("utf-8").rstrip("\r\n")
            except UnicodeDecodeError as exc:
                bad = raw[exc.start]
                yield lineno, NotUtf8(f"byte {bad:#04x} at column {exc.start + 1} is not UTF-8")
                continue
            if line.strip():
                yield lineno, line


class JsonlLine(NamedTuple):
    """A line of one of several jsonl files: its text (or :class:`NotUtf8`), the folder its
    media paths are relative to, and its address (``file line N``) for ``rejects.jsonl``."""

    text: str | NotUtf8
    folder: str
    where: str


def jsonl_files_rows(
    files: list[Path], on_offset: Callable[[int], None] | None = None
) -> Iterator[tuple[int, JsonlLine]]:
    """Every line of ``files`` in order as :class:`JsonlLine`, positions counted over the
    files (1-based); ``on_offset`` gets the bytes read so far over all of them."""
    position = base = 0
    for path in files:
        folder = str(path.parent)
        offset = None if on_offset is None else (lambda n, b=base: on_offset(b + n))
        for lineno, text in jsonl_rows(path, offset):
            position += 1
            yield position, JsonlLine(text, folder, f"{path.name} line {lineno}")
        base += path.stat().st_size


class _EscapedUtf8(io.RawIOBase):
    """A JSON file's bytes as a JSON parser may read them: a leading BOM dropped, and each
    byte that is not UTF-8 written as the JSON escape of the code point ``surrogateescape``
    decodes it to (``0xff`` → ``\\udcff``), so that the record holding it decodes to a
    string the row check rejects instead of the parser failing on the file."""

    def __init__(self, raw: io.BufferedReader):
        self._raw = raw
        self._decoder = codecs.getincrementaldecoder("utf-8")("surrogateescape")
        self._pending = b""
        self._start = True

    def readable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._raw.tell()

    def read(self, size: int = -1) -> bytes:
        while size < 0 or len(self._pending) < size:
            chunk = self._raw.read(1 << 16)
            text = self._decoder.decode(chunk, final=not chunk)
            if self._start and text:
                text, self._start = text.removeprefix("\ufeff"), False
            self._pending += text.encode("utf-8", "backslashreplace")
            if not chunk:
                break
        size = len(self._pending) if size < 0 else size
        out, self._pending = self._pending[:size], self._pending[size:]
        return out

    def readinto(self, buffer) -> int:
        data = self.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)


def llava_records(
    path: Path, on_offset: Callable[[int], None] | None = None
) -> Iterator[tuple[int, Any]]:
    """The records of a LLaVA-style JSON file (one top-level list) with their 1-based
    numbers, decoded incrementally (ijson): memory holds one record, not the file.

    ijson's C parser cannot decode a lone surrogate (a ``\\ud800``-style escape, or an
    undecodable byte, see :class:`_EscapedUtf8`): at the first one the file is read again
    from its start with ijson's Python parser, about 20 times slower, which yields the
    records not yet yielded."""
    import ijson
    from ijson.backends import python as python_parser

    with Path(path).open("rb") as f:
        head = f.read(4096).removeprefix(BOM).lstrip()
    if not head.startswith(b"["):
        raise SourceError(f"{path}: a LLaVA-style JSON source is one list of records")
    number = 0
    for parser in (ijson, python_parser):
        with Path(path).open("rb") as raw, _EscapedUtf8(raw) as f, _naming(path):
            try:
                for n, record in enumerate(parser.items(f, "item", use_float=True), start=1):
                    if n <= number:
                        continue  # yielded before the C parser stopped
                    if on_offset is not None:
                        on_offset(f.tell())
                    number = n
                    yield number, record
                return
            except UnicodeDecodeError:
                if parser is python_parser:
                    raise
            except ijson.JSONError as exc:
                raise SourceError(f"{path}: broken JSON after record {number}: {exc}") from None


def chunked(items: Iterable[T], size: int) -> Iterator[list[T]]:
    """Consecutive lists of ``size`` items (the last one shorter)."""
    it = iter(items)
    while chunk := list(islice(it, size)):
        yield chunk


# --- the built-in set, generated once into the work dir -------------------------------------

SOURCE_DONE = "_SOURCE_COMPLETE"
"""Written into the built-in set's dir last, once its count check passed."""


def synthetic_source_dir(cfg: PipelineConfig) -> Path:
    """Where the built-in set of these settings is generated once (the generator's version in
    the name: a copy an older packline wrote is not reused)."""
    from packline.synthetic import SHAPES_VERSION

    d = cfg.data
    name = f"shapes-v{SHAPES_VERSION}-seed{d.seed}-train{d.num_train}-val{d.num_val}"
    return cfg.work_path / "source" / f"{name}-video{d.video_share:g}"


def resolve_source(cfg: PipelineConfig) -> Path:
    """What to read: the user's folder, LLaVA JSON file or Energon dataset, or the built-in
    set generated once into the work dir (in a temp dir of this process, checked whole —
    every row and the media it names — before it is marked complete and renamed into place;
    a copy found incomplete is generated again)."""
    if cfg.data.kind is not SourceKind.synthetic:
        return cfg.inputs()["data.source"]  # a Hub dataset's cached snapshot, a glob's dir
    from packline.faults import discard_partial
    from packline.progress import console, progress
    from packline.synthetic import shapes_dataset_problem, write_shapes_dataset
    from packline.workdir import mark_owned, new_temp_dir, publish

    out = synthetic_source_dir(cfg)
    total = cfg.data.num_train + cfg.data.num_val
    if (out / SOURCE_DONE).is_file():
        problem = shapes_dataset_problem(out, num_rows=total)
        if problem is None:
            return out
        console.log(f"[yellow]the built-in set in {out} is incomplete ({problem}): regenerating[/]")
        mark_owned(out, "built-in set")  # its completion file says packline wrote it
    tmp = new_temp_dir(out.parent, f".tmp-{out.name}-")
    try:
        with progress() as bar:
            task = bar.add_task("generate shapes", total=total)
            write_shapes_dataset(
                tmp,
                num_train=cfg.data.num_train,
                num_val=cfg.data.num_val,
                seed=cfg.data.seed,
                video_share=cfg.data.video_share,
                progress=lambda n: bar.advance(task, n),
            )
        problem = shapes_dataset_problem(tmp, num_rows=total)
        assert problem is None, f"the built-in set just written is not whole: {problem}"
        (tmp / SOURCE_DONE).write_text(f"{total} rows\n")
        publish(tmp, out)
    except BaseException as exc:
        discard_partial(tmp, exc)
        raise
    return out
