"""Carry-over: a round's underfull packs wait for the next round instead of being emitted.

Energon's ``PackingDataset`` hands selection the whole buffer each round and emits every
group it returns, so each round ends with an underfull pack: no packer can beat the
per-round bound Σ_rounds ⌈Σlen/C⌉ (``Forecast.round_bound_fill``). With carry-over
(``packing.max_carry_rounds`` > 0; the Energon wrapper is
:class:`packline.energon.carry.CarryOverPackingDataset`) each round:

1. takes the fullest pack the buffer allows — an exact subset sum over the buffer's lengths
   (:func:`~packline.packing.selection.fullest_subset`) — and emits it; then the next
   fullest, and so on while a pack is *full*
   (:func:`~packline.packing.selection.full_load`: its free room at most 1% of the capacity
   or 5% of the round's median length, whichever is more). When the refined packing of the
   whole buffer (:func:`~packline.packing.selection.select_packs`) holds more tokens in full
   packs, its full packs are emitted instead. With FLOPs balance (``costs``,
   :mod:`packline.packing.balance`) each pack is, of the fullest, one close to the target
   cost (:func:`~packline.packing.selection.balanced_subset`), and the packs chosen are then
   balanced against each other and the samples left;
2. emits, for each sample that has already waited ``max_carry_rounds`` rounds (longest
   first), the fullest pack that holds it and the other samples left;
3. puts every other sample back into the reading buffer, ahead of the new samples the next
   round reads (so the buffer still holds ``buffer_size`` samples).

A round always emits at least one pack (the fullest), so every round makes progress, and no
sample waits more than ``max_carry_rounds`` rounds. When the source is exhausted (end of
epoch, ``repeat=False``) the last round emits everything with ``packing.algorithm``, as
without carry-over: nothing is lost or duplicated, only delayed.

Worked example, capacity 10: the fullest pack of [6, 5, 4, 3] is 6+4, emitted; 5+3 is 0.8
full, so those two wait. A sample that has waited ``max_rounds`` rounds goes out in the
fullest pack that holds it::

    >>> r = carry_round([6, 5, 4, 3], [0] * 4, capacity=10, max_rounds=4, seed=0)
    >>> r.emit, r.carry
    ([[0, 2]], [1, 3])
    >>> carry_round([7, 3, 5, 4], [0, 0, 1, 0], capacity=10, max_rounds=1, seed=0)
    CarryRound(emit=[[0, 1], [2, 3]], carry=[])
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from packline.packing.balance import balance_round
from packline.packing.selection import balanced_subset, full_load, fullest_subset, select_packs


@dataclass(frozen=True)
class CarryRound:
    """One round's decision, as positions in the buffer."""

    emit: list[list[int]]
    """The packs emitted now (each one's members in buffer order)."""
    carry: list[int]
    """The samples put back into the reading buffer, in buffer order."""


def carry_round(
    lengths: list[int],
    waited: list[int],
    *,
    capacity: int,
    max_rounds: int,
    seed: int,
    costs: list[float] | None = None,
    target: float = 0.0,
) -> CarryRound:
    """Which packs a round emits and which samples it carries (see the module docstring).
    ``lengths`` are aligned and each ≤ ``capacity``; ``waited[i]`` is how many rounds sample
    ``i`` has been carried already; ``seed`` picks among equally full packs. With ``costs``
    (FLOPs balance, :mod:`packline.packing.balance`) the packs chosen are balanced towards
    ``target`` against each other and the carried samples, before the due samples go out."""
    if len(lengths) != len(waited):
        raise ValueError(f"{len(lengths)} lengths but {len(waited)} waited counts")
    if any(n > capacity for n in lengths):
        raise ValueError(f"carry_round needs every length <= capacity {capacity}")
    rng = random.Random(seed)
    full = full_load(lengths, capacity)

    def fullest(items: list[int], within: list[int] = ()) -> list[int]:
        """The fullest pack of ``items`` beside the samples ``within``; with FLOPs balance,
        of the fullest drawn the one closest to the target cost (balance never costs fill
        here: measured, letting it take any pack down to the full threshold cost 0.027 of
        fill on the default set at C=4096, B=64, for a worse straggler ratio)."""
        sizes = [lengths[i] for i in items]
        room = capacity - sum(lengths[i] for i in within)
        if costs is None:
            return [items[j] for j in fullest_subset(sizes, room, rng)]
        aim = target - sum(costs[i] for i in within)
        cost = [costs[i] for i in items]
        return [items[j] for j in balanced_subset(sizes, cost, room, rng, target=aim)]

    def fullest_first() -> list[list[int]]:
        left, packs = list(range(len(lengths))), []
        while left:
            group = fullest(left)
            if packs and sum(lengths[i] for i in group) < full:
                break
            packs.append(group)
            chosen = set(group)
            left = [i for i in left if i not in chosen]
        return packs

    def fewest_groups() -> list[list[int]]:
        groups = select_packs(lengths, capacity=capacity, algorithm="refined", seed=None)
        loads = [sum(lengths[i] for i in g) for g in groups]
        best = max(range(len(groups)), key=lambda k: loads[k], default=None)
        return [g for k, g in enumerate(groups) if loads[k] >= full or k == best]

    def good_tokens(packs: list[list[int]]) -> int:
        return sum(n for n in (sum(lengths[i] for i in g) for g in packs) if n >= full)

    candidates = (fullest_first(), fewest_groups()) if lengths else ([],)
    emit = max(candidates, key=good_tokens)  # the first of the best: fullest-first on ties
    emit = [sorted(g) for g in emit]  # members in arrival order
    chosen = {i for g in emit for i in g}
    left = [i for i in range(len(lengths)) if i not in chosen]
    if costs is not None:
        emit, left = balance_round(
            emit, lengths, costs, capacity=capacity, target=target, pool=left
        )
    for due in sorted((i for i in left if waited[i] >= max_rounds), key=lambda i: -lengths[i]):
        if due not in left:
            continue  # emitted already, in the pack of a longer due sample
        others = [i for i in left if i != due]
        group = sorted([due, *fullest(others, [due])])
        emit.append(group)
        taken = set(group)
        left = [i for i in left if i not in taken]
    return CarryRound(emit=emit, carry=left)
