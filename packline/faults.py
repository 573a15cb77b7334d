"""Faults of the machine, as reasons a user can act on.

A full disk, a read-only mount, a permission the user lacks, a path that is a file where a
dir must be: none is a bug of packline, and none is fixed by reading a traceback. Wherever
one surfaces (a stage, the CLI of any command), :func:`machine_fault` turns it into a
:class:`~schemas.errors.UserError` (exit 2) naming the path and what to do. The exception may
be wrapped (a SQLAlchemy error around sqlite's, a ``RuntimeError`` around an ``OSError``):
the whole chain is searched.

What a stage had written when its device filled is measured by :func:`discard_partial`,
which removes the partial output (nothing half-published stays) after noting its size on the
exception; with the stage's progress (:func:`packline.progress.last_fraction`) the message
says about how much the stage needs.

    >>> import errno
    >>> fault = machine_fault(OSError(errno.EROFS, "Read-only file system", "/w/prepare"))
    >>> for part in fault.problems[0].split("; "):
    ...     print(part)
    cannot write /w/prepare: its file system is mounted read-only
    fix: choose a work_dir on a writable file system, or remount it read-write
    >>> machine_fault(ValueError("a bug")) is None
    True
"""

from __future__ import annotations

import errno
import os
import shutil
import sqlite3
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from schemas.errors import UserError
from schemas.paths import nearest_existing, user_name

#: errno of a device out of room (blocks or a quota)
NO_SPACE = {errno.ENOSPC, errno.EDQUOT}
#: sqlite's own words for the same faults (it raises sqlite3.OperationalError, not OSError)
SQLITE_FAULTS = {
    "database or disk is full": errno.ENOSPC,
    "attempt to write a readonly database": errno.EROFS,
    "unable to open database file": errno.EACCES,
    "disk i/o error": errno.EIO,
}
WRITTEN = "packline_written"
"""The attribute :func:`discard_partial` sets on a no-space error: bytes of the partial
output it removed."""


