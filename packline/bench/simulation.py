"""The packer simulated on plain lengths (no loader): the fill of every packing method, and
the time ``select_packs`` takes.

Fill is real tokens / emitted capacity. The methods of :func:`fill_by_method`:

- ``none``: no packing, batches of :data:`UNPACKED_BATCH` padded to their longest.
- ``eager_ffd@16`` and ``lazy_{ffd,bfd,refined}@B``: packline's packer with that
  ``packing.algorithm``, one buffer stream, simulated by
  :func:`packline.packing.forecast.simulate_packing`. ``ffd`` and ``bfd`` are the plain
  greedy packings, ``ffd`` the one Megatron-Bridge runs; ``refined`` is the local default.
  Eager and lazy encoders select identically, so their simulated fills are equal by
  construction.
- ``carry_refined@B``: ``refined`` with carry-over (``packing.max_carry_rounds`` 4,
  :mod:`packline.packing.carry`): a round's underfull packs wait for a later round.
- ``offline_bfd``: plain BFD, the whole set in one buffer.
- ``round_bound@B``: the most any packer can fill when, as in Energon, the stream is cut
  into disjoint buffers of B (:func:`round_bound_fill`).
- ``lower_bound``: Σlen / (⌈Σlen/C⌉·C) (:func:`lower_bound_fill`).
"""

from __future__ import annotations

import math
import random
import time
from typing import Any

from packline.bench.lengths import shuffled
from packline.packing.forecast import simulate_packing, straggler_ratio
from packline.packing.selection import ALGORITHMS, select_packs

#: Buffer sizes of the simulated packer.
BUFFERS = (16, 64, 256, 1024)
#: Batch size of the no-packing baseline (each batch padded to its longest sample).
UNPACKED_BATCH = 8


def unpacked_capacity(stream: list[int], *, capacity: int, batch_size: int) -> int:
    """Tokens emitted without packing: the samples that fit, in batches of ``batch_size``,
    each batch padded to its longest (a short last batch counts its own size).

        >>> unpacked_capacity([6, 5, 4, 3, 12, 2], capacity=10, batch_size=2)
        22
    """
    fits = [n for n in stream if n <= capacity]
    return sum(
        len(fits[i : i + batch_size]) * max(fits[i : i + batch_size])
        for i in range(0, len(fits), batch_size)
    )


