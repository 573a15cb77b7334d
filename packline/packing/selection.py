"""Sample selection for packing: which conversations share a row.

Both algorithms take item lengths and a capacity and return groups of item indices that
cover every index exactly once (an item longer than the capacity gets a group of its own —
the caller decides what an overlength item means). Items are visited longest first, ties by
index, so the result is deterministic.

Worked example, capacity 10::

    >>> first_fit_decreasing([6, 5, 4, 3, 2], 10)
    [[0, 2], [1, 3, 4]]
    >>> best_fit_decreasing([6, 5, 4, 3, 2], 10)
    [[0, 2], [1, 3, 4]]
    >>> best_fit_decreasing([5, 7, 3, 2], 10)
    [[1, 2], [0, 3]]

Both can use one group more than needed; :func:`select_packs` then tries a minimum-slack
packing (:func:`minimum_slack`) of the same round and keeps it when it needs fewer groups::

    >>> best_fit_decreasing([4, 4, 3, 3, 3, 3], 10)  # 20 tokens in 3 groups
    [[0, 1], [2, 3, 4], [5]]
    >>> minimum_slack([4, 4, 3, 3, 3, 3], 10)  # the optimum, 2 groups of 10
    [[0, 2, 3], [1, 4, 5]]
"""

from __future__ import annotations

import bisect
import random


def align_up(length: int, multiple: int) -> int:
    """``length`` rounded up to a multiple of ``multiple`` (the CP/SP alignment m)."""
    return -(-length // multiple) * multiple


def _order(lengths: list[int]) -> list[int]:
    return sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))


def first_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    """Longest first, each item into the first (oldest) group with room; O(n log n) via a
    max segment tree over the groups' free space."""
    if capacity <= 0:
        raise ValueError(f"capacity must be > 0, got {capacity}")
    n = len(lengths)
    size = 1
    while size < max(n, 1):
        size *= 2
    tree = [0] * (2 * size)  # max free space per subtree; leaves = groups in creation order
    groups: list[list[int]] = []
    oversize: list[list[int]] = []
    for i in _order(lengths):
        length = lengths[i]
        if length > capacity:
            oversize.append([i])
            continue
        if tree[1] >= length:
            node = 1
            while node < size:  # descend to the leftmost leaf with enough room
                node = 2 * node if tree[2 * node] >= length else 2 * node + 1
            g = node - size
        else:
            g = len(groups)
            groups.append([])
            node = size + g
            tree[node] = capacity
        groups[g].append(i)
        tree[node] -= length
        node //= 2
        while node:
            tree[node] = max(tree[2 * node], tree[2 * node + 1])
            node //= 2
    return groups + oversize


def best_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    """Longest first, each item into the group with the least room that still fits it;
    O(n log n) with a sorted list of (free space, group)."""
    if capacity <= 0:
        raise ValueError(f"capacity must be > 0, got {capacity}")
    free: list[tuple[int, int]] = []  # sorted (free space, group index)
    groups: list[list[int]] = []
    oversize: list[list[int]] = []
    for i in _order(lengths):
        length = lengths[i]
        if length > capacity:
            oversize.append([i])
            continue
        pos = bisect.bisect_left(free, (length, -1))
        if pos < len(free):
            room, g = free.pop(pos)
        else:
            room, g = capacity, len(groups)
            groups.append([])
        groups[g].append(i)
        bisect.insort(free, (room - length, g))
    return groups + oversize


#: Largest round :func:`select_packs` refines with :func:`minimum_slack` (its cost grows
#: with the square of the round; Energon rounds are the packing buffer, 16-1024 samples).
REFINE_MAX_ITEMS = 4096
#: Subsets :func:`minimum_slack` tries per group before it takes the best one seen.
SLACK_SEARCH_NODES = 2000


