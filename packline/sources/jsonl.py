"""Rows as jsonl: a conversation folder's ``conversations.jsonl`` (:data:`FOLDER`, media
relative to the folder) and one or several ``.jsonl`` files by name or glob (:data:`JSONL`,
each line's media relative to its own file's folder).

    >>> import tempfile, pathlib
    >>> d = pathlib.Path(tempfile.mkdtemp())
    >>> _ = (d / "c.jsonl").write_text('{"id": 1}\\n\\n{"id": 2}\\n')
    >>> list(jsonl_rows(d / "c.jsonl"))
    [(1, '{"id": 1}'), (3, '{"id": 2}')]
    >>> _ = (d / "b.jsonl").write_bytes(b'\\xef\\xbb\\xbf{"id": 1}\\n{"id": "\\xff"}\\n')
    >>> list(jsonl_rows(d / "b.jsonl"))
    [(1, '{"id": 1}'), (2, NotUtf8(detail='byte 0xff at column 9 is not UTF-8'))]
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

from packline.conversations import FolderMedia
from packline.sources import BOM, NotUtf8, _naming, hash_tree
from schemas.config import PipelineConfig, jsonl_files
from schemas.errors import UserError


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


class FolderReader:
    """A folder holding ``conversations.jsonl`` and the media it names."""

    llava_records = False

    def rows(self, cfg: PipelineConfig, source: Path, on_offset):
        path = source / "conversations.jsonl"
        if not path.is_file():
            raise UserError([f"{path} does not exist"], "prepare: no conversations")
        return path, path.stat().st_size, jsonl_rows(path, on_offset)

    def media(self, cfg: PipelineConfig, source: Path) -> FolderMedia:
        return FolderMedia(source, max_bytes=cfg.prepare.max_media_bytes)

    def fingerprint(self, cfg: PipelineConfig) -> list[Any]:
        return [hash_tree(Path(cfg.data.source).expanduser().resolve())]


class JsonlFilesReader:
    """One ``.jsonl`` file or a glob of them: :class:`JsonlLine` payloads."""

    llava_records = False

    def rows(self, cfg: PipelineConfig, source: Path, on_offset):
        files = jsonl_files(cfg.data.source)
        size = sum(f.stat().st_size for f in files)
        return Path(cfg.data.source), size, jsonl_files_rows(files, on_offset)

    def media(self, cfg: PipelineConfig, source: Path) -> None:
        return None  # each line's: its file's folder

    def fingerprint(self, cfg: PipelineConfig) -> list[Any]:
        """Each file's folder: the rows and the media they name."""
        return [hash_tree(d) for d in sorted({f.parent for f in jsonl_files(cfg.data.source)})]


FOLDER = FolderReader()
JSONL = JsonlFilesReader()
