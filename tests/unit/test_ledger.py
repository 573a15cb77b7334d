from __future__ import annotations

import pytest

from packline.packing.ledger import Ledger


def test_ledger_balances_and_names_its_metrics():
    ledger = Ledger()
    ledger.add(seen=5, packed=3, dropped={"overlength": ["a"]})
    ledger.add(seen=1, packed=1, dropped={"malformed": ["b"]})
    ledger.check()
    assert ledger.to_metrics() == {
        "data/seen": 6.0,
        "data/packed": 4.0,
        "data/dropped": 2.0,
        "data/dropped_malformed": 1.0,
        "data/dropped_overlength": 1.0,
    }


def test_ledger_catches_a_silently_lost_sample():
    ledger = Ledger()
    ledger.add(seen=4, packed=3, dropped={})
    with pytest.raises(RuntimeError, match="seen 4 != packed 3 \\+ dropped 0"):
        ledger.check()


def test_ledgers_of_ranks_merge():
    a, b = Ledger(seen=3, packed=3), Ledger(seen=2, packed=1)
    b.add(seen=0, packed=0, dropped={"overlength": ["x"]})
    merged = a.merge(b)
    assert (merged.seen, merged.packed, merged.num_dropped) == (5, 4, 1)
    merged.check()


def test_conversations_skipped_on_resume_are_counted_apart_not_seen_twice():
    """A resume under another layout re-reads what the saved run trained and skips it: the
    row reports those keys, which count as skipped, not as seen again or dropped."""
    from packline.packing.ledger import SKIPPED_ON_RESUME

    ledger = Ledger(seen=3, packed=3)  # the saved run's
    ledger.add(seen=4, packed=2, dropped={SKIPPED_ON_RESUME: ["a", "b"]})
    ledger.check()
    metrics = ledger.to_metrics()
    assert (metrics["data/seen"], metrics["data/skipped_on_resume"]) == (5.0, 2.0)
    assert metrics["data/dropped"] == 0.0
    assert "data/skipped_on_resume" not in Ledger(seen=1, packed=1).to_metrics()
