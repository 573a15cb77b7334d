"""The processes started under this one, watched: their pids, their summed RSS polled in a
thread (:class:`WorkerRss`), and a wait until they have exited (:func:`wait_for_exit`). The
loader measurement uses them on its workers."""

from __future__ import annotations

import threading

import psutil

MIB = 2**20


def child_pids() -> set[int]:
    """The pids of every process under this one (children, grandchildren, ...)."""
    return {c.pid for c in psutil.Process().children(recursive=True)}


def wait_for_exit(baseline: set[int], *, timeout_s: float = 30.0) -> None:
    """Wait until every process started under this one since ``baseline`` (pids, from
    :func:`child_pids`) has exited; RuntimeError naming those still running after
    ``timeout_s``.

    >>> wait_for_exit(child_pids(), timeout_s=0)  # nothing started since: returns at once
    """
    new = [c for c in psutil.Process().children(recursive=True) if c.pid not in baseline]
    _, alive = psutil.wait_procs(new, timeout=timeout_s)
    if alive:
        pids = sorted(p.pid for p in alive)
        raise RuntimeError(f"processes {pids} still run {timeout_s:g} s after their loader ended")


class WorkerRss:
    """RSS of the processes started under this one after ``__enter__`` (the loader's
    workers), polled every ``interval_s`` in a thread; ``peak_mb`` is the highest sum,
    ``start_mb`` the first one seen (a forked worker starts with its parent's pages) and
    ``pids`` every such process seen."""

    def __init__(self, interval_s: float = 0.05):
        self.interval_s = interval_s
        self.peak_mb = 0.0
        self.start_mb: float | None = None
        self.pids: set[int] = set()
        self._me = psutil.Process()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._baseline: set[int] = set()
        self._lock = threading.Lock()

    def __enter__(self) -> WorkerRss:
        self._baseline = child_pids()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def sample(self) -> float:
        """Current RSS of the new children, MiB (also folded into ``peak_mb``)."""
        rss = 0
        with self._lock:  # the polling thread and the caller
            for child in self._me.children(recursive=True):
                if child.pid in self._baseline:
                    continue
                try:
                    rss += child.memory_info().rss
                except psutil.NoSuchProcess:
                    continue
                self.pids.add(child.pid)
            if rss and self.start_mb is None:
                self.start_mb = rss / MIB
            self.peak_mb = max(self.peak_mb, rss / MIB)
        return rss / MIB

    def _poll(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()
