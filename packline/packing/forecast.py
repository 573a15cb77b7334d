"""The packing forecast: the packs a train backend's Energon loader will emit, simulated on
lengths before training — integers in, figures out (no torch, no config). connect
(``forecast.json``), validate (the fill at the configured buffer) and ``packline bench
packing`` all call :func:`simulate_packing`; :func:`forecast_fill` gives the fill per buffer
size. What a config's backend reads and packs with, and the FLOPs of its epoch, are
:mod:`packline.forecast`'s (one floor up).

What it simulates, per train backend (``backend``):

- The loader reads with ``num_ranks`` data-parallel ranks × ``num_workers`` DataLoader
  workers each (``0``: one stream per rank, in the training process). Energon splits the
  samples into one contiguous range per global worker, rank-major, the sizes differing by
  at most one (:func:`worker_ranges`, as ``Sharder.split_samples_to_workers``). Each worker
  has its own packing buffer of ``buffer_size`` samples, filled in its stream order; each
  round hands the whole buffer to selection and clears it; a worker's last round holds
  what is left (one epoch, ``repeat=False``; a repeating loader runs on into the next
  epoch instead).
- ``local`` (packline's task encoder): the buffer is packed with ``algorithm``
  (``select_packs``: ``ffd``, ``bfd`` or ``refined``). A sample whose aligned length is over
  ``capacity`` takes its buffer slot and is dropped by selection (the ledger's
  ``overlength``).
- ``megatron`` (Megatron-Bridge's ``QwenVLTaskEncoder``, or packline's subclass of it): a
  sample over ``capacity`` raises in the encoder and never reaches the buffer
  (``Forecast.skipped``). Bridge's own selection is plain first-fit decreasing
  (``algorithm="ffd"``, ``packing.packer: bridge``); packline's subclass selects as the
  local encoder does.
- ``max_carry_rounds`` > 0 (carry-over, :mod:`packline.packing.carry`): each round emits
  the packs :func:`~packline.packing.carry.carry_round` picks and the next round's buffer
  starts with the samples it carried; the round that finds the stream exhausted packs
  everything with ``algorithm``.

Approximation: the stream order is the caller's. Energon gives each worker a contiguous
range of the dataset and reads it in its own shuffled order; callers pass a seeded shuffle
of the lengths (connect: ``train.seed``), so each worker gets a random share in a random
order, as it does when the dataset order is not sorted by length.

Worked example, capacity 10, buffers of 3, 2 ranks without workers: the 8 samples split
4 + 4; rank 0's buffers are [6, 5, 4] → [6, 4], [5] and [3]; on rank 1 the local encoder's
buffer [12, 2, 7] drops the 12 and packs [7, 2], then [1], while Bridge skips the 12 before
its buffer and packs [2, 7, 1] into one row::

    >>> stream = [6, 5, 4, 3, 12, 2, 7, 1]
    >>> local = simulate_packing(stream, capacity=10, buffer_size=3, algorithm="ffd",
    ...                          num_ranks=2)
    >>> [(r.worker, r.items, r.groups) for r in local.rounds]
    [(0, [0, 1, 2], [[0, 2], [1]]), (0, [3], [[3]]), (1, [4, 5, 6], [[6, 5]]), (1, [7], [[7]])]
    >>> local.packs, local.dropped, local.tokens, local.fill, local.round_bound_packs
    (5, [4], 28, 0.56, 5)
    >>> bridge = simulate_packing(stream, capacity=10, buffer_size=3, algorithm="ffd",
    ...                           backend="megatron", num_ranks=2)
    >>> bridge.packs_per_round, bridge.skipped, bridge.fill
    ([2, 1, 1], [4], 0.7)

With carry-over, rank 0's first round emits [6, 4] and carries the 5, which the next round
packs with the 3 (the stream is then exhausted): 4 rows instead of 5::

    >>> carried = simulate_packing(stream, capacity=10, buffer_size=3, algorithm="ffd",
    ...                            num_ranks=2, max_carry_rounds=4)
    >>> [(r.items, r.groups, r.carried) for r in carried.rounds if r.worker == 0]
    [([0, 1, 2], [[0, 2]], [1]), ([1, 3], [[1, 3]], [])]
    >>> carried.packs, carried.fill
    (4, 0.7)
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from packline.packing.balance import balance_round, balance_target
from packline.packing.carry import carry_round
from packline.packing.selection import algorithm_named, select_packs
from schemas.choices import Algorithm

#: The train backends whose packer :func:`simulate_packing` simulates.
BACKENDS = ("local", "megatron")


@dataclass(kw_only=True)
class Round:
    """One buffer round of one loader worker."""

    worker: int
    """Global loader worker: rank × workers per rank + worker."""
    items: list[int]
    """Stream positions of the samples in the buffer, in arrival order."""
    groups: list[list[int]] = field(default_factory=list)
    """The packs selection emits, as stream positions (the algorithm's order)."""
    carried: list[int] = field(default_factory=list)
    """Carry-over: the positions put back for the next round."""


@dataclass(kw_only=True)
class Forecast:
    """The packs of one simulated epoch and the figures callers report."""

    capacity: int
    buffer_size: int
    backend: str
    algorithm: str
    max_carry_rounds: int
    balance: bool
    """FLOPs balance on (``costs`` given)."""
    num_streams: int
    """Loader streams with a buffer each: ranks × max(workers, 1)."""
    lengths: list[int]
    """The aligned lengths of the stream given."""
    rounds: list[Round]
    """Every buffer round, worker by worker, each worker's in order."""
    skipped: list[int]
    """Backend megatron: positions over capacity, skipped before the buffer."""
    dropped: list[int]
    """Backend local: positions over capacity, dropped from their buffer."""

    @property
    def packs(self) -> int:
        """Rows emitted."""
        return sum(len(r.groups) for r in self.rounds)

    @property
    def packs_per_round(self) -> list[int]:
        return [len(r.groups) for r in self.rounds]

    @property
    def samples(self) -> int:
        """Samples packed (every one that fits)."""
        return sum(len(g) for r in self.rounds for g in r.groups)

    @property
    def tokens(self) -> int:
        """Σ aligned lengths of the packed samples."""
        return sum(self.lengths[i] for r in self.rounds for g in r.groups for i in g)

    @property
    def fill(self) -> float:
        """Σ aligned packed lengths / (rows × capacity); 0.0 without rows."""
        return self.tokens / (self.packs * self.capacity) if self.packs else 0.0

    @property
    def round_bound_packs(self) -> int:
        """Σ over rounds of ⌈Σ fitting lengths of the round / capacity⌉: the fewest rows any
        packer can emit with these rounds when, as Energon's ``PackingDataset`` does, each
        round emits everything it selected (no carry-over: no sample waits for a better
        one). With carry-over it only counts the rows of each round's emitted tokens."""
        rows = 0
        for r in self.rounds:
            packed = sum(self.lengths[i] for g in r.groups for i in g)
            rows += -(-packed // self.capacity)
        return rows

    @property
    def round_bound_fill(self) -> float:
        """:attr:`tokens` / (:attr:`round_bound_packs` × capacity): the best fill possible."""
        rows = self.round_bound_packs
        return self.tokens / (rows * self.capacity) if rows else 0.0


def worker_ranges(num_samples: int, num_streams: int) -> list[tuple[int, int]]:
    """``[start, end)`` of each global worker's share of ``num_samples``, as Energon's
    ``Sharder.split_samples_to_workers`` computes it: ⌊n/W⌋ each, one more for the first
    n mod W workers of a generalized bit-reversal order, contiguous in worker order.

        >>> worker_ranges(10, 4)  # 2 extra samples: workers 0 and 2 (bit reversal 0, 2, 1, 3)
        [(0, 3), (3, 5), (5, 8), (8, 10)]
    """
    if num_streams < 1:
        raise ValueError(f"num_streams must be >= 1, got {num_streams}")
    base, extra = divmod(num_samples, num_streams)
    counts = [0] * num_streams
    for order, worker in enumerate(_bit_reversal(list(range(num_streams)))):
        counts[worker] = base + (order < extra)
    out, start = [], 0
    for n in counts:
        out.append((start, start + n))
        start += n
    return out


def _bit_reversal(indices: list[int]) -> list[int]:
    """Energon's ``Sharder._generalized_bit_reversal``: halve, recurse, interleave."""
    if len(indices) <= 2:
        return indices
    mid = len(indices) // 2
    left, right = _bit_reversal(indices[:mid]), _bit_reversal(indices[mid:])
    out = []
    for j in range(max(len(left), len(right))):
        out += left[j : j + 1] + right[j : j + 1]
    return out


def _worker_streams(
    lengths: list[int], *, capacity: int, backend: str, num_ranks: int, num_workers: int
) -> tuple[list[list[int]], list[int]]:
    """Each global worker's stream of positions, and the positions skipped before any buffer
    (backend megatron's overlength samples)."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown train backend {backend!r}: use one of {BACKENDS}")
    if num_ranks < 1 or num_workers < 0:
        raise ValueError(
            f"need num_ranks >= 1 and num_workers >= 0, got {num_ranks}, {num_workers}"
        )
    streams: list[list[int]] = []
    skipped: list[int] = []
    for start, end in worker_ranges(len(lengths), num_ranks * max(num_workers, 1)):
        stream = list(range(start, end))
        if backend == "megatron":
            skipped += [i for i in stream if lengths[i] > capacity]
            stream = [i for i in stream if lengths[i] <= capacity]
        streams.append(stream)
    return streams, skipped


@dataclass(frozen=True)
class _Balance:
    """FLOPs balance in a simulation: every stream position's cost, and the target."""

    costs: list[float]
    target: float


def _select(
    lengths: list[int], items: list[int], capacity: int, algorithm: str, balance: _Balance | None
) -> list[list[int]]:
    fits = [i for i in items if lengths[i] <= capacity]
    sizes = [lengths[i] for i in fits]
    groups = select_packs(sizes, capacity=capacity, algorithm=algorithm, seed=None)
    if balance is not None:
        groups, _ = balance_round(
            groups,
            sizes,
            [balance.costs[i] for i in fits],
            capacity=capacity,
            target=balance.target,
        )
    return [[fits[j] for j in g] for g in groups]


def _carry_rounds(
    lengths: list[int],
    stream: list[int],
    worker: int,
    *,
    capacity: int,
    buffer_size: int,
    algorithm: str,
    max_carry_rounds: int,
    balance: _Balance | None,
) -> list[Round]:
    """One worker's rounds with carry-over, as ``CarryOverPackingDataset`` runs them: the
    buffer is topped up to ``buffer_size`` from the stream before each round; the round that
    finds the stream exhausted packs what is left with ``algorithm``."""
    rounds: list[Round] = []
    waiting: list[tuple[int, int]] = []  # (position, rounds waited)
    at = 0
    while True:
        exhausted = False
        while len(waiting) < buffer_size:
            if at == len(stream):
                exhausted = True
                break
            waiting.append((stream[at], 0))
            at += 1
        if not waiting:
            return rounds
        r = Round(worker=worker, items=[i for i, _ in waiting])
        rounds.append(r)
        if exhausted:
            r.groups = _select(lengths, r.items, capacity, algorithm, balance)
            return rounds
        fits = [(i, w) for i, w in waiting if lengths[i] <= capacity]
        decided = carry_round(
            [lengths[i] for i, _ in fits],
            [w for _, w in fits],
            capacity=capacity,
            max_rounds=max_carry_rounds,
            seed=r.items[0],
            costs=None if balance is None else [balance.costs[i] for i, _ in fits],
            target=0.0 if balance is None else balance.target,
        )
        r.groups = [[fits[j][0] for j in g] for g in decided.emit]
        r.carried = [fits[j][0] for j in decided.carry]
        waiting = [(fits[j][0], fits[j][1] + 1) for j in decided.carry]


def simulate_packing(
    lengths: list[int],
    *,
    capacity: int,
    buffer_size: int,
    algorithm: str,
    backend: str = "local",
    num_ranks: int = 1,
    num_workers: int = 0,
    max_carry_rounds: int = 0,
    costs: list[float] | None = None,
) -> Forecast:
    """Simulate one epoch of the ``backend``'s packer over ``lengths`` (aligned, in stream
    order) — see the module docstring. ``num_workers`` is per rank, 0 meaning one stream;
    ``max_carry_rounds`` 0 is Energon's own round (no carry-over); ``costs`` (each sample's
    FLOPs, by stream position) turns FLOPs balance on (:mod:`packline.packing.balance`),
    towards the full-row cost of the samples that fit."""
    algorithm_named(algorithm)  # a ValueError naming the choices
    if max_carry_rounds < 0:
        raise ValueError(f"max_carry_rounds must be >= 0, got {max_carry_rounds}")
    if buffer_size < 1:
        raise ValueError(f"buffer_size must be >= 1, got {buffer_size}")
    streams, skipped = _worker_streams(
        lengths, capacity=capacity, backend=backend, num_ranks=num_ranks, num_workers=num_workers
    )
    balance = None
    if costs is not None:
        if len(costs) != len(lengths):
            raise ValueError(f"{len(costs)} costs for {len(lengths)} lengths")
        fits = [i for i, n in enumerate(lengths) if n <= capacity]
        target = balance_target([lengths[i] for i in fits], [costs[i] for i in fits], capacity)
        balance = _Balance(costs=list(costs), target=target)
    rounds: list[Round] = []
    for worker, stream in enumerate(streams):
        if max_carry_rounds:
            rounds += _carry_rounds(
                lengths,
                stream,
                worker,
                capacity=capacity,
                buffer_size=buffer_size,
                algorithm=algorithm,
                max_carry_rounds=max_carry_rounds,
                balance=balance,
            )
            continue
        for at in range(0, len(stream), buffer_size):  # Energon's own rounds
            r = Round(worker=worker, items=stream[at : at + buffer_size])
            r.groups = _select(lengths, r.items, capacity, algorithm, balance)
            rounds.append(r)
    # an overlength sample is in one round only: selection never carries it
    dropped = [i for r in rounds for i in r.items if lengths[i] > capacity]
    return Forecast(
        capacity=capacity,
        buffer_size=buffer_size,
        backend=backend,
        algorithm=algorithm,
        max_carry_rounds=max_carry_rounds,
        balance=balance is not None,
        num_streams=num_ranks * max(num_workers, 1),
        lengths=list(lengths),
        rounds=rounds,
        skipped=skipped,
        dropped=dropped,
    )


def rank_packs(forecast: Forecast, num_ranks: int) -> list[list[list[int]]]:
    """Each data-parallel rank's packs in the order its loader yields them: the rank's
    workers (global workers ``rank × W .. rank × W + W − 1``, as :func:`worker_ranges`
    numbers them) take turns, one pack each, as Energon's loader takes one batch from each
    worker in turn; a worker that has run dry is skipped."""
    if forecast.num_streams % num_ranks:
        raise ValueError(f"{forecast.num_streams} streams do not split over {num_ranks} ranks")
    per_rank = forecast.num_streams // num_ranks
    by_worker: dict[int, list[list[int]]] = {}
    for r in forecast.rounds:
        by_worker.setdefault(r.worker, []).extend(r.groups)
    out = []
    for rank in range(num_ranks):
        queues = [by_worker.get(rank * per_rank + w, []) for w in range(per_rank)]
        packs = [
            q[k] for k in range(max(map(len, queues), default=0)) for q in queues if k < len(q)
        ]
        out.append(packs)
    return out


def straggler_ratio(
    forecast: Forecast, costs: list[float], *, num_ranks: int, packs_per_step: int
) -> float:
    """Mean over optimizer steps of (the slowest rank's FLOPs in the step / the ranks'
    mean): how long data-parallel ranks wait for the slowest at each step's gradient
    all-reduce, 1.0 when every rank computes the same. A pack costs the sum of its samples'
    ``costs`` (by stream position, e.g. :meth:`~packline.counters.FlopsModel.sample_flops`);
    a step is ``packs_per_step`` consecutive packs of each rank (its micro-batches: the
    global batch over the ranks); only steps every rank completes count. 1.0 when no step
    is complete.

        >>> f = simulate_packing([4, 4, 2, 2], capacity=4, buffer_size=2, algorithm="ffd",
        ...                      num_ranks=2)  # rank 0 packs [4], [4]; rank 1 [2, 2]
        >>> straggler_ratio(f, [4.0, 4.0, 2.0, 2.0], num_ranks=2, packs_per_step=1)
        1.0
        >>> straggler_ratio(f, [6.0, 4.0, 1.0, 1.0], num_ranks=2, packs_per_step=1)  # 6 vs 2
        1.5
    """
    if packs_per_step < 1:
        raise ValueError(f"packs_per_step must be >= 1, got {packs_per_step}")
    ranks = [
        [sum(costs[i] for i in pack) for pack in packs] for packs in rank_packs(forecast, num_ranks)
    ]
    steps = min(len(r) for r in ranks) // packs_per_step
    if not steps:
        return 1.0
    ratios = []
    for step in range(steps):
        per_rank = [sum(r[step * packs_per_step : (step + 1) * packs_per_step]) for r in ranks]
        mean = sum(per_rank) / len(per_rank)
        ratios.append(max(per_rank) / mean if mean else 1.0)
    return sum(ratios) / len(ratios)


def stream_order(num_samples: int, seed: int) -> list[int]:
    """The forecast's sample stream: table positions in a seeded shuffle (Energon's
    shuffled reading order, approximately)."""
    order = list(range(num_samples))
    random.Random(seed).shuffle(order)
    return order


def forecast_fill(
    lengths: list[int],
    capacity: int,
    buffer_sizes: list[int],
    algorithm: str | Algorithm,
    seed: int,
    *,
    backend: str = "local",
    num_ranks: int = 1,
    num_workers: int = 0,
    max_carry_rounds: int = 0,
    costs: list[float] | None = None,
) -> dict[str, Any]:
    """Fill of packing ``lengths`` (already aligned; any over ``capacity`` are handled as
    ``backend`` does: see ``packline.packing.forecast``) in a seeded stream order, one
    buffer of B samples per loader stream at a time, for each B (with carry-over when
    ``max_carry_rounds`` > 0, and then also the fill without it; with FLOPs balance when
    ``costs`` are given, in the order of ``lengths``); and the lower bound
    Σlen/(⌈Σlen/C⌉·C) over the samples that fit."""
    algorithm = algorithm_named(algorithm).value
    order = stream_order(len(lengths), seed)
    stream = [lengths[i] for i in order]
    ordered_costs = None if costs is None else [costs[i] for i in order]
    fits = [n for n in stream if n <= capacity]
    total = sum(fits)
    out: dict[str, Any] = {
        "capacity": capacity,
        "samples": len(fits),
        "tokens": total,
        "backend": backend,
        "algorithm": algorithm,
        "num_ranks": num_ranks,
        "num_workers": num_workers,
        "max_carry_rounds": max_carry_rounds,
        "balance": costs is not None,
    }
    per_buffer = {}
    for b in buffer_sizes:
        settings = dict(
            capacity=capacity,
            buffer_size=b,
            algorithm=algorithm,
            backend=backend,
            num_ranks=num_ranks,
            num_workers=num_workers,
            costs=ordered_costs,
        )
        simulated = simulate_packing(stream, **settings, max_carry_rounds=max_carry_rounds)
        per_buffer[str(b)] = {"packs": simulated.packs, "fill": simulated.fill}
        if max_carry_rounds:
            per_buffer[str(b)]["fill_without_carry"] = simulate_packing(stream, **settings).fill
    out["buffers"] = per_buffer
    min_packs = -(-total // capacity)
    out["lower_bound"] = {
        "packs": min_packs,
        "fill": total / (min_packs * capacity) if min_packs else 0.0,
    }
    out["unpacked"] = {
        "rows": len(fits),
        "fill": total / (len(fits) * capacity) if fits else 0.0,
    }
    return out


def packing_metrics(forecast: dict[str, Any]) -> dict[str, float]:
    """What a train run logs of the packs its packer makes, from connect's forecast at the
    config's buffer (the one :func:`packline.forecast.forecast_flops` simulated):
    ``packing/forecast_fill`` (real tokens over row capacity),
    ``packing/forecast_padding_share`` (of executed FLOPs),
    ``packing/forecast_straggler_ratio`` over the config's data-parallel ranks and
    ``packing/forecast_rows``. ``{}`` without a FLOPs forecast.

        >>> packing_metrics({"flops": {"tokens_real": 900.0, "tokens_capacity_packed": 1000.0,
        ...     "padding_share_packed": 0.12, "straggler_ratio": 1.02, "rows_packed": 2.0}})
        ... # doctest: +NORMALIZE_WHITESPACE
        {'packing/forecast_fill': 0.9, 'packing/forecast_padding_share': 0.12,
         'packing/forecast_straggler_ratio': 1.02, 'packing/forecast_rows': 2.0}
    """
    f = forecast.get("flops")
    if not f:
        return {}
    capacity = f["tokens_capacity_packed"]
    return {
        "packing/forecast_fill": f["tokens_real"] / capacity if capacity else 0.0,
        "packing/forecast_padding_share": f["padding_share_packed"],
        "packing/forecast_straggler_ratio": f["straggler_ratio"],
        "packing/forecast_rows": f["rows_packed"],
    }
