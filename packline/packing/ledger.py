"""The ledger: every source sample ends packed, or dropped with a reason — and is counted.

Counts arrive with each packed row (``PackedBatch.seen`` and ``.dropped``) and are summed
here; :meth:`Ledger.check` asserts ``seen == packed + dropped`` once an epoch is complete
(mid-epoch, samples still waiting in a packing buffer are seen but not yet packed).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from packline import metrics as names

DROP_REASONS = ("overlength", "malformed")


@dataclass
class Ledger:
    """Running counts of one rank (or of all ranks after :meth:`merge`)."""

    seen: int = 0
    packed: int = 0
    dropped: Counter = field(default_factory=Counter)

    def add(self, *, seen: int, packed: int, dropped: dict[str, list[str]]) -> None:
        self.seen += seen
        self.packed += packed
        for reason, keys in dropped.items():
            self.dropped[reason] += len(keys)

    def merge(self, other: Ledger) -> Ledger:
        return Ledger(
            seen=self.seen + other.seen,
            packed=self.packed + other.packed,
            dropped=self.dropped + other.dropped,
        )

    @property
    def num_dropped(self) -> int:
        return sum(self.dropped.values())

    def check(self) -> None:
        """Raise if a sample went missing: at an epoch's end every seen sample is packed or
        dropped with a reason."""
        if self.seen != self.packed + self.num_dropped:
            raise RuntimeError(
                f"ledger does not balance: seen {self.seen} != packed {self.packed} + dropped "
                f"{self.num_dropped} {dict(self.dropped)} — samples were lost silently"
            )

    def to_metrics(self) -> dict[str, float]:
        """``data/*`` metrics for MLflow."""
        out = {
            names.DATA_SEEN: float(self.seen),
            names.DATA_PACKED: float(self.packed),
            names.DATA_DROPPED: float(self.num_dropped),
        }
        for reason in sorted(set(DROP_REASONS) | set(self.dropped)):
            out[names.dropped(reason)] = float(self.dropped.get(reason, 0))
        return out
