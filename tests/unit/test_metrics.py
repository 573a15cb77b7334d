"""packline.metrics: one constant per name, spelled after it, and the names the counters,
the layout figures and the ledger produce are the constants' names."""

from __future__ import annotations

import doctest

import pytest

from packline import metrics as M
from packline.counters import PackCounts, layout_metrics
from packline.packing.ledger import DROP_REASONS, Ledger

GROUPS = ("train", "throughput", "flops", "pack", "data", "eval", "compare", "moe")


def _names() -> dict[str, str]:
    """Every metric-name constant of the module: constant → name."""
    return {
        k: v
        for k, v in vars(M).items()
        if k.isupper() and isinstance(v, str) and v.split("/")[0] in GROUPS and "/" in v
    }


def test_docstrings_have_worked_examples():  # pytest --doctest-modules runs them
    assert any(t.examples for t in doctest.DocTestFinder().find(M))


def test_every_constant_is_its_name_in_upper_case_and_no_name_is_defined_twice():
    names = _names()
    assert len(names) > 30
    for constant, name in names.items():
        assert constant == name.upper().replace("/", "_"), (constant, name)
    assert len(set(names.values())) == len(names)


def test_counter_names_are_the_packcounts_fields_and_each_has_a_cumulative_name():
    assert tuple(PackCounts().to_metrics("train")) == M.TRAIN_COUNTERS
    assert M.cumulative(M.TRAIN_FLOPS_EXECUTED) == "train/cum_flops_executed"
    with pytest.raises(ValueError, match="not a train/\\* counter"):
        M.cumulative(M.TRAIN_LOSS)


def test_layout_and_ledger_metrics_are_named_by_the_constants():
    layout = layout_metrics([10, 20], conversations=3, padded_tokens=4, seq_length=32)
    assert set(layout) == {
        M.PACK_ROWS,
        M.PACK_FILL,
        M.PACK_CONVERSATIONS_PER_PACK,
        M.PACK_PADDING_TOKENS,
        M.PACK_PADDING_FRACTION,
    }
    assert set(layout) <= set(M.STEP_METRICS)
    ledger = Ledger(seen=3, packed=2)
    ledger.dropped["overlength"] += 1
    assert set(ledger.to_metrics()) == {
        M.DATA_SEEN,
        M.DATA_PACKED,
        M.DATA_DROPPED,
        *(M.dropped(r) for r in DROP_REASONS),
    }


def test_per_kind_eval_figures_round_trip_through_metric_names():
    by_kind = {
        "color": {"questions": 5, "accuracy": 0.4, "chance": 0.125},
        "count": {"questions": 3, "accuracy": 1.0, "chance": 0.2},
    }
    logged = M.by_kind_metrics(by_kind)
    assert logged[M.eval_kind("count", "questions")] == 3.0
    assert M.by_kind_from_metrics({**logged, M.EVAL_LOSS: 1.0}) == by_kind
    with pytest.raises(ValueError, match="without '/'"):
        M.eval_kind("a/b", "accuracy")
    with pytest.raises(ValueError, match="unknown per-kind figure"):
        M.eval_kind("count", "loss")


def test_compare_names_are_per_run():
    assert M.compare("unpacked", "train_seconds") == "compare/unpacked_train_seconds"
    with pytest.raises(ValueError, match="'packed' or 'unpacked'"):
        M.compare("both", "eval_loss")
