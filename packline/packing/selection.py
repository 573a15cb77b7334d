"""Sample selection for packing: which conversations share a row.

Three algorithms, named by ``packing.algorithm``. All take item lengths and a capacity and
return groups of item indices that cover every index exactly once (an item longer than the
capacity gets a group of its own — the caller decides what an overlength item means). Items
are visited longest first, ties by index, so the result is deterministic.

- ``ffd``: plain first-fit decreasing (:func:`first_fit_decreasing`), nothing more. This is
  what Megatron-Bridge's Qwen-VL encoder runs on each buffer (its ``first_fit_decreasing``
  gives the same groups), so ``train.backend: megatron`` requires it.
- ``bfd``: plain best-fit decreasing (:func:`best_fit_decreasing`), nothing more.
- ``refined`` (the local default): first-fit decreasing, then, only while the round has
  more groups than :func:`lower_bound`, the :func:`minimum_slack` packing of the round
  (kept when it needs fewer groups) and a few short, budgeted :func:`fewer_groups` searches
  for one group fewer still (:func:`refine`). Never more groups than ``ffd``; the search
  work per round is capped (``SEARCH_WORK_MAX``); rounds of more than ``REFINE_MAX_ITEMS``
  fitting items get plain ``ffd``.

Worked example, capacity 10::

    >>> first_fit_decreasing([6, 5, 4, 3, 2], 10)
    [[0, 2], [1, 3, 4]]
    >>> best_fit_decreasing([6, 5, 4, 3, 2], 10)
    [[0, 2], [1, 3, 4]]
    >>> best_fit_decreasing([5, 7, 3, 2], 10)
    [[1, 2], [0, 3]]

Both greedy packings can use one group more than needed; ``refined`` then tries a
minimum-slack packing (:func:`minimum_slack`) of the same round and keeps it when it needs
fewer groups::

    >>> first_fit_decreasing([4, 4, 3, 3, 3, 3], 10)  # 20 tokens in 3 groups
    [[0, 1], [2, 3, 4], [5]]
    >>> minimum_slack([4, 4, 3, 3, 3, 3], 10)  # the optimum, 2 groups of 10
    [[0, 2, 3], [1, 4, 5]]

While the round still has more groups than :func:`lower_bound`, a few short, budgeted
:func:`fewer_groups` searches try to close one more (rounds of many items longer than C/2,
as VLM data with images has, leave both greedy packings a group or two over).
"""

from __future__ import annotations

import bisect
import random
import statistics
from collections.abc import Callable

from schemas.choices import Algorithm


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


#: Largest round :func:`refine` works on (:func:`minimum_slack`'s cost grows
#: with the square of the round; Energon rounds are the packing buffer, 16-1024 samples).
REFINE_MAX_ITEMS = 4096
#: Subsets :func:`minimum_slack` tries per group before it takes the best one seen.
SLACK_SEARCH_NODES = 2000
#: Work (items through a subset sum) one :func:`fewer_groups` attempt may spend.
ATTEMPT_WORK = 2000
#: Work :func:`refine` may spend on such attempts per item of the round ...
SEARCH_WORK_PER_ITEM = 24
#: ... and per round, at most (about 1 µs a unit on one core: a few ms a round).
SEARCH_WORK_MAX = 24_000


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


