"""connect's parts: each task's share of the samples, measured in parts a killed run resumes
from, and the one merge of them all.

A connect task is rank r of N (:class:`Task`): it measures Energon's rank-r share of every
split and, after every ``connect.part_size`` samples, writes a part: its records, then its
state (the split and the loader's ``save_state_rank()`` after the part's last sample). A
rerun restores the state of its last finished part and continues; finished parts are never
measured again. The parts live outside the stage dir, so that a kill loses none::

    <work>/connect.parts/<fingerprint[:16]>/
        processor/                       materialized once (tasks race; the first rename wins)
        tasks<N>-workers<W>-verify<V>/   one layout: a part of another is never read
            task<r>-part<k>.parquet      the part's records (written first)
            task<r>-part<k>.state        its state: a part is finished once this exists
            task<r>.done                 the task has measured its whole share
            merge.<attempt>.lock         the task that merges: O_CREAT | O_EXCL, one winner

Every file is written to a temp name and renamed into place. The task that writes the last
``.done`` of this attempt (SLURM job and restart, or local process) sees every task's and
takes the lock; it merges and removes the fingerprint's dir.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import pandas as pd

from schemas.config import PipelineConfig
from schemas.errors import UserError

PARTS = "connect.parts"
#: columns of a part's records: the table's columns come from ``exact``, which holds the
#: cheap rule's record where the processor did not run (``verified`` false)
PART_COLUMNS = [
    "key",
    "split",
    "verified",
    "exact",
    "cheap",
    "image_grids",
    "images_moved",
    "video_grids",
    "video_frame_counts",
    "bridge_videos",
]


class Task(NamedTuple):
    """One connect task: Energon's ``WorkerConfig(rank=rank, world_size=world)`` share."""

    rank: int
    world: int


def current_task(num_tasks: int, *, slurm: bool) -> Task | None:
    """This process's connect task when it is one of several tasks of a SLURM job step
    (``slurm``: ``executor.kind: slurm``; ``SLURM_PROCID`` of ``SLURM_NTASKS``, which must
    equal ``num_tasks``, ``connect.num_tasks``); None when it is alone (executor local,
    ``packline stage connect`` outside a job, a one-task job), and then measures every task's
    share in turn."""
    if not slurm or "SLURM_PROCID" not in os.environ:
        return None
    ntasks = int(os.environ.get("SLURM_NTASKS", "1"))
    if ntasks == 1:
        return None
    if ntasks != num_tasks:
        raise UserError(
            [
                f"this SLURM job step runs {ntasks} tasks, connect.num_tasks is "
                f"{num_tasks}: set connect.num_tasks={ntasks}, or start connect "
                "as one task (it then measures every share in turn)"
            ],
            "connect cannot tell its share",
        )
    return Task(int(os.environ["SLURM_PROCID"]), ntasks)


def attempt_id() -> str:
    """What tells this run of connect from an earlier, killed one: the SLURM job and its
    restart count, or this host and process."""
    if job := os.environ.get("SLURM_JOB_ID"):
        return f"slurm-{job}-{os.environ.get('SLURM_RESTART_COUNT', '0')}"
    return f"{socket.gethostname()}-{os.getpid()}-{time.time_ns()}"


@dataclass(frozen=True)
class PartState:
    """Where a task stands after one of its parts."""

    split: str
    """The split the part's samples come from (a part never spans two)."""
    samples: int
    """Samples in the part."""
    split_done: bool
    """The part closes the task's share of ``split``."""
    loader: Any
    """The loader's ``save_state_rank()`` after the part (None once ``split_done``)."""


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


