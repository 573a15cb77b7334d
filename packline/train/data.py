"""The training stream: this rank's packed rows, in the order the trainer consumes them.

One :class:`TrainStream` per run and rank wraps Energon's savable loader (the packing task
encoder over the prepared dataset) and keeps the :class:`~packline.packing.ledger.Ledger`
of what it read. Iterate :meth:`TrainStream.rows` to inspect exactly the rows a run trains
on (a row is a :class:`~packline.packing.thd.PackedBatch`: its conversations, ``cu_seqlens``
and keys); the trainer takes them ``rows_per_rank`` at a time with :meth:`next_rows`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from packline.energon.loader import train_loader
from packline.energon.packing import PackingSettings, make_encoder
from packline.packing.ledger import SKIPPED_ON_RESUME, Ledger
from packline.packing.thd import PackedBatch


@dataclass(kw_only=True)
class StreamSettings:
    """What shapes the training stream (rank-independent)."""

    packing: PackingSettings
    """Row capacity, alignment, selection algorithm and its seed."""
    encoder_mode: str
    """``eager`` or ``lazy`` image decoding (``packing.encoder``)."""
    packing_buffer_size: int
    """Samples Energon gathers before each packing round (``packing.packing_buffer_size``)."""
    shuffle_buffer_size: int
    """Samples in Energon's shuffle buffer (``train.shuffle_buffer_size``)."""
    max_samples_per_sequence: int
    """Samples read in a row from one shard before switching to another
    (``train.max_samples_per_sequence``)."""
    num_workers: int
    """Loader worker processes per rank (``train.num_workers``)."""
    seed: int
    """Energon's ``seed_offset`` (``train.seed``)."""


class TrainStream:
    """Rank ``rank`` of ``world``'s endless stream of packed rows from ``dataset_path``."""

    def __init__(
        self,
        settings: StreamSettings,
        *,
        dataset_path: Path,
        processor_dir: Path,
        rank: int = 0,
        world: int = 1,
    ):
        self.settings = settings
        self.encoder = make_encoder(settings.encoder_mode, processor_dir, settings.packing)
        self.loader = train_loader(
            dataset_path,
            self.encoder,
            packing_buffer_size=settings.packing_buffer_size,
            rank=rank,
            world_size=world,
            num_workers=settings.num_workers,
            repeat=True,
            shuffle_buffer_size=settings.shuffle_buffer_size,
            max_samples_per_sequence=settings.max_samples_per_sequence,
            seed_offset=settings.seed,
        )
        self.ledger = Ledger()
        self.trained: Counter = Counter()
        """Keys of the conversations in the rows this stream returned, with multiplicity
        (with what a resume under another layout inherited: :meth:`continue_after`)."""
        self.skips: Counter = Counter()
        """What the encoder is still to skip, as far as its rows have reported."""
        self._rows: Iterator | None = None

    def rows(self) -> Iterator[PackedBatch]:
        """The rows in training order, from where the stream stands (rows that carry only
        ledger entries, no conversation, are counted and skipped)."""
        while True:
            yield self._next_row()

    def next_rows(self, n: int) -> list[PackedBatch]:
        """The next ``n`` rows: one optimizer step's share of this rank."""
        return [self._next_row() for _ in range(n)]

    def _next_row(self) -> PackedBatch:
        if self._rows is None:
            self._rows = iter(self.loader)
        while True:
            batch = next(self._rows).batch
            self.ledger.add(seen=batch.seen, packed=batch.num_conversations, dropped=batch.dropped)
            self.trained.update(batch.keys)
            for key in batch.dropped.get(SKIPPED_ON_RESUME, ()):
                self.skips[key] -= 1
                if self.skips[key] <= 0:
                    del self.skips[key]
            if batch.num_conversations:
                return batch

    # -- checkpoints ------------------------------------------------------------------------

    def state(self) -> dict:
        """What resumes this stream exactly: Energon's loader state, the ledger, what it
        trained and what it is still to skip. Samples seen but still waiting in a packing
        buffer are left out of the ledger's ``seen``: Energon restores its buffers by
        encoding those samples again, which counts them a second time."""
        led = self.ledger
        return {
            "loader": self.loader.save_state_rank(),
            "ledger": {
                "seen": led.packed + led.num_dropped,
                "packed": led.packed,
                "dropped": dict(led.dropped),
                "skipped_on_resume": led.skipped_on_resume,
            },
            "trained": dict(self.trained),
            "skips": dict(self.skips),
        }

    def restore(self, state: dict) -> None:
        """Continue exactly where :meth:`state` stood (the same data-parallel layout)."""
        self.loader.restore_state_rank(state["loader"])
        self.ledger = _ledger(state["ledger"])
        self.trained = Counter(state["trained"])
        self._skip(Counter(state["skips"]))

    def continue_after(self, states: list[dict], *, counts_ledger: bool) -> int:
        """Continue the :meth:`state` of every data-parallel rank of a run saved under
        another layout: Energon's positions are per rank and cannot carry over, so this
        stream starts from the beginning and skips each conversation the saved run trained
        as many times as it trained it (a conversation lives in one rank's slice, so every
        rank is given them all). ``counts_ledger``: this rank carries the saved ledger and
        trained counts on (one rank does, so they are counted once). Returns how many
        conversations the saved run trained."""
        trained: Counter = Counter()
        merged = Ledger()
        for st in states:
            trained.update(st["trained"])
            merged = merged.merge(_ledger(st["ledger"]))
        if counts_ledger:
            self.ledger, self.trained = merged, Counter(trained)
        self._skip(trained)
        return trained.total()

    def _skip(self, keys: Counter) -> None:
        """Skip ``keys`` (before the loader starts: its workers copy the encoder)."""
        if self._rows is not None:
            raise RuntimeError("the stream has started: restore it before reading")
        self.skips = Counter(keys)
        self.encoder.skip = Counter(keys)


def _ledger(saved: dict) -> Ledger:
    led = Ledger(
        seen=saved["seen"],
        packed=saved["packed"],
        skipped_on_resume=saved.get("skipped_on_resume", 0),
    )
    led.dropped.update(saved["dropped"])
    return led
