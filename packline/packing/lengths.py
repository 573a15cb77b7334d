"""Connect's exact lengths, looked up by sample key inside a loader worker.

:class:`KeyLengths` holds ``lengths.parquet``'s keys as 64-bit hashes (sorted) beside each
sample's ``total_tokens``, visual tokens (images' and videos'), image count and executed
FLOPs alone (``flops``, what FLOPs balance weighs) and its split: 29 bytes a sample, so a
worker's copy of a million samples' figures is about 29 MB (a dict of the keys would be
several times that, in every loader worker of every rank). The table is read once,
where the encoder is made, and its arrays travel to the workers with it: a worker imports
no pandas (about 50 MB of its RSS). Two keys with the same hash are refused when the table
is read (never silently merged).

    >>> import pandas as pd, tempfile, pathlib
    >>> path = pathlib.Path(tempfile.mkdtemp()) / "table.parquet"
    >>> pd.DataFrame({"key": ["a", "b"], "split": ["train", "val"], "total_tokens": [7, 9],
    ...               "image_tokens": [0, 4], "video_tokens": [0, 2], "num_images": [0, 1],
    ...               "flops": [70.0, 120.0]}).to_parquet(path)
    >>> table = KeyLengths(path)
    >>> table.get("b"), table.get("c")
    (Measured(length=9, visual_tokens=6, num_images=1, flops=120.0), None)
    >>> table.balance_target(capacity=16, alignment=8)  # train rows: 70 FLOPs in 8 tokens
    140.0
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import NamedTuple

import numpy as np

from packline.packing.balance import balance_target
from packline.packing.selection import align_up

COLUMNS = ["key", "split", "total_tokens", "image_tokens", "video_tokens", "num_images", "flops"]


class Measured(NamedTuple):
    """What connect measured of one sample, as Bridge's encoder renders it."""

    length: int
    visual_tokens: int
    num_images: int
    flops: float
    """Executed FLOPs of the sample alone at its aligned length (``FlopsModel.sample_flops``)."""


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
        self._flops = df["flops"].to_numpy(dtype=np.float64)[order]
        self._train = (df["split"] == "train").to_numpy()[order]

    def get(self, key: str) -> Measured | None:
        """The sample's figures, or None when connect did not measure it."""
        h = key_hash(key)
        i = int(np.searchsorted(self._hashes, h))
        if i < len(self._hashes) and self._hashes[i] == h:
            return Measured(*(int(v) for v in self._figures[i]), float(self._flops[i]))
        return None

    def balance_target(self, *, capacity: int, alignment: int) -> float:
        """FLOPs balance's target for rows of ``capacity``: the train split's full-row cost
        over the samples that fit (:func:`~packline.packing.balance.balance_target`, as the
        forecast computes it)."""
        lengths = [align_up(int(n), alignment) for n in self._figures[self._train, 0]]
        costs = self._flops[self._train].tolist()
        fits = [k for k, n in enumerate(lengths) if n <= capacity]
        return balance_target([lengths[k] for k in fits], [costs[k] for k in fits], capacity)
