"""Arrow files as ``datasets``' ``save_to_disk`` writes them (``data.source``: the folder;
:func:`schemas.config.arrow_files` lists its files, split by split), read a record batch at
a time, memory-mapped, by :func:`packline.sources.tables.table_rows`. Each file is an Arrow
IPC stream (``datasets`` writes it with ``RecordBatchStreamWriter``)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from packline.sources import SourceError
from packline.sources.tables import TableReader


class ArrowFormat:
    """An Arrow IPC stream file: its schema (the stream's first message), its batches."""

    unit = "batch"

    def _reader(self, path: Path):
        import pyarrow as pa

        try:
            return pa.ipc.open_stream(pa.memory_map(str(path)))
        except (pa.ArrowException, OSError) as exc:
            raise SourceError(f"{path}: not a readable Arrow stream ({exc})") from None

    def schema(self, path: Path):
        return self._reader(path).schema

    def chunk_rows(self, path: Path) -> None:
        return None  # a stream: its batches are read in order, in prepare's main process

    def read_chunk(self, path: Path, chunk: int):
        raise TypeError("an Arrow stream's batches are read in order only")

    def chunks(self, path: Path) -> Iterator[tuple[object, int]]:
        import pyarrow as pa

        reader = self._reader(path)
        size = path.stat().st_size
        batch = done = 0
        while True:
            try:
                record_batch = reader.read_next_batch()
            except StopIteration:
                return
            except (pa.ArrowException, OSError) as exc:
                raise SourceError(
                    f"{path}: batch {batch} cannot be read ({exc}); the file is truncated or "
                    "corrupt: save the dataset again"
                ) from None
            batch += 1
            done = min(size, done + record_batch.nbytes)  # uncompressed IPC: bytes on disk
            yield pa.Table.from_batches([record_batch]), done


ARROW = ArrowFormat()
ARROW_READER = TableReader(ARROW)
