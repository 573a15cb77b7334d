"""A LLaVA-style ``.json`` file (one list of records) as a source, read one record at a
time: its media relative to ``data.media_dir`` (default: the file's folder).

    >>> import tempfile, pathlib
    >>> d = pathlib.Path(tempfile.mkdtemp())
    >>> _ = (d / "l.json").write_text('[{"id": 1, "image": "a.jpg"}, {"id": 2.5}]')
    >>> list(llava_records(d / "l.json"))
    [(1, {'id': 1, 'image': 'a.jpg'}), (2, {'id': 2.5})]
    >>> _ = (d / "b.json").write_bytes(b'\\xef\\xbb\\xbf[{"id": "a\\xffb"}, {"id": "\\\\ud800"}]')
    >>> list(llava_records(d / "b.json"))
    [(1, {'id': 'a\\udcffb'}), (2, {'id': '\\ud800'})]
"""

from __future__ import annotations

import codecs
import io
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from packline.conversations import FolderMedia
from packline.sources import BOM, SourceError, _naming, hash_tree
from schemas.config import PipelineConfig


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


class LlavaReader:
    """A LLaVA JSON file: its records are the payloads (dicts)."""

    llava_records = True

    def rows(self, cfg: PipelineConfig, source: Path, on_offset):
        return source, source.stat().st_size, llava_records(source, on_offset)

    def media(self, cfg: PipelineConfig, source: Path) -> FolderMedia:
        return FolderMedia(cfg.data.llava_media_dir(), max_bytes=cfg.prepare.max_media_bytes)

    def fingerprint(self, cfg: PipelineConfig) -> list[Any]:
        path = Path(cfg.data.source).expanduser().resolve()
        st = path.stat()
        return [f"{path}:{st.st_size}:{st.st_mtime_ns}", hash_tree(cfg.data.llava_media_dir())]


LLAVA = LlavaReader()
