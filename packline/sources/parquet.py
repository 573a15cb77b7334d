"""Parquet files as a source (``data.source``: a file, a glob, a folder of them or a Hugging
Face dataset id; :func:`schemas.config.parquet_files` lists them), read a row group at a time
by :func:`packline.sources.tables.table_rows`."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from packline.sources import SourceError
from packline.sources.tables import TableReader


class ParquetFormat:
    """A Parquet file: its footer's schema, its row groups (their compressed bytes)."""

    unit = "row group"

    def _open(self, path: Path):
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            return pq.ParquetFile(path)
        except (pa.ArrowException, OSError) as exc:
            raise SourceError(f"{path}: not a readable Parquet file ({exc})") from None

    def schema(self, path: Path):
        return self._open(path).schema_arrow

    def chunk_rows(self, path: Path) -> list[tuple[int, int]]:
        """Each row group's rows and the compressed bytes up to its end (the footer's)."""
        meta = self._open(path).metadata
        out, done = [], 0
        for group in range(meta.num_row_groups):
            chunks = meta.row_group(group)
            done += sum(chunks.column(i).total_compressed_size for i in range(chunks.num_columns))
            out.append((chunks.num_rows, done))
        return out

    def read_chunk(self, path: Path, chunk: int):
        import pyarrow as pa

        try:
            return self._open(path).read_row_group(chunk)
        except (pa.ArrowException, OSError) as exc:
            raise SourceError(
                f"{path}: row group {chunk} cannot be read ({exc}); the file is truncated "
                "or corrupt: write it again"
            ) from None

    def chunks(self, path: Path) -> Iterator[tuple[object, int]]:
        for group, (_, done) in enumerate(self.chunk_rows(path)):
            yield self.read_chunk(path, group), done


PARQUET = ParquetFormat()
PARQUET_READER = TableReader(PARQUET)
