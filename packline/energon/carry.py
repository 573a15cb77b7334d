"""Carry-over inside Energon: :class:`CarryOverPackingDataset`, a ``PackingDataset`` whose
rounds put the samples of their underfull packs back into the reading buffer
(:mod:`packline.packing.carry` decides which), and :class:`CarryOverBuild`, the task-encoder
mixin that installs it from ``build_batch``.

Energon's loop is kept as it is: each round hands the pre-packer the whole reading buffer
and clears it. Here the pre-packer is :meth:`CarryOverPackingDataset._carry_select`: it
decides the round with :func:`~packline.packing.carry.carry_round` over the encoder's
``packing_length`` of each sample, appends the carried samples to the (just cleared)
reading buffer — so they lead the next round's buffer, which Energon then tops up to
``buffer_size`` with new samples — and returns the packs to emit. Samples the encoder does
not pack (``packing_length`` None: a ledger entry of packline's encoder) ride along with the
first pack emitted.

Saved state: the reading buffer saves the carried samples' restore keys (Energon's
``SavableSampleBuffer``), and ``_carry_waited`` how many rounds each has waited, so a
restored loader decides its next round exactly as the saved one would have.

When the source is exhausted (``repeat=False``), the last round packs everything with the
encoder's own ``select_samples_to_pack``: nothing is left behind.

FLOPs balance (``packing.balance: flops``, :mod:`packline.packing.balance`) weighs each
sample by connect's FLOPs for its key (``CarryOverBuild.balance``), in the carry-over rounds
and in the encoder's own selection alike; it keeps no state of its own.
"""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Callable, Iterator
from typing import Any

from megatron.energon import DefaultTaskEncoder
from megatron.energon.errors import FatalSampleError
from megatron.energon.wrappers.packing_dataset import PackingDataset

from packline.packing.balance import balance_round
from packline.packing.carry import carry_round
from packline.packing.lengths import KeyLengths
from packline.packing.selection import select_packs


class CarryOverPackingDataset(PackingDataset):
    """Energon's ``PackingDataset`` with carry-over (see the module docstring)."""

    _savable_fields = (*PackingDataset._savable_fields, "_carry_waited")

    def __init__(
        self,
        *args: Any,
        packing_length: Callable[[Any], int | None],
        capacity: int,
        max_carry_rounds: int,
        seed: int = 0,
        packing_cost: Callable[[Any], float] | None = None,
        balance_target: float = 0.0,
        **kwargs: Any,
    ):
        if max_carry_rounds < 1:
            raise ValueError(f"max_carry_rounds must be >= 1, got {max_carry_rounds}")
        self.packing_length = packing_length
        self.capacity = capacity
        self.max_carry_rounds = max_carry_rounds
        self.seed = seed
        self.packing_cost = packing_cost
        self.balance_target = balance_target
        super().__init__(*args, **kwargs)
        self._select_all = self.pre_packer
        self.pre_packer = self._carry_select
        self._source_exhausted = False

    @classmethod
    def replacing(cls, packing: PackingDataset, **carry: Any) -> CarryOverPackingDataset:
        """A carry-over copy of ``packing`` (as Energon's ``build_batch`` made it)."""
        return cls(
            packing.dataset,
            buffer_size=packing.buffer_size,
            pre_packer=packing.pre_packer,
            final_packer=packing.final_packer,
            final_packer_stateless=packing.final_packer_stateless,
            sample_encoder=packing.sample_encoder,
            sample_encoder_stateless=packing.sample_encoder_stateless,
            packer_config=packing.packer_config,
            pre_packer_failure_tolerance=packing.pre_packer_failure_tolerance,
            final_packer_failure_tolerance=packing.final_packer_failure_tolerance,
            sample_encoder_failure_tolerance=packing.sample_encoder_failure_tolerance,
            worker_config=packing.worker_config,
            **carry,
        )

    def reset_state_own(self) -> None:
        super().reset_state_own()
        self._carry_waited: list[int] = []

    def _fill_reading_buffer(self, source_iter: Iterator, log_progress: bool = False) -> bool:
        more = super()._fill_reading_buffer(source_iter, log_progress=log_progress)
        if not more:
            self._source_exhausted = True
        return more

    def __iter__(self) -> Iterator[Any]:
        self._source_exhausted = False
        yield from super().__iter__()

    def _carry_select(self, samples: list[Any]) -> list[list[Any]]:
        """The pre-packer: one round with carry-over (Energon has just cleared the reading
        buffer and hands it all here)."""
        waited = self._carry_waited + [0] * (len(samples) - len(self._carry_waited))
        self._carry_waited = []
        if self._source_exhausted:
            return self._select_all(samples)
        lengths = [self.packing_length(s) for s in samples]
        packed = [i for i, n in enumerate(lengths) if n is not None]
        keys = "|".join(str(getattr(s, "__key__", "")) for s in samples)
        decided = carry_round(
            [lengths[i] for i in packed],
            [waited[i] for i in packed],
            capacity=self.capacity,
            max_rounds=self.max_carry_rounds,
            seed=zlib.crc32(keys.encode()) ^ self.seed,
            costs=None
            if self.packing_cost is None
            else [self.packing_cost(samples[i]) for i in packed],
            target=self.balance_target,
        )
        emit = [[samples[packed[j]] for j in g] for g in decided.emit]
        riding = [samples[i] for i, n in enumerate(lengths) if n is None]
        if riding:
            if emit:
                emit[0].extend(riding)
            else:
                emit.append(riding)
        carried = [packed[j] for j in decided.carry]
        self._reading_buffer.extend([samples[i] for i in carried])
        self._carry_waited = [waited[i] + 1 for i in carried]
        assert sum(map(len, emit)) + len(carried) == len(samples), "carry-over lost samples"
        return emit

    def config(self) -> dict[str, Any]:
        return {
            **super().config(),
            "max_carry_rounds": self.max_carry_rounds,
            "balance": self.packing_cost is not None,
        }


