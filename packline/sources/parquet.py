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

    def chunks(self, path: Path) -> Iterator[tuple[object, int]]:
        import pyarrow as pa

        pf = self._open(path)
        meta = pf.metadata
        done = 0
        for group in range(meta.num_row_groups):
            try:
                table = pf.read_row_group(group)
            except (pa.ArrowException, OSError) as exc:
                raise SourceError(
                    f"{path}: row group {group} cannot be read ({exc}); the file is truncated "
                    "or corrupt: write it again"
                ) from None
            chunks = meta.row_group(group)
            done += sum(chunks.column(i).total_compressed_size for i in range(chunks.num_columns))
            yield table, done


PARQUET = ParquetFormat()
PARQUET_READER = TableReader(PARQUET)
