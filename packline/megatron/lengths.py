"""Connect's exact lengths, looked up by sample key inside a loader worker.

:class:`KeyLengths` holds ``lengths.parquet``'s keys as 64-bit hashes (sorted) beside each
sample's ``total_tokens``, visual tokens (images' and videos') and image count: 20 bytes a
sample, so a worker's copy of a million samples' figures is about 20 MB (a dict of the keys
would be several times that, in every loader worker of every rank). The table is read once,
where the encoder is made, and its arrays travel to the workers with it: a worker imports
no pandas (about 50 MB of its RSS). Two keys with the same hash are refused when the table
is read (never silently merged).

    >>> import pandas as pd, tempfile, pathlib
    >>> path = pathlib.Path(tempfile.mkdtemp()) / "lengths.parquet"
    >>> pd.DataFrame({"key": ["a", "b"], "total_tokens": [7, 9], "image_tokens": [0, 4],
    ...               "video_tokens": [0, 2], "num_images": [0, 1]}).to_parquet(path)
    >>> table = KeyLengths(path)
    >>> table.get("b"), table.get("c")
    (Measured(length=9, visual_tokens=6, num_images=1), None)
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import NamedTuple

import numpy as np

COLUMNS = ["key", "total_tokens", "image_tokens", "video_tokens", "num_images"]


class Measured(NamedTuple):
    """What connect measured of one sample, as Bridge's encoder renders it."""

    length: int
    visual_tokens: int
    num_images: int


def key_hash(key: str) -> int:
    """A sample key's signed 64-bit hash (blake2b, 8 bytes)."""
    digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


class KeyLengths:
    """:class:`Measured` by sample key, from connect's ``lengths.parquet`` (read lazily)."""

    def __init__(self, path: str | Path):
        self.path = str(path)
        self._load()

    def _load(self) -> None:
        import pandas as pd

        df = pd.read_parquet(self.path, columns=COLUMNS)
        hashes = np.fromiter((key_hash(k) for k in df["key"]), dtype=np.int64, count=len(df))
        order = np.argsort(hashes, kind="stable")
        hashes = hashes[order]
        same = np.flatnonzero(hashes[1:] == hashes[:-1])
        if len(same):
            keys = df["key"].to_numpy()[order]
            pairs = ", ".join(f"{keys[i]!r} and {keys[i + 1]!r}" for i in same[:3])
            raise ValueError(f"{self.path}: keys {pairs} share a 64-bit hash or repeat")
        self._hashes = hashes
        visual = df["image_tokens"] + df["video_tokens"]
        columns = (df["total_tokens"], visual, df["num_images"])
        self._figures = np.stack([c.to_numpy(dtype=np.int32) for c in columns], axis=1)[order]

    def get(self, key: str) -> Measured | None:
        """The sample's figures, or None when connect did not measure it."""
        h = key_hash(key)
        i = int(np.searchsorted(self._hashes, h))
        if i < len(self._hashes) and self._hashes[i] == h:
            return Measured(*(int(v) for v in self._figures[i]))
        return None