def carried_in(state: Any) -> list[int]:
    """The rounds each sample carried over has waited, read from a saved loader state (every
    :class:`CarryOverPackingDataset` in it, every worker): empty when none waits.

        >>> carried_in({"worker_states": [{"_carry_waited": [2, 1]}, {"_carry_waited": []}]})
        [2, 1]
    """
    found: list[int] = []

    def walk(x: Any) -> None:
        if isinstance(x, dict):
            for k, v in x.items():
                if k == "_carry_waited":
                    found.extend(v)
                else:
                    walk(v)
        elif isinstance(x, list | tuple):
            for v in x:
                walk(v)
        elif dataclasses.is_dataclass(x):
            walk({f.name: getattr(x, f.name) for f in dataclasses.fields(x)})

    walk(state)
    return found


class CarryOverBuild(DefaultTaskEncoder):
    """Task-encoder mixin: packline's selection of a round (:meth:`select_round`: the
    encoder's ``select_samples_to_pack``), and ``build_batch`` that builds Energon's stages
    as usual, then swaps its ``PackingDataset`` for a :class:`CarryOverPackingDataset` when
    ``max_carry_rounds`` > 0.

    The encoder provides ``max_carry_rounds``, ``carry_capacity`` (the row capacity),
    ``carry_seed``, ``packing_length(sample)`` (the aligned length selection packs, or None
    for a sample that only rides along) and, for FLOPs balance, ``balance``: connect's
    figures by key (:class:`~packline.packing.lengths.KeyLengths`), None for none."""

    max_carry_rounds: int = 0
    carry_capacity: int = 0
    carry_seed: int = 0
    balance: KeyLengths | None = None
    balance_target: float = 0.0

    def packing_length(self, sample: Any) -> int | None:
        raise NotImplementedError

    def packing_cost(self, sample: Any) -> float:
        """The sample's FLOPs alone, from connect's table (FLOPs balance)."""
        measured = self.balance.get(sample.__key__) if self.balance is not None else None
        if measured is None:
            raise FatalSampleError.from_sample(
                sample,
                f"sample {sample.__key__!r} has no FLOPs in connect's table "
                f"{getattr(self.balance, 'path', None)}: the dataset is not the one connect "
                "measured. Rerun connect on it, or set packing.balance=none",
            )
        return measured.flops

    def select_round(
        self, samples: list[Any], algorithm: str, round_of: list[Any] | None = None
    ) -> list[list[int]]:
        """One Energon round (``samples`` all packed: none rides along), as positions:
        :func:`~packline.packing.selection.select_packs` with ``algorithm`` over the
        aligned lengths, seeded by the keys of the round (``round_of``, default
        ``samples``: deterministic, no state to save), then FLOPs-balanced when
        ``balance`` is set."""
        lengths = [self.packing_length(s) for s in samples]
        keys = "|".join(s.__key__ for s in (samples if round_of is None else round_of))
        groups = select_packs(
            lengths,
            capacity=self.carry_capacity,
            algorithm=algorithm,
            seed=zlib.crc32(keys.encode()) ^ self.carry_seed,
        )
        if self.balance is None:
            return groups
        costs = [self.packing_cost(s) for s in samples]
        balanced, _ = balance_round(
            groups, lengths, costs, capacity=self.carry_capacity, target=self.balance_target
        )
        return balanced

    def build_batch(self, dataset, **kwargs: Any):
        built = super().build_batch(dataset, **kwargs)
        if kwargs.get("packing_buffer_size") is None or self.max_carry_rounds < 1:
            return built
        parent, node = None, built
        while not isinstance(node, PackingDataset):
            parent, node = node, node.dataset
        carrying = CarryOverPackingDataset.replacing(
            node,
            packing_length=self.packing_length,
            capacity=self.carry_capacity,
            max_carry_rounds=self.max_carry_rounds,
            seed=self.carry_seed,
            packing_cost=None if self.balance is None else self.packing_cost,
            balance_target=self.balance_target,
        )
        if parent is None:
            return carrying
        parent.datasets = (carrying,)
        return built
