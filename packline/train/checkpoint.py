"""Checkpoints of a training run, through torch's own ``torch.distributed.checkpoint`` (DCP):
``<run_dir>/checkpoints/step_NNNNNN/`` (DCP's ``.metadata`` and one ``__R_0.distcp`` per
rank that wrote something).

A checkpoint is layout-free: every value is saved under a name that means the same thing
on any layout, so a run saved by 2 data-parallel ranks, or with its experts split 2 ways, or
its layers over 2 pipeline stages, loads on one process (and the other way round), each
rank reading only what it holds:

- the adapters by their one-process PEFT names (:class:`AdapterState`), an expert factor
  split by expert (``<name>@expert003``), so an EP rank writes and reads its own experts'
  slices and a one-process run all of them;
- AdamW's state the same way, per parameter and field (:class:`OptimizerState`:
  ``<name>:exp_avg``, ``<name>@expert003:exp_avg_sq``, ``<name>:step``), and its param
  groups' hyper-parameters;
- every other state as one pickled value (:class:`Pickled`, a :class:`Stateful` over an
  object's own state and restore): the scheduler, the run's step, counters and layout,
  each data-parallel index's stream (Energon's loader state, the ledger, what it trained)
  and each rank's RNG.

Copies of one value on several ranks (a replicated adapter, an expert slice held twice) are
written once (DCP's own de-duplication). The trainer (:meth:`Trainer.save_checkpoint
<packline.train.trainer.Trainer.save_checkpoint>`) says what goes in.

A checkpoint is written to ``.tmp-step_NNNNNN`` and renamed into place once DCP has
committed its metadata, so a crash mid-write leaves the previous checkpoint intact (and
the torn one aside); the last ``keep_last`` are kept. :func:`add_write_hook` lets a caller
run code after each file of a write (the resume tests SIGKILL the process there, before
the metadata); nothing runs by default.

>>> import tempfile, pathlib
>>> ckpt = Checkpointer(pathlib.Path(tempfile.mkdtemp()), keep_last=2)
>>> for step in (5, 10, 15):
...     run = Pickled(lambda: {"step": step}, print)
...     _ = ckpt.save(step, {"w": torch.full((2,), float(step)), "run": run})
>>> [p.name for p in ckpt.complete()]
['step_000010', 'step_000015']
>>> state = {"w": torch.zeros(2)}
>>> ckpt.load(ckpt.latest(), state)
>>> state["w"].tolist(), ckpt.read(ckpt.latest(), "run")
([15.0, 15.0], {'run': {'step': 15}})
"""

from __future__ import annotations

import os
import pickle
import shutil
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.stateful import Stateful

from packline.train.distributed import barrier, rank_world
from packline.train.expert_parallel import expert_factor_slices, expert_views

PREFIX = "step_"
METADATA = ".metadata"

#: called as ``hook(step, file_name)`` after each file a checkpoint write completes
WriteHook = Callable[[int, str], None]
_write_hooks: list[WriteHook] = []


def add_write_hook(hook: WriteHook) -> Callable[[], None]:
    """Run ``hook(step, file_name)`` after each file written into a checkpoint (the data
    files, then ``.metadata``); returns a function that removes it."""
    _write_hooks.append(hook)
    return lambda: _write_hooks.remove(hook)


def _fire(step: int, name: str) -> None:
    for hook in list(_write_hooks):
        hook(step, name)


def blob(value: Any) -> bytes:
    """``value`` as one checkpoint value (DCP would otherwise flatten a dict into leaves)."""
    return pickle.dumps(value)


def unblob(data: bytes) -> Any:
    return pickle.loads(data)