def minimum_slack(lengths: list[int], capacity: int) -> list[list[int]]:
    """Minimum bin slack (Gupta & Ho, 1999; the MBS' variant): groups are filled one at a
    time, each starting from the longest item left and completed by the subset of the
    others (searched depth-first, longest first, at most ``SLACK_SEARCH_NODES`` subsets)
    that leaves the least free space. A group is taken as soon as its free space is within
    an even share of the slack that ⌈Σlen/C⌉ groups would leave, so good-enough groups do not
    cost a full search. Unlike FFD/BFD it looks at combinations, which is what closes the
    last group of a round when the items are many and small. Every item must fit."""
    if capacity <= 0:
        raise ValueError(f"capacity must be > 0, got {capacity}")
    if any(n > capacity for n in lengths):
        raise ValueError(f"minimum_slack needs every length <= capacity {capacity}")
    remaining = _order(lengths)
    target_groups = -(-sum(lengths) // capacity)
    budget = target_groups * capacity - sum(lengths)
    groups: list[list[int]] = []
    while remaining:
        first, rest = remaining[0], remaining[1:]
        good_enough = budget / max(target_groups - len(groups), 1)
        best, room = _least_slack_subset(
            [lengths[i] for i in rest], capacity - lengths[first], good_enough
        )
        groups.append([first] + [rest[j] for j in best])
        budget -= room
        taken = set(best)
        remaining = [i for j, i in enumerate(rest) if j not in taken]
    return groups


def _least_slack_subset(lengths: list[int], room: int, good_enough: float) -> tuple[list[int], int]:
    """Positions of a subset of ``lengths`` (sorted longest first) that fits ``room`` with
    the least left over, and that left-over: depth-first, stopping at the first subset
    leaving ≤ ``good_enough`` or after ``SLACK_SEARCH_NODES`` subsets."""
    best: list[int] = []
    best_room = room
    chosen: list[int] = []
    nodes = 0

    def search(start: int, room: int) -> bool:
        nonlocal best, best_room, nodes
        if room < best_room:
            best, best_room = chosen.copy(), room
            if room <= good_enough:
                return True
        for j in range(start, len(lengths)):
            if nodes >= SLACK_SEARCH_NODES:
                return False
            length = lengths[j]
            if length > room or (j > start and lengths[j - 1] == length):
                continue  # too long, or the same subsets as the previous equal length
            nodes += 1
            chosen.append(j)
            if search(j + 1, room - length):
                return True
            chosen.pop()
        return False

    search(0, room)
    return best, best_room


def pack_fill(lengths: list[int], groups: list[list[int]], capacity: int) -> float:
    """Σ packed lengths / (number of groups × capacity)."""
    if not groups:
        return 0.0
    return sum(lengths[i] for g in groups for i in g) / (len(groups) * capacity)


def _refined(aligned: list[int], groups: list[list[int]], capacity: int) -> list[list[int]]:
    """``groups``, or the :func:`minimum_slack` packing of the same fitting items when it
    needs fewer groups (oversize singletons stay last, as FFD/BFD put them)."""
    fits = [i for i, n in enumerate(aligned) if n <= capacity]
    packed = len(groups) - (len(aligned) - len(fits))
    if not fits or len(fits) > REFINE_MAX_ITEMS:
        return groups
    if packed <= -(-sum(aligned[i] for i in fits) // capacity):
        return groups  # already the fewest groups possible
    alternative = minimum_slack([aligned[i] for i in fits], capacity)
    if len(alternative) >= packed:
        return groups
    oversize = [[i] for i, n in enumerate(aligned) if n > capacity]
    return [[fits[j] for j in g] for g in alternative] + oversize


def select_packs(
    lengths: list[int],
    *,
    capacity: int,
    alignment: int = 1,
    algorithm: str = "ffd",
    seed: int | None = 0,
    refine: bool = True,
) -> list[list[int]]:
    """Groups of indices for one buffer round: lengths aligned up to ``alignment``, packed
    into ``capacity`` by ``algorithm`` (``ffd`` or ``bfd``); when that needs more groups than
    ⌈Σlen/C⌉ and ``refine`` is on (rounds up to ``REFINE_MAX_ITEMS``), the
    :func:`minimum_slack` packing replaces it if it needs fewer. The groups are then
    shuffled with ``seed`` so the longest conversations are not always emitted first
    (``seed=None`` keeps the algorithm's order). Every index is in exactly one group; an item
    whose aligned length exceeds ``capacity`` gets a group of its own (the caller drops or
    rejects it).

    Worked example, capacity 8, alignment 4 (lengths 5, 3, 2 align to 8, 4, 4)::

        >>> select_packs([5, 3, 2], capacity=8, alignment=4, seed=None)
        [[0], [1, 2]]
        >>> select_packs([], capacity=8)
        []
        >>> select_packs([8, 8], capacity=8, seed=None)  # exact fits
        [[0], [1]]
        >>> select_packs([3, 9, 2], capacity=8, seed=None)  # one oversize
        [[0, 2], [1]]
        >>> select_packs([4, 4, 3, 3, 3, 3], capacity=10, algorithm="bfd", seed=None)
        [[0, 2, 3], [1, 4, 5]]
        >>> select_packs([4, 4, 3, 3, 3, 3], capacity=10, algorithm="bfd", seed=None,
        ...              refine=False)
        [[0, 1], [2, 3, 4], [5]]
    """
    if alignment < 1:
        raise ValueError(f"alignment must be >= 1, got {alignment}")
    aligned = [align_up(n, alignment) for n in lengths]
    if algorithm == "ffd":
        groups = first_fit_decreasing(aligned, capacity)
    elif algorithm == "bfd":
        groups = best_fit_decreasing(aligned, capacity)
    else:
        raise ValueError(f"unknown packing algorithm {algorithm!r}: use 'ffd' or 'bfd'")
    if refine:
        groups = _refined(aligned, groups, capacity)
    if seed is not None:
        random.Random(seed).shuffle(groups)
    return groups
