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


def pack_fill(lengths: list[int], groups: list[list[int]], capacity: int) -> float:
    """Σ packed lengths / (number of groups × capacity)."""
    if not groups:
        return 0.0
    return sum(lengths[i] for g in groups for i in g) / (len(groups) * capacity)


def select_packs(
    lengths: list[int],
    *,
    capacity: int,
    alignment: int = 1,
    algorithm: str = "ffd",
    seed: int | None = 0,
) -> list[list[int]]:
    """Groups of indices for one buffer round: lengths aligned up to ``alignment``, packed
    into ``capacity`` by ``algorithm`` (``ffd`` or ``bfd``), then the groups shuffled with
    ``seed`` so the longest conversations are not always emitted first (``seed=None`` keeps
    the algorithm's order). Every index is in exactly one group; an item whose aligned
    length exceeds ``capacity`` gets a group of its own (the caller drops or rejects it).

    Worked example, capacity 8, alignment 4 (lengths 5, 3, 2 align to 8, 4, 4)::

        >>> select_packs([5, 3, 2], capacity=8, alignment=4, seed=None)
        [[0], [1, 2]]
        >>> select_packs([], capacity=8)
        []
        >>> select_packs([8, 8], capacity=8, seed=None)  # exact fits
        [[0], [1]]
        >>> select_packs([3, 9, 2], capacity=8, seed=None)  # one oversize
        [[0, 2], [1]]
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
    if seed is not None:
        random.Random(seed).shuffle(groups)
    return groups