class Pickled(Stateful):
    """A :class:`Stateful` over any object's own ``state()`` / ``restore(state)`` pair (the
    scheduler's ``state_dict``, the stream's loader state, the RNG), saved as one pickled
    value ``<name>.state``: layout-free by construction, one per rank where the name says
    so.

    >>> box = {"n": 1}
    >>> p = Pickled(lambda: dict(box), box.update)
    >>> p.load_state_dict({"state": blob({"n": 2})}); box
    {'n': 2}
    """

    KEY = "state"

    def __init__(self, state: Callable[[], Any], restore: Callable[[Any], Any]):
        self._state, self._restore = state, restore

    def state_dict(self) -> dict[str, bytes]:
        return {self.KEY: blob(self._state())}

    def load_state_dict(self, state: dict[str, bytes]) -> None:
        self._restore(unblob(state[self.KEY]))


class _Writer(FileSystemWriter):
    """DCP's file writer, calling the write hooks on the coordinator: each data file before
    the metadata is committed, then the metadata."""

    def __init__(self, path: Path, step: int):
        super().__init__(path)
        self.step = step

    def finish(self, metadata, results) -> None:
        for name in sorted(p.name for p in Path(self.path).glob("*.distcp")):
            _fire(self.step, name)
        super().finish(metadata, results)
        _fire(self.step, METADATA)


@contextmanager
def _single_process_quiet() -> Iterator[None]:
    """DCP warns on every call without a process group that it assumes one process: it is."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


class Checkpointer:
    """Atomic DCP checkpoints under ``root``; keeps the last ``keep_last``. Every rank calls
    :meth:`save`, :meth:`load` and :meth:`read` together (they are collectives)."""

    def __init__(self, root: Path, *, keep_last: int):
        self.root = Path(root)
        self.keep_last = keep_last
        self.rank, self.world = rank_world()

    def complete(self) -> list[Path]:
        """The complete checkpoints, oldest first."""
        if not self.root.is_dir():
            return []
        # (a step dir without DCP's metadata is an older packline's: not resumable)
        return sorted(p for p in self.root.glob(f"{PREFIX}*") if (p / METADATA).is_file())

    def latest(self) -> Path | None:
        done = self.complete()
        return done[-1] if done else None

    def save(self, step: int, state: dict[str, Any]) -> Path:
        """Write checkpoint ``step`` of ``state`` (tensors and :class:`Stateful` objects;
        each rank its own, copies written once)."""
        final = self.root / f"{PREFIX}{step:06d}"
        tmp = self.root / f".tmp-{PREFIX}{step:06d}"
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        barrier()
        with _single_process_quiet():
            dcp.save(state, storage_writer=_Writer(tmp, step))
        if self.rank == 0:
            os.replace(tmp, final)
            for old in self.complete()[: -self.keep_last]:
                shutil.rmtree(old, ignore_errors=True)
        barrier()
        return final

    def names(self, path: Path) -> dict[str, Any]:
        """Every value ``path`` holds: ``{name: DCP's storage metadata}`` (a tensor's has
        ``size`` and ``properties.dtype``)."""
        return dict(FileSystemReader(path).read_metadata().state_dict_metadata)

    def load(self, path: Path, state: dict[str, Any]) -> None:
        """Load ``path`` into ``state`` in place (its tensors, then each :class:`Stateful`'s
        ``load_state_dict``); every name in ``state`` must be in the checkpoint."""
        with _single_process_quiet():
            dcp.load(state, checkpoint_id=path)

    def read(self, path: Path, *names: str) -> dict[str, Any]:
        """The :class:`Pickled` states saved as ``names`` in ``path``."""
        out: dict[str, Any] = {}
        self.load(path, {n: Pickled(lambda: None, partial(out.__setitem__, n)) for n in names})
        return out


# -- the trainable state, layout-free ------------------------------------------------------------


class _Held:
    """The trainable parameters this rank holds and how each is saved: a dense one under
    its own name, an expert factor as its experts' slices, ``<name>@expertNNN``."""

    def __init__(self, model):
        slices = expert_factor_slices(model)
        self.params = {n: p for n, p in model.named_parameters() if p.requires_grad}
        self.slices = {n: slices.get(n) for n in self.params}

    def views(self, name: str, t: torch.Tensor) -> dict[str, torch.Tensor]:
        """``t`` (shaped like parameter ``name``) by saved name: views of it."""
        info = self.slices[name]
        if info is None:
            return {name: t}
        return {f"{name}@expert{e:03d}": v for e, v in expert_views(t, *info).items()}

    def names(self, name: str) -> set[str]:
        """The prefixes of what parameter ``name`` saves (its own name, its slices')."""
        return {name, *self.views(name, self.params[name].detach())}