def lower_bound_fill(lengths: list[int], capacity: int) -> float:
    """Σlen / (⌈Σlen/C⌉·C) over the samples that fit: no packer does better.

    >>> lower_bound_fill([6, 5, 4, 3, 12, 2], 10)
    1.0
    """
    total = sum(n for n in lengths if n <= capacity)
    return total / (-(-total // capacity) * capacity) if total else 0.0


def packed_fill(
    stream: list[int],
    *,
    capacity: int,
    buffer_size: int | None,
    algorithm: str,
    max_carry_rounds: int = 0,
) -> float:
    """Fill of packline's packer (backend local, one stream) on ``stream``: consecutive
    buffers of ``buffer_size`` samples (None: one buffer), an overlength sample taking its
    buffer slot and no row. 0.0 when nothing fits.

    Worked example, capacity 10, buffers of 3 (the 12 is dropped; 20 tokens)::

        >>> packed_fill([6, 5, 4, 3, 12, 2], capacity=10, buffer_size=3, algorithm="ffd")
        0.6666666666666666
        >>> packed_fill([6, 5, 4, 3, 12, 2], capacity=10, buffer_size=None, algorithm="ffd")
        1.0
    """
    if buffer_size is not None and buffer_size < 1:
        raise ValueError(f"buffer_size must be >= 1 or None, got {buffer_size}")
    return simulate_packing(
        stream,
        capacity=capacity,
        buffer_size=buffer_size or max(len(stream), 1),
        algorithm=algorithm,
        max_carry_rounds=max_carry_rounds,
    ).fill


def round_bound_fill(stream: list[int], *, capacity: int, buffer_size: int) -> float:
    """Σlen / (Σ_rounds ⌈Σlen_round/C⌉·C): the best fill of any packer whose rounds are
    consecutive buffers of ``buffer_size`` samples, as Energon's are (it clears the whole
    buffer each round, so no sample waits for a better round).

    >>> round_bound_fill([6, 5, 4, 3, 12, 2], capacity=10, buffer_size=3)  # 15 → 2, 5 → 1
    0.6666666666666666
    """
    return simulate_packing(
        stream, capacity=capacity, buffer_size=buffer_size, algorithm="ffd"
    ).round_bound_fill


def fill_by_method(lengths: list[int], *, capacity: int, seed: int) -> dict[str, float]:
    """``fill.<name>`` for every method (see the module docstring) on ``lengths``, streamed
    in :func:`~packline.bench.lengths.shuffled` order; ValueError when nothing fits.

    >>> f = fill_by_method([6, 5, 4, 3, 12, 2], capacity=10, seed=0)
    >>> f["offline_bfd"], f["lower_bound"]
    (1.0, 1.0)
    """
    stream = shuffled(lengths, seed)
    real = sum(n for n in stream if n <= capacity)
    if real == 0:
        raise ValueError(f"no sample fits capacity {capacity}: nothing to pack")

    def packed(buffer_size: int | None, algorithm: str) -> float:
        return packed_fill(stream, capacity=capacity, buffer_size=buffer_size, algorithm=algorithm)

    fill = {"none": real / unpacked_capacity(stream, capacity=capacity, batch_size=UNPACKED_BATCH)}
    # The eager encoder hands select_packs the same lengths as the lazy one.
    fill["eager_ffd@16"] = packed(16, "ffd")
    for algorithm in ALGORITHMS:
        for b in BUFFERS:
            fill[f"lazy_{algorithm}@{b}"] = packed(b, algorithm)
    for b in BUFFERS:
        fill[f"carry_refined@{b}"] = packed_fill(
            stream, capacity=capacity, buffer_size=b, algorithm="refined", max_carry_rounds=4
        )
    fill["offline_bfd"] = packed(None, "bfd")
    for b in BUFFERS:
        fill[f"round_bound@{b}"] = round_bound_fill(stream, capacity=capacity, buffer_size=b)
    fill["lower_bound"] = lower_bound_fill(stream, capacity)
    return fill


def fill_summary(lengths: list[int], *, capacity: int, seed: int) -> dict[str, Any]:
    """One length distribution's entry of the benchmark: its number of samples, how many
    are overlength (dropped), and :func:`fill_by_method`.

    >>> s = fill_summary([6, 5, 4, 3, 12, 2], capacity=10, seed=0)
    >>> s["samples"], s["overlength"], s["fill"]["lower_bound"]
    (6, 1, 1.0)
    """
    return {
        "samples": len(lengths),
        "overlength": sum(n > capacity for n in lengths),
        "fill": fill_by_method(lengths, capacity=capacity, seed=seed),
    }


def time_selection(lengths: list[int], *, capacity: int, repeats: int = 3) -> dict[str, float]:
    """Best-of-``repeats`` seconds of ``select_packs`` on all ``lengths`` in one buffer,
    per algorithm of :data:`packline.packing.selection.ALGORITHMS`.

    >>> sorted(time_selection([6, 5, 4, 3, 2], capacity=10, repeats=1)) == sorted(ALGORITHMS)
    True
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    out = {}
    for algorithm in ALGORITHMS:
        best = math.inf
        for _ in range(repeats):
            t0 = time.perf_counter()
            select_packs(lengths, capacity=capacity, algorithm=algorithm)
            best = min(best, time.perf_counter() - t0)
        out[algorithm] = best
    return out


#: The cluster comparison's packers: (name, algorithm, max_carry_rounds, FLOPs balance,
#: buffer sizes). ``bridge_ffd`` is Bridge's own encoder (``packing.packer: bridge``);
#: ``packline_refined`` packline's packer in Bridge without carry-over, ``packline_carry``
#: with it, ``_balanced`` with ``packing.balance: flops`` (only when costs are given).
CLUSTER_PACKERS = (
    ("bridge_ffd", "ffd", 0, False, (16, 32)),
    ("packline_refined", "refined", 0, False, (16, 64, 256)),
    ("packline_refined_balanced", "refined", 0, True, (16, 64, 256)),
    ("packline_carry", "refined", 4, False, (16, 64, 256)),
    ("packline_carry_balanced", "refined", 4, True, (16, 64, 256)),
)
#: The straggler figure's layout: the 8B config's 8 data-parallel ranks, 2 loader workers
#: each, 4 packed micro-batches per rank per step (global batch 32).
CLUSTER_RANKS, CLUSTER_WORKERS, CLUSTER_PACKS_PER_STEP = 8, 2, 4


def cluster_packing(
    lengths: list[int], *, capacity: int, seed: int, costs: list[float] | None = None
) -> dict[str, dict[str, float]]:
    """Bridge's packer against packline's on one stream (``lengths`` in a seeded shuffle,
    backend megatron: overlength samples skipped before the buffer), per ``<packer>@<buffer>``
    of :data:`CLUSTER_PACKERS`: fill, padding tokens (rows × capacity − tokens), rows, the
    per-round bound of its rounds (what no packer without carry-over beats), the buffer bound
    (what no packer at all beats: a row holds samples of one buffer, at most ``buffer`` of
    them, so there are at least ⌈samples / buffer⌉ rows, and at least ⌈tokens / capacity⌉),
    and the simulation's milliseconds per sample (selection and the simulation's own
    bookkeeping: an upper bound on selection). With ``costs`` (each sample's FLOPs), also the
    straggler ratio of the same packer over :data:`CLUSTER_RANKS` ranks ×
    :data:`CLUSTER_WORKERS` workers (:func:`~packline.packing.forecast.straggler_ratio`), the
    same ratio were each sample's FLOPs proportional to its tokens (the floor of a balance
    that keeps the rows as full), and the FLOPs-balanced packers.

    >>> c = cluster_packing([6, 5, 4, 3, 12, 2, 7, 1], capacity=10, seed=0)
    >>> c["bridge_ffd@16"]["fill"], c["packline_carry@16"]["padding_tokens"]
    (0.9333333333333333, 2)
    """
    order = list(range(len(lengths)))
    random.Random(seed).shuffle(order)
    stream = [lengths[i] for i in order]
    out: dict[str, dict[str, float]] = {}
    ordered = None if costs is None else [costs[i] for i in order]
    for name, algorithm, carry, balance, buffers in CLUSTER_PACKERS:
        if balance and ordered is None:
            continue
        for b in buffers:
            settings = dict(
                capacity=capacity,
                buffer_size=b,
                algorithm=algorithm,
                backend="megatron",
                max_carry_rounds=carry,
                costs=ordered if balance else None,
            )
            t0 = time.perf_counter()
            f = simulate_packing(stream, **settings)
            seconds = time.perf_counter() - t0
            fewest = max(-(-f.samples // b), -(-f.tokens // capacity), 1)
            out[f"{name}@{b}"] = figures = {
                "fill": f.fill,
                "padding_tokens": f.packs * capacity - f.tokens,
                "rows": f.packs,
                "round_bound_fill": f.round_bound_fill,
                "buffer_bound_fill": f.tokens / (fewest * capacity),
                "select_ms_per_sample": 1e3 * seconds / max(f.samples, 1),
            }
            if costs is not None:
                ranks = simulate_packing(
                    stream, **settings, num_ranks=CLUSTER_RANKS, num_workers=CLUSTER_WORKERS
                )
                figures["straggler_ratio"] = straggler_ratio(
                    ranks,
                    ordered,
                    num_ranks=CLUSTER_RANKS,
                    packs_per_step=CLUSTER_PACKS_PER_STEP,
                )
                # the same packs, were every sample's FLOPs proportional to its tokens: what
                # the rows' token counts alone leave, the floor of any FLOPs balance that
                # keeps them as full
                figures["straggler_ratio_tokens"] = straggler_ratio(
                    ranks,
                    [float(n) for n in stream],
                    num_ranks=CLUSTER_RANKS,
                    packs_per_step=CLUSTER_PACKS_PER_STEP,
                )
    return out
