"""FLOPs balance: a round's packs are reshuffled so each one costs close to the same compute.

Packs of the same token count can cost very different FLOPs: attention grows with the square
of each conversation's length, and an image's tokens also pay for the vision tower. Data-
parallel ranks wait at every step's gradient all-reduce for the slowest, so a step costs the
most expensive rank's packs (``packline.packing.forecast.straggler_ratio`` measures it).

With ``packing.balance: flops`` a sample's cost is its executed FLOPs alone
(``FlopsModel.sample_flops``, connect's ``lengths.parquet`` column ``flops``: a pack costs the
sum of its samples') and a pack aims at ``target``, the stream's cost of a full row
(:func:`balance_target`). Two steps, neither of which gives up fill:

- with carry-over, each pack :func:`~packline.packing.carry.carry_round` emits is, of the
  fullest packs the buffer allows, the one closest to the target of a few drawn
  (:func:`~packline.packing.selection.balanced_subset`);
- then every round's packs (carry-over or not) go through :func:`balance_packs`: a greedy
  local search that moves or swaps single samples between the packs and the samples left
  (carry-over's pool) while that lowers Σ_packs (cost − target)², each move keeping every
  pack within ``capacity`` and at least as full as ``min(its load before, floor)``, the
  round's :func:`~packline.packing.selection.full_load`: the round's pack count never
  changes and a full pack stays full. The work is capped per round
  (:data:`BALANCE_WORK_MAX` candidate moves).

What it buys is bounded by what a buffer offers: packs must stay full, and a full pack's
members are nearly fixed. ``packline bench packing`` measures it (rows ``_balanced``).

Worked example, capacity 10, target 10: the two packs cost 14 and 6; swapping their 7-token
samples (costs 9 and 5) evens them to 10 and 10, both packs still full::

    >>> lengths, costs = [7, 3, 7, 3], [9.0, 5.0, 5.0, 1.0]
    >>> balance_packs([[0, 1], [2, 3]], [], lengths, costs, capacity=10, target=10.0, floor=10)
    ([[1, 2], [0, 3]], [])
"""

from __future__ import annotations

from packline.packing.selection import full_load

#: Candidate moves evaluated per round, at most (about 10 ms of Python per round).
BALANCE_WORK_MAX = 20_000


def balance_packs(
    groups: list[list[int]],
    pool: list[int],
    lengths: list[int],
    costs: list[float],
    *,
    capacity: int,
    target: float,
    floor: float,
) -> tuple[list[list[int]], list[int]]:
    """``groups`` and ``pool`` (indices into ``lengths``/``costs``) after the balancing moves
    of the module docstring; each group's members and the pool in index order."""
    packs = [list(g) for g in groups]
    left = list(pool)
    load = [sum(lengths[i] for i in g) for g in packs]
    dev = [sum(costs[i] for i in g) - target for g in packs]
    least = [min(n, floor) for n in load]
    work = 0
    done: set[int] = set()
    while work < BALANCE_WORK_MAX:
        open_ = [k for k in range(len(packs)) if k not in done]
        if not open_:
            break
        k = max(open_, key=lambda j: (abs(dev[j]), -j))
        best = (0.0, None)
        outs = [None, *packs[k]]  # None: take nothing out of pack k
        for j in [*range(len(packs)), None]:  # None: the pool
            if j == k:
                continue
            others = left if j is None else packs[j]
            for i in outs:
                ci, li = (0.0, 0) if i is None else (costs[i], lengths[i])
                for m in [None, *others]:
                    if i is None and m is None:
                        continue
                    work += 1
                    cm, lm = (0.0, 0) if m is None else (costs[m], lengths[m])
                    new_k = load[k] - li + lm
                    if not least[k] <= new_k <= capacity:
                        continue
                    gain = (dev[k] - ci + cm) ** 2 - dev[k] ** 2
                    if j is not None:
                        new_j = load[j] - lm + li
                        if not least[j] <= new_j <= capacity:
                            continue
                        gain += (dev[j] - cm + ci) ** 2 - dev[j] ** 2
                    if gain < best[0] - 1e-9 * target * target:
                        best = (gain, (i, j, m))
        if best[1] is None:
            done.add(k)
            continue
        i, j, m = best[1]
        moved = (0.0 if i is None else costs[i]) - (0.0 if m is None else costs[m])
        tokens = (0 if i is None else lengths[i]) - (0 if m is None else lengths[m])
        others = left if j is None else packs[j]
        if i is not None:
            packs[k].remove(i)
            others.append(i)
        if m is not None:
            others.remove(m)
            packs[k].append(m)
        load[k] -= tokens
        dev[k] -= moved
        if j is not None:
            load[j] += tokens
            dev[j] += moved
            done.discard(j)
    return [sorted(g) for g in packs], sorted(left)


def balance_target(lengths: list[int], costs: list[float], capacity: int) -> float:
    """The cost a pack aims at: a full row at the stream's FLOPs per token,
    ``capacity × Σcosts / Σlengths``.

        >>> balance_target([2, 6], [3.0, 5.0], capacity=10)
        10.0
    """
    tokens = sum(lengths)
    return capacity * sum(costs) / tokens if tokens else 0.0


def balance_round(
    groups: list[list[int]],
    lengths: list[int],
    costs: list[float],
    *,
    capacity: int,
    target: float,
    pool: list[int] | None = None,
) -> tuple[list[list[int]], list[int]]:
    """:func:`balance_packs` of one round (``groups`` and ``pool`` cover the round's
    ``lengths``, each ≤ ``capacity``: callers leave overlength samples out), its floor the
    round's :func:`~packline.packing.selection.full_load`."""
    return balance_packs(
        groups,
        pool or [],
        lengths,
        costs,
        capacity=capacity,
        target=target,
        floor=full_load(lengths, capacity),
    )
