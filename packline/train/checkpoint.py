"""Checkpoints of a training run: ``<run_dir>/checkpoints/step_NNNNNN/``.

A checkpoint is written to ``.tmp-step_NNNNNN`` and renamed into place once every file is
there, so a crash mid-write leaves the previous checkpoint intact (and the torn one aside);
the last ``keep_last`` are kept. Files come in two kinds: each rank writes its own
(``<name>_rank000.pt``: its loader state, RNG, ledger), rank 0 writes the shared ones (the
trainable weights, optimizer, scheduler) and ``state.json`` last.

:func:`add_write_hook` lets a caller run code after each file of a write (the resume tests
SIGKILL the process there); nothing runs by default.

>>> import tempfile, pathlib
>>> ckpt = Checkpointer(pathlib.Path(tempfile.mkdtemp()), keep_last=2)
>>> for step in (5, 10, 15):
...     _ = ckpt.save(step, shared={"weights.pt": {"w": step}}, own={"ledger.json": [step]},
...                   state={"step": step})
>>> [p.name for p in ckpt.complete()]
['step_000010', 'step_000015']
>>> loaded = ckpt.load(ckpt.latest())
>>> loaded.state, loaded.shared("weights.pt"), loaded.own("ledger.json")
({'step': 15}, {'w': 15}, [15])
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from packline.train.distributed import barrier, rank_world

PREFIX = "step_"
STATE = "state.json"

#: called as ``hook(step, file_name)`` after each file a checkpoint write completes
WriteHook = Callable[[int, str], None]
_write_hooks: list[WriteHook] = []


def add_write_hook(hook: WriteHook) -> Callable[[], None]:
    """Run ``hook(step, file_name)`` after each file written into a checkpoint; returns a
    function that removes it."""
    _write_hooks.append(hook)
    return lambda: _write_hooks.remove(hook)


def _write(path: Path, value: Any, step: int) -> None:
    if path.suffix == ".json":
        path.write_text(json.dumps(value, indent=2))
    else:
        torch.save(value, path)
    for hook in list(_write_hooks):
        hook(step, path.name)


def _read(path: Path) -> Any:
    if path.suffix == ".json":
        return json.loads(path.read_text())
    return torch.load(path, weights_only=False)


def _rank_file(name: str, rank: int) -> str:
    stem, dot, suffix = name.rpartition(".")
    return f"{stem}_rank{rank:03d}{dot}{suffix}"


@dataclass
class LoadedCheckpoint:
    """A complete checkpoint as read back by one rank."""

    path: Path
    state: dict
    rank: int

    def shared(self, name: str) -> Any:
        """A file rank 0 wrote for all ranks."""
        return _read(self.path / name)

    def own(self, name: str) -> Any:
        """The file this rank wrote under ``name``."""
        return _read(self.path / _rank_file(name, self.rank))


class Checkpointer:
    """Atomic, rank-aware checkpoints under ``root``; keeps the last ``keep_last``."""

    def __init__(self, root: Path, *, keep_last: int):
        self.root = Path(root)
        self.keep_last = keep_last
        self.rank, self.world = rank_world()

    def complete(self) -> list[Path]:
        """The complete checkpoints, oldest first."""
        if not self.root.is_dir():
            return []
        return sorted(self.root.glob(f"{PREFIX}*"))

    def latest(self) -> Path | None:
        done = self.complete()
        return done[-1] if done else None

    def save(self, step: int, *, shared: dict[str, Any], own: dict[str, Any], state: dict) -> Path:
        """Write checkpoint ``step``: this rank's ``own`` files, rank 0's ``shared`` files
        and ``state`` (every rank calls this; ``shared`` is used on rank 0 only)."""
        final = self.root / f"{PREFIX}{step:06d}"
        tmp = self.root / f".tmp-{PREFIX}{step:06d}"
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        barrier()
        for name, value in own.items():
            _write(tmp / _rank_file(name, self.rank), value, step)
        barrier()
        if self.rank == 0:
            for name, value in shared.items():
                _write(tmp / name, value, step)
            _write(tmp / STATE, {**state, "world_size": self.world}, step)
            os.replace(tmp, final)
            for old in self.complete()[: -self.keep_last]:
                shutil.rmtree(old, ignore_errors=True)
        barrier()
        return final

    def load(self, path: Path) -> LoadedCheckpoint:
        """Read ``path``'s state; raises ``ValueError`` if another number of ranks wrote it
        (the loader state is per rank)."""
        state = _read(path / STATE)
        written_by = state.pop("world_size")
        if written_by != self.world:
            raise ValueError(
                f"{path} was written by {written_by} ranks, this run has {self.world}: "
                "the loader state is per rank"
            )
        return LoadedCheckpoint(path=path, state=state, rank=self.rank)