def lower_bound(lengths: list[int], capacity: int) -> int:
    """Fewest groups any packing needs: Martello & Toth's L2 (1990). Each item longer than
    C/2 needs a group of its own; for every k ≤ C/2 among the lengths, the items of
    k..C/2 must fit in the room those groups leave (only those of length ≤ C − k have any
    room for them) plus new groups. At least ⌈Σlen/C⌉. Every item must fit.

        >>> lower_bound([6, 6, 6, 4, 4, 4], 10)  # 30 tokens, but three 6s need three groups
        3
        >>> lower_bound([7, 7, 7, 4, 4], 10)  # a 4 fits no 7's room (3): 3 + ⌈8/10⌉
        4
    """
    half = capacity // 2
    big = sorted(n for n in lengths if n > half)
    small = sorted((n for n in lengths if n <= half), reverse=True)
    prefix = [0]
    for n in big:
        prefix.append(prefix[-1] + n)
    best = max(-(-sum(lengths) // capacity), len(big))
    small_sum = 0
    for j, k in enumerate(small):  # k descending: the items of k..C/2 are small[: j + 1]
        small_sum += k
        if j + 1 < len(small) and small[j + 1] == k:
            continue
        roomy = bisect.bisect_right(big, capacity - k)  # groups with room for a k
        room = roomy * capacity - prefix[roomy]
        best = max(best, len(big) + max(0, -(-(small_sum - room) // capacity)))
    return best


#: A pack is full when its free room is at most this share of the capacity ...
FULL_ROOM = 0.01
#: ... or this share of the round's median length, whichever is more: long samples leave
#: coarser room (a pack of them rarely gets within 1% of the row). Measured (simulated
#: carry-over, buffers 16 and 64): on the default set at C=2048 and the VLM-SFT-like set at
#: C=4096 the median term changes nothing (0.971/0.9985 and 0.9956/0.9978); on the
#: VLM-SFT-like set at C=2048 (samples of 0.4·C) it lifts 0.933/0.973 to 0.947/0.990, above
#: Energon's per-round bound (0.927/0.980), where a fixed 1% kept carrying packs it could not
#: complete.
FULL_ROOM_OF_MEDIAN = 0.05


def full_load(lengths: list[int], capacity: int) -> float:
    """The least load of a *full* pack in a round of ``lengths``: what carry-over emits
    (:mod:`packline.packing.carry`) and FLOPs balance keeps full
    (:mod:`packline.packing.balance`).

        >>> full_load([100] * 4, 1000), full_load([600, 400, 200], 1000)
        (990.0, 980.0)
    """
    median = statistics.median(lengths) if lengths else 0
    return capacity - max(FULL_ROOM * capacity, FULL_ROOM_OF_MEDIAN * median)


def _reach(lengths: list[int], capacity: int, order: list[int]) -> list[int]:
    """Bit sets of reachable sums: bit s of ``reach[j]`` is set when some subset of the first
    j items of ``order`` sums to s (≤ ``capacity``)."""
    mask = (1 << (capacity + 1)) - 1
    reach = [1]
    for j in order:
        reach.append((reach[-1] | reach[-1] << lengths[j]) & mask)
    return reach


def fullest_subset(lengths: list[int], capacity: int, rng: random.Random) -> list[int]:
    """Positions of a subset of ``lengths`` with the largest sum ≤ ``capacity``, one of
    the fullest chosen by ``rng``: a subset sum over bit sets (:func:`_reach`, in a shuffled
    order), walked back from the best sum taking an item only where that sum is not
    reachable without it."""
    order = list(range(len(lengths)))
    rng.shuffle(order)
    reach = _reach(lengths, capacity, order)
    total = reach[-1].bit_length() - 1
    chosen = []
    for pos in range(len(order) - 1, -1, -1):
        if not reach[pos] >> total & 1:
            chosen.append(order[pos])
            total -= lengths[order[pos]]
    return chosen


#: FLOPs balance: fullest subsets drawn per pack, the one closest to the target cost kept.
BALANCE_DRAWS = 8


def balanced_subset(
    lengths: list[int], costs: list[float], capacity: int, rng: random.Random, *, target: float
) -> list[int]:
    """Positions of a subset of ``lengths`` with the largest sum ≤ ``capacity`` (so balance
    costs no fill) whose cost (the sum of its ``costs``) is closest to ``target``, of
    :data:`BALANCE_DRAWS` drawn by :func:`fullest_subset` (each a shuffled walk: the fullest
    subsets it reaches differ).

    Capacity 10, target cost 10: 6+4 is the fullest, with either 4; the draws find the one
    of cost 4 (total 10) over the one of cost 8::

        >>> sorted(balanced_subset([6, 5, 4, 4], [6.0, 5.0, 8.0, 4.0], 10, random.Random(0),
        ...                        target=10.0))
        [0, 3]
    """
    best: tuple[float, list[int]] | None = None
    seen: set[tuple[int, ...]] = set()
    for _ in range(BALANCE_DRAWS):
        chosen = fullest_subset(lengths, capacity, rng)
        key = tuple(sorted(chosen))
        if key in seen:
            continue
        seen.add(key)
        miss = abs(sum(costs[i] for i in chosen) - target)
        if best is None or miss < best[0]:
            best = (miss, chosen)
    return best[1] if best else []


def fewer_groups(
    lengths: list[int], groups: list[list[int]], capacity: int, *, work: int, seed: int = 0
) -> list[list[int]] | None:
    """A packing of the items of ``groups`` (every item fits) in one group fewer, or None
    when none is found within ``work``; a local search after Buljubašić & Vasquez's
    consistent neighbourhood search (2016).

    An item longer than C/2 never shares a group with another, so each one stays where it is
    and only the room it leaves matters. The items of the emptiest group without such an
    item, and the short items of the two groups with the most room (the emptiest on ties),
    become a pool; the search succeeds when the pool fits those two groups' room. Until then
    a group drawn at random is refilled with one of the fullest subsets (of what fits its
    room) of its own short items and the pool's, the others going back to the pool. A group
    never gets emptier, so the pool never gains tokens; a group already as full as it can get
    still swaps which items it holds, and what it hands back may close another group's gap.
    Each refill costs the items it looks at; ``seed`` draws the groups and the ties, so the
    result is deterministic.

    Worked example, capacity 20: 58 tokens, first-fit decreasing (and best-fit, and
    :func:`minimum_slack`) need 4 groups. The emptiest, [5], and the two next emptiest,
    [8, 8] and [9, 9], are the pool: 39 tokens for 2 × 20 of room, but no split fits. One
    refill of the last group, [7, 6, 6] → [8, 6, 6], leaves [9, 9] and [5, 8, 7]::

        >>> lengths = [8, 5, 6, 8, 7, 9, 6, 9]
        >>> first_fit_decreasing(lengths, 20)
        [[5, 7], [0, 3], [4, 2, 6], [1]]
        >>> fewer_groups(lengths, [[5, 7], [0, 3], [4, 2, 6], [1]], 20, work=0)  # no refill
        >>> fewer_groups(lengths, [[5, 7], [0, 3], [4, 2, 6], [1]], 20, work=20)
        [[4, 1, 0], [5, 7], [2, 6, 3]]
    """
    rng = random.Random(seed)
    half = capacity // 2
    anchors: list[int | None] = []  # per group: its long item, if any
    rooms: list[int] = []  # per group: the room left to its short items
    held: list[list[int]] = []  # per group: its short items
    loose: list[list[int]] = []  # the groups of short items only
    for g in groups:
        long = [i for i in g if lengths[i] > half]
        if long:
            anchors.append(long[0])
            rooms.append(capacity - lengths[long[0]])
            held.append([i for i in g if i != long[0]])
        else:
            loose.append(g)
    if not loose:
        return None  # a long item in every group: no packing has fewer
    loose.sort(key=lambda g: sum(lengths[i] for i in g))
    pool = list(loose[0])
    for g in loose[1:]:
        anchors.append(None)
        rooms.append(capacity)
        held.append(list(g))
    order = sorted(range(len(rooms)), key=lambda b: (-rooms[b], sum(lengths[i] for i in held[b])))
    target, kept = order[:2], order[2:]
    for b in target:
        pool += held[b]
        held[b] = []

    def fullest(items: list[int], room: int) -> tuple[list[int], list[int]]:
        take = set(fullest_subset([lengths[i] for i in items], room, rng))
        return (
            [i for j, i in enumerate(items) if j in take],
            [i for j, i in enumerate(items) if j not in take],
        )

    while True:
        if sum(lengths[i] for i in pool) <= sum(rooms[b] for b in target):
            rest = pool
            for b in target:  # the fullest first, so the rest is as short as it can be
                work -= len(rest)
                held[b], rest = fullest(rest, rooms[b])
            if not rest:
                return [
                    ([anchors[b]] if anchors[b] is not None else []) + held[b]
                    for b in range(len(rooms))
                    if anchors[b] is not None or held[b]
                ]
            for b in target:
                held[b] = []
        if not kept or work <= 0:
            return None
        b = kept[rng.randrange(len(kept))]
        items = held[b] + pool
        work -= len(items)
        held[b], pool = fullest(items, rooms[b])


def pack_fill(lengths: list[int], groups: list[list[int]], capacity: int) -> float:
    """Σ packed lengths / (number of groups × capacity)."""
    if not groups:
        return 0.0
    return sum(lengths[i] for g in groups for i in g) / (len(groups) * capacity)


def refine(aligned: list[int], groups: list[list[int]], capacity: int) -> list[list[int]]:
    """``groups`` (a packing of ``aligned``), or a packing of the same fitting items in
    fewer groups: the :func:`minimum_slack` packing when it needs fewer, then
    :func:`fewer_groups` attempts (from each packing with the fewest groups in turn,
    ``ATTEMPT_WORK`` each, ``SEARCH_WORK_PER_ITEM`` per item and ``SEARCH_WORK_MAX`` in all)
    until one reaches :func:`lower_bound`. ``groups`` unchanged when it already has the
    fewest possible groups, when nothing better is found, or when more than
    ``REFINE_MAX_ITEMS`` items fit. Oversize singletons stay last, as FFD/BFD put them."""
    fits = [i for i, n in enumerate(aligned) if n <= capacity]
    if not fits or len(fits) > REFINE_MAX_ITEMS:
        return groups
    sizes = [aligned[i] for i in fits]
    bound = lower_bound(sizes, capacity)
    position = {i: j for j, i in enumerate(fits)}
    plain = [[position[i] for i in g] for g in groups if aligned[g[0]] <= capacity]
    if len(plain) <= bound:
        return groups  # already the fewest groups possible
    starts = [plain]
    alternative = minimum_slack(sizes, capacity)
    if len(alternative) < len(plain):
        starts = [alternative]
    elif len(alternative) == len(plain):
        starts.append(alternative)
    work, attempt = min(SEARCH_WORK_PER_ITEM * len(sizes), SEARCH_WORK_MAX), 0
    while len(starts[0]) > bound and work > 0:
        budget = min(ATTEMPT_WORK, work)
        start = starts[attempt % len(starts)]
        found = fewer_groups(sizes, start, capacity, work=budget, seed=attempt)
        work -= budget
        attempt += 1
        if found is not None:
            starts = [found]
    if len(starts[0]) == len(plain):
        return groups
    oversize = [[i] for i, n in enumerate(aligned) if n > capacity]
    return [[fits[j] for j in g] for g in starts[0]] + oversize


def _refined(aligned: list[int], capacity: int) -> list[list[int]]:
    return refine(aligned, first_fit_decreasing(aligned, capacity), capacity)


#: How each ``packing.algorithm`` groups one round's aligned lengths. The names are
#: :class:`schemas.choices.Algorithm`'s, the one list the config, this module, the forecast,
#: packline's Bridge dataset and the benches read.
GROUPINGS: dict[Algorithm, Callable[[list[int], int], list[list[int]]]] = {
    Algorithm.ffd: first_fit_decreasing,
    Algorithm.bfd: best_fit_decreasing,
    Algorithm.refined: _refined,
}
#: The names, in the enum's order.
ALGORITHMS = tuple(a.value for a in Algorithm)


def algorithm_named(name: str | Algorithm) -> Algorithm:
    """``name`` as an :class:`~schemas.choices.Algorithm`; ValueError naming the choices.

    >>> algorithm_named("bfd")
    <Algorithm.bfd: 'bfd'>
    >>> algorithm_named("fifo")
    Traceback (most recent call last):
    ...
    ValueError: unknown packing algorithm 'fifo': use one of 'ffd', 'bfd', 'refined'
    """
    try:
        return Algorithm(name)
    except ValueError:
        names = ", ".join(repr(a) for a in ALGORITHMS)
        raise ValueError(f"unknown packing algorithm {name!r}: use one of {names}") from None


def select_packs(
    lengths: list[int],
    *,
    capacity: int,
    alignment: int = 1,
    algorithm: str | Algorithm,
    seed: int | None = 0,
) -> list[list[int]]:
    """Groups of indices for one buffer round: lengths aligned up to ``alignment``, packed
    into ``capacity`` by ``algorithm`` — ``ffd`` or ``bfd`` (the plain greedy packings) or
    ``refined`` (``ffd`` then :func:`refine`). The groups are then shuffled with ``seed`` so
    the longest conversations are not always emitted first (``seed=None`` keeps the
    algorithm's order). Every index is in exactly one group; an item whose aligned length
    exceeds ``capacity`` gets a group of its own (the caller drops or rejects it).

    Worked example, capacity 8, alignment 4 (lengths 5, 3, 2 align to 8, 4, 4)::

        >>> select_packs([5, 3, 2], capacity=8, alignment=4, algorithm="ffd", seed=None)
        [[0], [1, 2]]
        >>> select_packs([], capacity=8, algorithm="ffd")
        []
        >>> select_packs([8, 8], capacity=8, algorithm="ffd", seed=None)  # exact fits
        [[0], [1]]
        >>> select_packs([3, 9, 2], capacity=8, algorithm="ffd", seed=None)  # one oversize
        [[0, 2], [1]]

    Where a greedy packing leaves a group too many, ``refined`` closes it::

        >>> select_packs([4, 4, 3, 3, 3, 3], capacity=10, algorithm="ffd", seed=None)
        [[0, 1], [2, 3, 4], [5]]
        >>> select_packs([4, 4, 3, 3, 3, 3], capacity=10, algorithm="bfd", seed=None)
        [[0, 1], [2, 3, 4], [5]]
        >>> select_packs([4, 4, 3, 3, 3, 3], capacity=10, algorithm="refined", seed=None)
        [[0, 2, 3], [1, 4, 5]]
        >>> lengths = [8, 5, 6, 8, 7, 9, 6, 9]  # minimum slack needs 4 groups too
        >>> select_packs(lengths, capacity=20, algorithm="ffd", seed=None)
        [[5, 7], [0, 3], [4, 2, 6], [1]]
        >>> select_packs(lengths, capacity=20, algorithm="refined", seed=None)  # 3, not 4
        [[4, 1, 0], [5, 7], [2, 6, 3]]
    """
    if alignment < 1:
        raise ValueError(f"alignment must be >= 1, got {alignment}")
    grouping = GROUPINGS[algorithm_named(algorithm)]
    groups = grouping([align_up(n, alignment) for n in lengths], capacity)
    if seed is not None:
        random.Random(seed).shuffle(groups)
    return groups
