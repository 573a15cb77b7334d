from __future__ import annotations

import doctest
import random

import pytest

import packline.packing.selection as selection
from packline.packing.selection import (
    best_fit_decreasing,
    first_fit_decreasing,
    select_packs,
)


def test_docstrings_have_worked_examples():  # pytest --doctest-modules runs them
    assert any(test.examples for test in doctest.DocTestFinder().find(selection))


@pytest.mark.parametrize("fn", [first_fit_decreasing, best_fit_decreasing])
def test_selection_edge_cases(fn):
    assert fn([], 10) == []
    assert fn([10], 10) == [[0]]  # exact fit
    assert fn([4, 6, 10], 10) == [[2], [1, 0]]  # two exact fits
    assert fn([3, 11, 2], 10) == [[0, 2], [1]]  # one oversize gets its own group
    with pytest.raises(ValueError, match="capacity must be > 0"):
        fn([1], 0)


@pytest.mark.parametrize("fn", [first_fit_decreasing, best_fit_decreasing])
def test_selection_covers_every_index_once_and_respects_capacity(fn):
    rng = random.Random(7)
    for _ in range(50):
        lengths = [rng.randint(1, 120) for _ in range(rng.randint(0, 300))]
        groups = fn(lengths, 128)
        flat = sorted(i for g in groups for i in g)
        assert flat == list(range(len(lengths)))
        assert all(sum(lengths[i] for i in g) <= 128 for g in groups)


def test_ffd_and_bfd_differ_where_best_fit_matters():
    # 7 → g0 (3 free), 4 → g1, 4 → g1 (2 free); 2 fits both: FFD takes the first group,
    # BFD the fullest one.
    assert first_fit_decreasing([7, 4, 4, 2], 10) == [[0, 3], [1, 2]]
    assert best_fit_decreasing([7, 4, 4, 2], 10) == [[0], [1, 2, 3]]


@pytest.mark.parametrize("algorithm", ["ffd", "bfd", "refined"])
def test_select_packs_shuffles_groups_with_the_seed_only(algorithm):
    lengths = list(range(1, 40))
    a = select_packs(lengths, capacity=64, algorithm=algorithm, seed=1)
    b = select_packs(lengths, capacity=64, algorithm=algorithm, seed=1)
    c = select_packs(lengths, capacity=64, algorithm=algorithm, seed=2)
    plain = select_packs(lengths, capacity=64, algorithm=algorithm, seed=None)
    assert a == b and sorted(a) == sorted(c) == sorted(plain)
    assert a != plain  # the longest conversations are not always emitted first


def test_unknown_algorithm_is_refused_with_the_names():
    with pytest.raises(ValueError) as info:
        select_packs([1], capacity=4, algorithm="greedy")
    assert str(info.value) == (
        "unknown packing algorithm 'greedy': use one of 'ffd', 'bfd', 'refined'"
    )


def test_plain_algorithms_are_exactly_ffd_and_bfd_without_refinement():
    # Rounds where the greedy packings leave a group too many and refined closes it.
    for lengths, capacity in (([4, 4, 3, 3, 3, 3], 10), ([8, 5, 6, 8, 7, 9, 6, 9], 20)):
        ffd = select_packs(lengths, capacity=capacity, algorithm="ffd", seed=None)
        bfd = select_packs(lengths, capacity=capacity, algorithm="bfd", seed=None)
        assert ffd == first_fit_decreasing(lengths, capacity)
        assert bfd == best_fit_decreasing(lengths, capacity)
    assert select_packs([4, 4, 3, 3, 3, 3], capacity=10, algorithm="ffd", seed=None) == [
        [0, 1],
        [2, 3, 4],
        [5],
    ]
    assert select_packs([4, 4, 3, 3, 3, 3], capacity=10, algorithm="refined", seed=None) == [
        [0, 2, 3],
        [1, 4, 5],
    ]
    # On random rounds plain FFD is first_fit_decreasing of the aligned lengths, group for
    # group, and refined never needs more groups.
    rng = random.Random(9)
    for _ in range(30):
        lengths = [rng.randint(1, 700) for _ in range(rng.randint(0, 120))]
        aligned = [selection.align_up(n, 8) for n in lengths]
        ffd = select_packs(lengths, capacity=1024, alignment=8, algorithm="ffd", seed=None)
        assert ffd == first_fit_decreasing(aligned, 1024)
        bfd = select_packs(lengths, capacity=1024, alignment=8, algorithm="bfd", seed=None)
        assert bfd == best_fit_decreasing(aligned, 1024)
        refined = select_packs(lengths, capacity=1024, alignment=8, algorithm="refined", seed=None)
        assert len(refined) <= len(ffd)
        assert sorted(i for g in refined for i in g) == list(range(len(lengths)))


def test_minimum_slack_covers_every_index_once_and_never_adds_groups():
    rng = random.Random(11)
    for _ in range(50):
        lengths = [rng.randint(1, 128) for _ in range(rng.randint(0, 200))]
        groups = selection.minimum_slack(lengths, 128)
        assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
        assert all(sum(lengths[i] for i in g) <= 128 for g in groups)
        plain = select_packs(lengths, capacity=128, algorithm="ffd", seed=None)
        refined = select_packs(lengths, capacity=128, algorithm="refined", seed=None)
        assert len(refined) <= len(plain)
        with_oversize = select_packs(lengths + [200], capacity=128, algorithm="refined", seed=None)
        assert with_oversize == refined + [[len(lengths)]]  # oversize: alone, last
    with pytest.raises(ValueError, match="every length <= capacity"):
        selection.minimum_slack([3, 11], 10)