class AdapterState(Stateful):
    """The trainable weights this rank holds, by layout-free names (module docstring)."""

    def __init__(self, model):
        self.held = _Held(model)

    def state_dict(self) -> dict[str, torch.Tensor]:
        h = self.held
        return {
            k: v.clone() for n, p in h.params.items() for k, v in h.views(n, p.detach()).items()
        }

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        h = self.held
        with torch.no_grad():
            for n, p in h.params.items():
                for key, view in h.views(n, p.detach()).items():
                    view.copy_(state[key])


def _placed_like(p: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """``value`` (whole, on the CPU) where parameter ``p`` lives: on its device, and split
    like it when ``p`` is an FSDP2 shard (a DTensor: this rank keeps its part)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    value = value.to(p.device)
    if isinstance(p, DTensor):
        return distribute_tensor(value, p.device_mesh, p.placements, src_data_rank=None)
    return value


class OptimizerState(Stateful):
    """The optimizer's per-parameter state (AdamW's ``exp_avg``, ``exp_avg_sq`` split like
    the weights, ``step`` per parameter) for the weights this rank holds, by layout-free
    names, and its param groups' hyper-parameters. ``saved`` (:meth:`Checkpointer.names`
    of the checkpoint to load) tells a fresh optimizer, which has no state yet, what to
    load into."""

    GROUPS = "param_groups"

    def __init__(self, model, optimizer: torch.optim.Optimizer, saved: dict | None = None):
        self.held = _Held(model)
        self.optimizer = optimizer
        prefix = "optimizer."
        self.saved = {k[len(prefix) :]: v for k, v in (saved or {}).items() if k.startswith(prefix)}

    def state_dict(self) -> dict[str, Any]:
        groups = [
            {k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups
        ]
        out: dict[str, Any] = {self.GROUPS: blob(groups)}
        h = self.held
        if self.saved:  # loading: a target of the saved size for each value this rank holds
            mine = {prefix for n in h.params for prefix in h.names(n)}
            for key, meta in self.saved.items():
                if key.partition(":")[0] in mine and isinstance(meta, TensorStorageMetadata):
                    out[key] = torch.empty(meta.size, dtype=meta.properties.dtype)
            return out
        for name, p in h.params.items():
            for field, value in self.optimizer.state.get(p, {}).items():
                if torch.is_tensor(value) and value.shape == p.shape:
                    for key, view in h.views(name, value).items():
                        out[f"{key}:{field}"] = view.clone()
                else:  # a per-parameter scalar (AdamW's step)
                    out[f"{name}:{field}"] = value.clone() if torch.is_tensor(value) else value
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved_groups = unblob(state[self.GROUPS])
        for group, saved in zip(self.optimizer.param_groups, saved_groups, strict=True):
            group.update(saved)
        h = self.held
        for name, p in h.params.items():
            prefixes = h.names(name)
            fields = {k.partition(":")[2] for k in state if k.partition(":")[0] in prefixes}
            st: dict[str, Any] = {}
            for field in sorted(fields):
                scalar = state.get(f"{name}:{field}")
                if scalar is not None and not (torch.is_tensor(scalar) and scalar.shape == p.shape):
                    st[field] = scalar
                    continue
                value = torch.zeros(p.shape, dtype=p.dtype)  # whole, as saved
                for key, view in h.views(name, value).items():
                    view.copy_(state[f"{key}:{field}"])
                st[field] = _placed_like(p, value)
            if st:
                self.optimizer.state[p] = st
