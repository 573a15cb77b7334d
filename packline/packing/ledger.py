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
SKIPPED_ON_RESUME = "trained_before_resume"
"""The reason a row carries for a conversation its stream skipped because a run resumed
under another data-parallel layout had trained it (:meth:`TrainStream.continue_after
<packline.train.data.TrainStream.continue_after>`): counted apart, not as seen again."""


@dataclass
class Ledger:
    """Running counts of one rank (or of all ranks after :meth:`merge`)."""

    seen: int = 0
    packed: int = 0
    dropped: Counter = field(default_factory=Counter)
    skipped_on_resume: int = 0
    """Read again after a resume under another layout and skipped: trained before."""

    def add(self, *, seen: int, packed: int, dropped: dict[str, list[str]]) -> None:
        skipped = len(dropped.get(SKIPPED_ON_RESUME, ()))
        self.seen += seen - skipped
        self.skipped_on_resume += skipped
        self.packed += packed
        for reason, keys in dropped.items():
            if reason != SKIPPED_ON_RESUME:
                self.dropped[reason] += len(keys)

    def merge(self, other: Ledger) -> Ledger:
        return Ledger(
            seen=self.seen + other.seen,
            packed=self.packed + other.packed,
            dropped=self.dropped + other.dropped,
            skipped_on_resume=self.skipped_on_resume + other.skipped_on_resume,
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
        if self.skipped_on_resume:
            out[names.DATA_SKIPPED_ON_RESUME] = float(self.skipped_on_resume)
        return out
