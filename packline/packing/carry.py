"""Carry-over: a round's underfull packs wait for the next round instead of being emitted.

Energon's ``PackingDataset`` hands selection the whole buffer each round and emits every
group it returns, so each round ends with an underfull pack: no packer can beat the
per-round bound Σ_rounds ⌈Σlen/C⌉ (``Forecast.round_bound_fill``). With carry-over
(``packing.max_carry_rounds`` > 0; the Energon wrapper is
:class:`packline.energon.carry.CarryOverPackingDataset`) each round:

1. takes the fullest pack the buffer allows — an exact subset sum over the buffer's lengths
   (:func:`~packline.packing.selection.fullest_subset`) — and emits it; then the next
   fullest, and so on while a pack reaches :data:`CARRY_FILL` of the capacity;
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

from packline.packing.selection import fullest_subset, select_packs

#: A pack at least this full is emitted; the fullest pack of a round is emitted whatever its
#: fill, and a due sample's pack too. Measured on the default set at C=2048 (bench packing):
#: 0.97-0.995 give the same fill within noise at B ≥ 32; 0.99 is the best at B=16.
CARRY_FILL = 0.99


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
) -> CarryRound:
    """Which packs a round emits and which samples it carries (see the module docstring).
    ``lengths`` are aligned and each ≤ ``capacity``; ``waited[i]`` is how many rounds sample
    ``i`` has been carried already; ``seed`` picks among equally full packs."""
    if len(lengths) != len(waited):
        raise ValueError(f"{len(lengths)} lengths but {len(waited)} waited counts")
    if any(n > capacity for n in lengths):
        raise ValueError(f"carry_round needs every length <= capacity {capacity}")
    rng = random.Random(seed)
    full = CARRY_FILL * capacity

    def fullest_first() -> list[list[int]]:
        left, packs = list(range(len(lengths))), []
        while left:
            group = [left[j] for j in fullest_subset([lengths[i] for i in left], capacity, rng)]
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
    for due in sorted((i for i in left if waited[i] >= max_rounds), key=lambda i: -lengths[i]):
        if due not in left:
            continue  # emitted already, in the pack of a longer due sample
        others = [i for i in left if i != due]
        room = capacity - lengths[due]
        fill_up = fullest_subset([lengths[i] for i in others], room, rng)
        group = sorted([due, *(others[j] for j in fill_up)])
        emit.append(group)
        taken = set(group)
        left = [i for i in left if i not in taken]
    return CarryRound(emit=emit, carry=left)
