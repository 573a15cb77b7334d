"""Connect's exact lengths, looked up by sample key inside a loader worker.

:class:`KeyLengths` holds ``lengths.parquet``'s keys as 64-bit hashes (sorted) beside their
``total_tokens``: 12 bytes a sample, so a worker's copy of a million samples' lengths is about
12 MB (a dict of the keys would be about ten times that, in every loader worker of every
rank). The table is read on first use, in the worker, not pickled into it. Two keys with the
same hash are refused when the table is read (never silently merged).

    >>> import pandas as pd, tempfile, pathlib
    >>> path = pathlib.Path(tempfile.mkdtemp()) / "lengths.parquet"
    >>> pd.DataFrame({"key": ["a", "b"], "total_tokens": [7, 9]}).to_parquet(path)
    >>> table = KeyLengths(path)
    >>> table.get("b"), table.get("c")
    (9, None)
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np


def key_hash(key: str) -> int:
    """A sample key's signed 64-bit hash (blake2b, 8 bytes)."""
    digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


class KeyLengths:
    """``total_tokens`` by sample key, from connect's ``lengths.parquet`` (read lazily)."""

    def __init__(self, path: str | Path):
        self.path = str(path)
        self._hashes: np.ndarray | None = None
        self._lengths: np.ndarray | None = None

    def __getstate__(self) -> dict:
        return {"path": self.path}  # each worker reads the table itself

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["path"])

    def _load(self) -> None:
        import pandas as pd

        df = pd.read_parquet(self.path, columns=["key", "total_tokens"])
        hashes = np.fromiter((key_hash(k) for k in df["key"]), dtype=np.int64, count=len(df))
        order = np.argsort(hashes, kind="stable")
        hashes = hashes[order]
        same = np.flatnonzero(hashes[1:] == hashes[:-1])
        if len(same):
            keys = df["key"].to_numpy()[order]
            pairs = ", ".join(f"{keys[i]!r} and {keys[i + 1]!r}" for i in same[:3])
            raise ValueError(f"{self.path}: keys {pairs} share a 64-bit hash or repeat")
        self._hashes = hashes
        self._lengths = df["total_tokens"].to_numpy(dtype=np.int32)[order]

    def get(self, key: str) -> int | None:
        """The sample's exact length, or None when connect did not measure it."""
        if self._hashes is None:
            self._load()
        h = key_hash(key)
        i = int(np.searchsorted(self._hashes, h))
        if i < len(self._hashes) and self._hashes[i] == h:
            return int(self._lengths[i])
        return None