class PartsDir:
    """The parts of one fingerprint and one layout (task count, loader workers, verify)."""

    def __init__(self, cfg: PipelineConfig, fingerprint: str):
        c = cfg.connect
        self.root = cfg.work_path / PARTS / fingerprint[:16]
        self.dir = self.root / f"tasks{c.num_tasks}-workers{c.num_workers}-verify{c.verify}"
        self.world = c.num_tasks

    @property
    def processor(self) -> Path:
        return self.root / "processor"

    def materialize(self, build) -> Path:
        """The processor dir, built by ``build(out)`` (which writes ``out/processor``) unless
        a task already did: built in a temp dir and renamed into place, and a task that
        loses the race drops its own (the content is the same)."""
        if self.processor.is_dir():
            return self.processor
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.root / f".tmp-processor-{os.getpid()}-{time.time_ns()}"
        try:
            built = build(tmp)
            try:
                os.rename(built, self.processor)
            except OSError:
                if not self.processor.is_dir():
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return self.processor

    def task(self, rank: int) -> TaskParts:
        return TaskParts(self.dir, Task(rank, self.world))

    def all_done(self) -> bool:
        return all(self.task(r).is_done() for r in range(self.world))

    def take_merge(self, attempt: str) -> bool:
        """True for exactly one task of ``attempt`` once every task is done: the one whose
        ``O_CREAT | O_EXCL`` creates the lock (a lock of an earlier, killed attempt is no
        obstacle)."""
        if not self.all_done():
            return False
        try:
            fd = os.open(self.dir / f"merge.{attempt}.lock", os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except (FileExistsError, FileNotFoundError):
            return False
        os.close(fd)
        return True

    def records(self) -> pd.DataFrame:
        """Every task's finished parts, concatenated."""
        frames = [
            pd.read_parquet(path) for r in range(self.world) for path, _ in self.task(r).finished()
        ]
        return (
            pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=PART_COLUMNS)
        )

    def done_info(self) -> list[dict[str, Any]]:
        """Each task's ``.done`` record, by rank."""
        return [self.task(r).done_info() for r in range(self.world)]

    def remove(self) -> None:
        """Drop the fingerprint's parts (after the merge, or when they disagree)."""
        shutil.rmtree(self.root, ignore_errors=True)
        try:
            self.root.parent.rmdir()  # connect.parts, when no other fingerprint has parts
        except OSError:
            pass


class TaskParts:
    """One task's part files."""

    def __init__(self, layout: Path, task: Task):
        self.dir = layout
        self.task = task

    def _name(self, k: int, suffix: str) -> Path:
        return self.dir / f"task{self.task.rank:03d}-part{k:05d}.{suffix}"

    @property
    def done_path(self) -> Path:
        return self.dir / f"task{self.task.rank:03d}.done"

    def is_done(self) -> bool:
        return self.done_path.is_file()

    def done_info(self) -> dict[str, Any]:
        return json.loads(self.done_path.read_text())

    def finished(self) -> list[tuple[Path, PartState]]:
        """The parts finished in order (records and state written), from part 0 up to the
        first one missing; a torn or later file is never read."""
        out = []
        k = 0
        while (state := self._name(k, "state")).is_file() and self._name(k, "parquet").is_file():
            out.append((self._name(k, "parquet"), pickle.loads(state.read_bytes())))
            k += 1
        return out

    def clean(self) -> list[tuple[Path, PartState]]:
        """:meth:`finished`, after removing what a kill left beyond it (temp files, a part's
        records without its state)."""
        done = self.finished()
        keep = {p for path, _ in done for p in (path, path.with_suffix(".state"))}
        prefix = f"task{self.task.rank:03d}-part"
        for path in self.dir.glob(f"*{prefix}*"):
            if path not in keep:
                path.unlink(missing_ok=True)
        return done

    def write(self, k: int, records: list[dict[str, Any]], state: PartState) -> None:
        """Part ``k``: its records, then its state (the part counts once the state exists)."""
        self.dir.mkdir(parents=True, exist_ok=True)
        frame = pd.DataFrame(records, columns=PART_COLUMNS)
        tmp = self._name(k, "parquet").with_name(f".{self._name(k, 'parquet').name}.tmp")
        frame.to_parquet(tmp, index=False)
        os.replace(tmp, self._name(k, "parquet"))
        _write_atomic(self._name(k, "state"), pickle.dumps(state))

    def mark_done(self, info: dict[str, Any]) -> None:
        _write_atomic(self.done_path, json.dumps(info, indent=2).encode())
