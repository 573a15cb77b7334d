"""An ordered, bounded map over worker processes: the stages' way to spread row work over
cores without holding a dataset in memory.

:func:`ordered_map` runs ``fn`` on each item of an iterator in ``num_workers`` processes
and yields the results in the items' order, with at most ``window`` items submitted and
not yet yielded: the input is read as the output is consumed, so memory stays bounded
whatever the dataset's size. One worker, or a single item, runs ``fn`` in the calling
process (no pool: starting one costs seconds).
Because the results come back in order and are consumed by one process, what the caller
writes from them is the same for any worker count.

Workers start from a fresh interpreter (``forkserver``: the caller may hold threads, a
progress bar's among them, which ``fork`` would copy mid-lock); ``initializer(*initargs)``
runs once in each, to set up what every item needs (a processor, limits) without pickling it
per item. Each worker watches the process that started it (:func:`exit_with`): when that one
is killed (SIGKILL runs no cleanup), the workers exit within a second instead of waiting
for work for ever, and their fork server ends with it too (:mod:`packline.dies_with_parent`).
:func:`forks_exit_with_me` does the same for every process forked from
this one later (Energon's and torch's loader workers: torch's own check of its parent misses
a parent killed while the worker starts).

    >>> list(ordered_map(abs, iter([-3, 1, -2]), num_workers=1))
    [3, 1, 2]
"""

from __future__ import annotations

import itertools
import multiprocessing
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")
R = TypeVar("R")


def ordered_map(
    fn: Callable[[T], R],
    items: Iterable[T],
    *,
    num_workers: int,
    window: int | None = None,
    initializer: Callable[..., None] | None = None,
    initargs: tuple[Any, ...] = (),
    preload: tuple[str, ...] = (),
) -> Iterator[R]:
    """``fn(item)`` for each item, in order, over ``num_workers`` processes with at most
    ``window`` items in flight (default ``2 × num_workers``); ``fn``, the items and the
    results must pickle when ``num_workers > 1``. ``preload``: modules the fork server
    imports once before it forks the workers (heavy imports, e.g. the module of ``fn``, then
    cost one import instead of one per worker)."""
    if num_workers < 1:
        raise ValueError(f"num_workers must be >= 1, got {num_workers}")
    items = iter(items)
    head = list(itertools.islice(items, 2))
    if num_workers == 1 or len(head) < 2:  # one item: a pool (seconds to start) buys nothing
        if initializer is not None:
            initializer(*initargs)
        yield from map(fn, itertools.chain(head, items))
        return
    items = itertools.chain(head, items)
    window = window or 2 * num_workers
    context = multiprocessing.get_context("forkserver")
    # the fork server ends with this process (Linux): it is the workers' parent, not this one
    context.set_forkserver_preload(["packline.dies_with_parent", *preload])
    with ProcessPoolExecutor(
        max_workers=num_workers,
        mp_context=context,
        initializer=_start_worker,
        initargs=(os.getpid(), initializer, initargs),
    ) as pool:
        pending: deque[Future] = deque()
        try:
            for item in items:
                pending.append(pool.submit(fn, item))
                if len(pending) >= window:
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()
        finally:
            for future in pending:
                future.cancel()


def _start_worker(
    owner: int, initializer: Callable[..., None] | None, initargs: tuple[Any, ...]
) -> None:
    exit_with(owner)
    if initializer is not None:
        initializer(*initargs)


def exit_with(owner: int, interval_s: float = 0.5) -> None:
    """Exit this process (``os._exit``) within ``interval_s`` of process ``owner``'s end: a
    daemon thread checks it, by pid and start time (a reused pid is another process) and
    state (a killed process its parent has not reaped yet is a zombie: ended)."""
    import psutil

    try:
        process = psutil.Process(owner)
    except psutil.NoSuchProcess:
        os._exit(1)

    def ended() -> bool:
        try:
            return not process.is_running() or process.status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True

    def watch() -> None:
        while not ended():
            time.sleep(interval_s)
        os._exit(1)

    threading.Thread(target=watch, name=f"exit-with-{owner}", daemon=True).start()


_FORK_OWNER: int | None = None


def forks_exit_with_me() -> None:
    """Make every process forked from this one from now on (``os.fork``, multiprocessing's
    ``fork``, torch's DataLoader workers; not ``subprocess``, which execs) exit with this
    one (:func:`exit_with`); idempotent."""
    global _FORK_OWNER
    if _FORK_OWNER is not None:
        return
    _FORK_OWNER = owner = os.getpid()
    os.register_at_fork(after_in_child=lambda: exit_with(owner))