def _chain(exc: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__  # type: ignore[assignment]


def fault_errno(exc: BaseException) -> tuple[int, BaseException] | None:
    """The errno of the machine fault in ``exc``'s chain and the exception holding it, or
    None (an ``OSError`` of a kind listed in :data:`REASONS`, or sqlite's words for one)."""
    for e in _chain(exc):
        if isinstance(e, OSError) and e.errno in REASONS:
            return e.errno, e
        if isinstance(e, sqlite3.OperationalError):
            text = str(e).lower()
            for words, code in SQLITE_FAULTS.items():
                if words in text:
                    return code, e
    return None


def _size(path: Path) -> int:
    """Bytes ``path`` takes on its device (allocated blocks: what a full disk counts)."""
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(Path(root) / name).st_blocks * 512
            except OSError:
                continue
    return total


def discard_partial(tmp: Path, exc: BaseException) -> None:
    """Remove ``tmp`` (a stage's partial output), first noting its size on ``exc`` when
    ``exc`` is a device out of room (see :data:`WRITTEN`)."""
    found = fault_errno(exc)
    if found is not None and found[0] in NO_SPACE and Path(tmp).is_dir():
        setattr(found[1], WRITTEN, getattr(found[1], WRITTEN, 0) + _size(Path(tmp)))
    shutil.rmtree(tmp, ignore_errors=True)


def _mb(n: float) -> str:
    return f"{n / 1e6:,.1f} MB"


def _no_space(path: Path, exc: BaseException, stage: str | None) -> str:
    from packline.progress import last_fraction

    usage = shutil.disk_usage(nearest_existing(path))
    where = f"no space left on the device holding {path}"
    written = getattr(exc, WRITTEN, None)
    if not written:
        return (
            f"{where} ({_mb(usage.free)} free of {_mb(usage.total)}); fix: free space there, "
            "or choose a work_dir on a larger device, and run again"
        )
    who = stage or "the stage"
    done = last_fraction()
    if done is None or done[0] < 0.02:
        return (
            f"{where}: {who} had written {_mb(written)} when it filled, and {_mb(usage.free)} "
            f"is free now that the partial output is removed; fix: free more than "
            f"{_mb(written)} there (the outputs need more than that), or choose a work_dir "
            "on a larger device, and run again"
        )
    fraction, task = done
    needs = written / fraction
    return (
        f"{where}: {who} had written {_mb(written)} when it filled, {fraction:.0%} of the way "
        f"through {task!r}: that step alone needs about {_mb(needs)}, and {_mb(usage.free)} "
        f"is free now that the partial output is removed; fix: free at least "
        f"{_mb(max(needs - usage.free, 1e5))} more there (the stage's later steps need room "
        "too), or choose a work_dir on a larger device, and run again"
    )


def _is_under(path: Path, root: Path | None) -> bool:
    return root is not None and Path(os.path.abspath(path)).is_relative_to(os.path.abspath(root))


REASONS = {
    errno.ENOSPC: "no space",
    errno.EDQUOT: "no space",
    errno.EROFS: "read-only",
    errno.EACCES: "permission",
    errno.EPERM: "permission",
    errno.ENOTDIR: "not a dir",
    errno.EISDIR: "a dir",
    errno.EIO: "i/o",
    errno.ELOOP: "loop",
    errno.EMFILE: "files",
    errno.ENFILE: "files",
    errno.ENAMETOOLONG: "name",
}
"""The errno packline reports as a fault of the machine (each has its message below)."""


def machine_fault(
    exc: BaseException, work: Path | None = None, *, stage: str | None = None
) -> UserError | None:
    """``exc`` as a reason with its path and fix when its chain holds a fault of the
    machine (:data:`REASONS`), else None. ``work``: the work dir (where packline writes;
    a path outside it is one of the user's inputs, read), ``stage``: who ran out of room."""
    found = fault_errno(exc)
    if found is None:
        return None
    code, cause = found
    name = getattr(cause, "filename", None)
    path = Path(name) if name else (Path(work) if work is not None else Path.cwd())
    ours = name is None or _is_under(path, work)
    kind = REASONS[code]
    if isinstance(cause, sqlite3.OperationalError) and kind != "no space":
        store = Path(work) / "mlflow.db" if work is not None else Path("mlflow.db")
        problem = (
            f"the MLflow store {store} cannot be written (sqlite says: {cause}); fix: make "
            "it and its dir writable for this user, on a writable file system (or, if it was "
            "replaced while open, run the command again)"
        )
    elif kind == "no space":
        problem = _no_space(path if not name or work is None else Path(work), cause, stage)
    elif kind == "read-only":
        problem = (
            f"cannot write {path}: its file system is mounted read-only; fix: choose a "
            "work_dir on a writable file system, or remount it read-write"
        )
    elif kind == "permission" and ours:
        problem = (
            f"permission denied writing {path} (as {user_name()}); fix: make the work dir "
            "writable for this user (chmod/chown), or choose another work_dir"
        )
    elif kind == "permission":
        problem = (
            f"permission denied reading {path} (as {user_name()}); fix: make it readable for "
            "this user (chmod/chown), or point the config elsewhere"
        )
    elif kind == "not a dir":
        blocker = nearest_existing(path)
        problem = (
            f"cannot use {path} as a directory: {blocker} is a file; fix: move that file "
            "away, or choose another work_dir"
        )
    elif kind == "a dir":
        problem = f"{path} is a directory where packline expects a file; fix: move it away"
    elif kind == "i/o":
        problem = (
            f"{'writing' if ours else 'reading'} {path} failed with an input/output error "
            "(its device or file system refused it); fix: check the device (dmesg), or copy "
            "the file to a healthy one"
        )
    elif kind == "loop":
        problem = f"{path} is a loop of symbolic links; fix: point the link at a real file or dir"
    elif kind == "files":
        problem = (
            f"too many open files opening {path}; fix: raise the limit (ulimit -n), or "
            "lower prepare.num_workers / connect.num_workers"
        )
    else:
        problem = f"{path}: the file name is too long for its file system; fix: shorten it"
    return UserError([problem], "a fault of the machine, not of packline")


@contextmanager
def quiet_thread_faults() -> Iterator[None]:
    """While inside, a fault of the machine that ends a background thread is one line on
    stderr, not a traceback; any other exception in a thread is reported as Python does.

    NeMo-Run's local executor copies each task's output to a log file from a thread of its
    own (torchx's ``Tee``). When the work dir's device fills, that thread's write fails
    with ENOSPC, and Python would print its traceback beside the stage's own reason.

        >>> def fill():
        ...     raise OSError(errno.ENOSPC, "No space left on device", "/w/log.out")
        >>> from contextlib import redirect_stderr
        >>> with quiet_thread_faults(), redirect_stderr(sys.stdout):
        ...     t = threading.Thread(target=fill, name="tee")
        ...     t.start()
        ...     t.join()
        note: background thread 'tee' stopped: No space left on device: /w/log.out
    """
    before = threading.excepthook

    def hook(args: threading.ExceptHookArgs) -> None:
        found = fault_errno(args.exc_value) if args.exc_value is not None else None
        if found is None:
            before(args)
            return
        cause = found[1]
        what = getattr(cause, "strerror", None) or str(cause)
        name = getattr(cause, "filename", None)
        where = f": {name}" if name else ""
        thread = args.thread.name if args.thread is not None else "?"
        print(f"note: background thread {thread!r} stopped: {what}{where}", file=sys.stderr)

    threading.excepthook = hook
    try:
        yield
    finally:
        threading.excepthook = before