def _l2_by_definition(lengths, capacity):
    """Martello & Toth's L2 straight from its definition, every k in 0..C/2."""
    best = -(-sum(lengths) // capacity)
    for k in range(capacity // 2 + 1):
        j1 = [n for n in lengths if n > capacity - k]
        j2 = [n for n in lengths if capacity // 2 < n <= capacity - k]
        j3 = [n for n in lengths if k <= n <= capacity // 2]
        room = len(j2) * capacity - sum(j2)
        best = max(best, len(j1) + len(j2) + max(0, -(-(sum(j3) - room) // capacity)))
    return best


def test_lower_bound_is_l2_and_never_above_a_packing():
    assert selection.lower_bound([], 10) == 0
    assert selection.lower_bound([6, 6, 6, 4, 4, 4], 10) == 3
    assert selection.lower_bound([7, 7, 7, 4, 4], 10) == 4
    assert selection.lower_bound([10, 10, 1], 10) == 3  # exact fits leave no room
    rng = random.Random(5)
    for _ in range(200):
        capacity = rng.choice([10, 20, 64, 128])
        lengths = [rng.randint(1, capacity) for _ in range(rng.randint(0, 40))]
        bound = selection.lower_bound(lengths, capacity)
        assert bound == _l2_by_definition(lengths, capacity)
        assert bound <= len(first_fit_decreasing(lengths, capacity))


def test_fewer_groups_exact_on_tiny_rounds():
    # All short items: one refill of [7, 6, 6] closes the gap (the docstring's example).
    lengths = [8, 5, 6, 8, 7, 9, 6, 9]
    ffd = first_fit_decreasing(lengths, 20)
    assert len(ffd) == len(selection.minimum_slack(lengths, 20)) == 4
    assert selection.fewer_groups(lengths, ffd, 20, work=0) is None  # no work, no refill
    assert selection.fewer_groups(lengths, ffd, 20, work=20) == [[4, 1, 0], [5, 7], [2, 6, 3]]
    # A long item (14 > C/2) keeps its group; only the short ones move.
    lengths = [5, 6, 4, 9, 9, 14, 8, 10, 8, 6]
    ffd = first_fit_decreasing(lengths, 20)
    assert ffd == [[5, 1], [7, 3], [4, 6], [8, 9, 0], [2]]
    assert selection.fewer_groups(lengths, ffd, 20, work=50) == [
        [5, 1],
        [8, 2, 6],
        [4, 7],
        [9, 0, 3],
    ]
    # One long item per group: no packing has fewer groups.
    assert selection.fewer_groups([15, 12, 3], [[0], [1, 2]], 20, work=50) is None


def test_fewer_groups_covers_every_index_once_and_is_deterministic():
    rng = random.Random(3)
    found = 0
    for _ in range(60):
        lengths = [rng.randint(1, 100) for _ in range(rng.randint(3, 80))]
        groups = first_fit_decreasing(lengths, 128)
        result = selection.fewer_groups(lengths, groups, 128, work=2000, seed=4)
        assert result == selection.fewer_groups(lengths, groups, 128, work=2000, seed=4)
        if result is None:
            continue
        found += 1
        assert len(result) == len(groups) - 1
        assert sorted(i for g in result for i in g) == list(range(len(lengths)))
        assert all(sum(lengths[i] for i in g) <= 128 for g in result)
    assert found > 0


def test_refined_search_beats_ffd_bfd_and_minimum_slack_and_is_deterministic():
    lengths = [8, 5, 6, 8, 7, 9, 6, 9]  # FFD, BFD and minimum slack: 4 groups
    assert len(select_packs(lengths, capacity=20, algorithm="ffd", seed=None)) == 4
    assert len(select_packs(lengths, capacity=20, algorithm="bfd", seed=None)) == 4
    assert select_packs(lengths, capacity=20, algorithm="refined", seed=None) == [
        [4, 1, 0],
        [5, 7],
        [2, 6, 3],
    ]
    # Rounds shaped like VLM SFT data at capacity 2048 (a third of the items over C/2):
    # never more groups than FFD/BFD or minimum slack, never fewer than the bound, and
    # the same groups every time.
    rng = random.Random(2)
    for _ in range(4):
        lengths = [min(2048, int(rng.lognormvariate(6.6, 0.7))) for _ in range(128)]
        plain = select_packs(lengths, capacity=2048, algorithm="ffd", seed=None)
        refined = select_packs(lengths, capacity=2048, algorithm="refined", seed=None)
        assert refined == select_packs(lengths, capacity=2048, algorithm="refined", seed=None)
        assert sorted(i for g in refined for i in g) == list(range(len(lengths)))
        assert all(sum(lengths[i] for i in g) <= 2048 for g in refined)
        assert selection.lower_bound(lengths, 2048) <= len(refined) <= len(plain)
        assert len(refined) <= len(selection.minimum_slack(lengths, 2048))
