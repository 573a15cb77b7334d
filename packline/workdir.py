"""A work dir belongs to one writer at a time, and packline removes only what it made.

**Ownership.** Every dir packline may later replace or remove (a stage's output, the
built-in set's copy, a temp dir) carries :data:`MARKER`, written when packline creates it.
:func:`remove_owned` and :func:`publish` refuse a dir without it, so a user's folder that
happens to sit where a stage publishes is never deleted: the run stops with exit 2 and says
what to move. (A stage dir an older packline completed carries its completion record
instead, which counts too.)

**One writer.** :func:`hold` takes an advisory lock (``flock``) on
``<work>/.packline.lock`` for the duration of a stage or a pipeline run, and writes the
holder's pid, host and command into it. A second invocation on the same work dir stops with
exit 2 naming the holder (or waits, ``wait=True``). The kernel drops the lock when its holder
dies, so a lock left by a killed process is taken over, with a warning naming it. The
processes a holder starts (NeMo-Run's stage tasks, SLURM tasks, torchrun ranks) inherit the
holder's token through :data:`LOCK_ENV` and work under its lock. The first holder removes the
temp dirs a killed run left (:func:`remove_stale_temps`): while it holds the lock no other
writer exists, so every one of them is stale.

    >>> import tempfile
    >>> work = Path(tempfile.mkdtemp())
    >>> with hold(work, command="doctest"):
    ...     holder(work)["command"]
    'doctest'
    >>> tmp = new_temp_dir(work, ".tmp-prepare-")
    >>> publish(tmp, work / "prepare")
    >>> is_owned(work / "prepare")
    True
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import secrets
import shlex
import shutil
import socket
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from packline.catalog import RECORD_NAME
from schemas.errors import UserError

MARKER = ".packline-owned"
"""The file in every dir packline made and may replace or remove."""
LOCK_NAME = ".packline.lock"
LOCK_ENV = "PACKLINE_WORK_LOCK"
"""``<work dir>=<token>`` of the lock this process works under (set by its holder)."""
#: The temp dirs packline makes inside a work dir and its subdirs.
TEMP_RE = re.compile(r"\.(tmp|old)-.+")


# --- what packline made ------------------------------------------------------------------


def mark_owned(path: Path, what: str) -> None:
    """Write :data:`MARKER` into dir ``path``: packline made it and may replace it."""
    # The same bytes every time: a stage's outputs stay byte-identical from run to run.
    (Path(path) / MARKER).write_text(json.dumps({"made_by": "packline", "what": what}) + "\n")


def is_owned(path: Path) -> bool:
    """Whether ``path`` is a dir (not a link) packline made: it carries :data:`MARKER`, or a
    completion record of an earlier packline."""
    path = Path(path)
    if path.is_symlink() or not path.is_dir():
        return False
    return (path / MARKER).is_file() or (path / RECORD_NAME).is_file()


def not_ours(path: Path) -> UserError:
    """The refusal to replace or remove ``path``, which packline did not make."""
    what = "a symbolic link" if Path(path).is_symlink() else "not made by packline"
    return UserError(
        [
            f"{path} exists and is {what} (it has no {MARKER}): packline replaces that path "
            "and will not delete it; fix: move it away, or choose another work_dir"
        ],
        "refusing to delete data packline did not create",
    )


def remove_owned(path: Path) -> None:
    """Remove dir ``path`` if packline made it; nothing when it is absent; else refuse
    (exit 2) without touching it."""
    path = Path(path)
    if not path.exists() and not path.is_symlink():
        return
    if not is_owned(path):
        raise not_ours(path)
    shutil.rmtree(path)


def claim_dir(path: Path, what: str) -> Path:
    """Dir ``path`` to write into in place: made (and marked) when absent, taken as it is
    when packline made it or it is empty; a non-empty dir packline did not make is refused
    (exit 2)."""
    path = Path(path)
    if path.is_symlink() or (path.exists() and not is_owned(path) and any(path.iterdir())):
        raise not_ours(path)
    path.mkdir(parents=True, exist_ok=True)
    if not (path / MARKER).is_file():
        mark_owned(path, what)
    return path


def new_temp_dir(parent: Path, prefix: str) -> Path:
    """A fresh dir under ``parent`` unique to this process and call (``prefix`` starts with
    ``.tmp-``), marked as packline's."""
    parent = Path(parent)
    parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # mkdtemp's 0700 would make the published dir private
    mark_owned(tmp, "temp")
    return tmp


def publish_modes(root: Path) -> None:
    """Files 0666 and dirs 0777 less the user's umask (0644 / 0755 with the usual 022), under
    and including ``root``: safetensors, transformers and tempfile write 0600 / 0700, which
    would keep a shared adapter or export private."""
    umask = os.umask(0)
    os.umask(umask)
    for dirpath, _dirs, filenames in os.walk(root):
        os.chmod(dirpath, 0o777 & ~umask)
        for name in filenames:
            os.chmod(Path(dirpath) / name, 0o666 & ~umask)


def publish(tmp: Path, final: Path) -> None:
    """Rename the whole dir ``tmp`` to ``final``, replacing an earlier ``final`` only when
    packline made it (:func:`is_owned`); ``final`` keeps the marker."""
    tmp, final = Path(tmp), Path(final)
    mark_owned(tmp, final.name)
    if not final.exists() and not final.is_symlink():
        os.replace(tmp, final)
        return
    if not is_owned(final):
        shutil.rmtree(tmp, ignore_errors=True)
        raise not_ours(final)
    old = new_temp_dir(final.parent, f".old-{final.name}-")
    os.replace(final, old / final.name)
    os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)


def remove_stale_temps(work: Path) -> list[Path]:
    """Remove the temp dirs (``.tmp-*``, ``.old-*``, marked as packline's) under ``work``
    and its first level of subdirs; call only while holding the work dir's lock."""
    work = Path(work)
    if not work.is_dir():
        return []
    removed = []
    subdirs = [
        d
        for d in work.iterdir()
        if d.is_dir() and not d.is_symlink() and not TEMP_RE.fullmatch(d.name)
    ]
    for parent in [work, *subdirs]:
        for path in list(parent.iterdir()):
            if TEMP_RE.fullmatch(path.name) and is_owned(path):
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path)
    return removed


# --- one writer per work dir ----------------------------------------------------------------


class WorkDirBusy(UserError):
    """Another process holds the work dir's lock."""


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def holder(work: Path) -> dict[str, Any]:
    """What the lock file of ``work`` says of its last holder (empty when none)."""
    try:
        return json.loads((Path(work) / LOCK_NAME).read_text() or "{}")
    except (OSError, json.JSONDecodeError):
        return {}


def _describe(info: dict[str, Any], *, held: bool = False) -> str:
    """The holder as a user reads it; ``held``: the lock is held now (if by a process the
    named one started, after it ended, say so)."""
    pid = info.get("pid")
    here = info.get("host") == socket.gethostname()
    gone = (
        ", now gone: a process it started holds the lock"
        if held and isinstance(pid, int) and here and not _pid_alive(pid)
        else ""
    )
    return (
        f"pid {pid or '?'} on {info.get('host', '?')} "
        f"(`{info.get('command', '?')}`, since {info.get('since', '?')}{gone})"
    )


def _inherited(work: Path) -> str | None:
    """The token of the lock this process was started under for ``work``, if any."""
    where, _, token = os.environ.get(LOCK_ENV, "").rpartition("=")
    return token if where == str(work) and token else None


#: flock's errors on a filesystem without locks (some cluster filesystems' mount options)
_NO_LOCKS = {errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP}

_HELD: dict[Path, int] = {}

_LOCK_FDS: set[int] = set()
"""The lock files this process has open. A forked child (a loader worker) would share their
flock, and hold it after this process is killed: it closes its copies at once (closing a
copy does not release the lock, which belongs to the open file, not to a descriptor)."""


def _close_lock_fds_in_child() -> None:
    for fd in _LOCK_FDS:
        try:
            os.close(fd)
        except OSError:
            pass
    _LOCK_FDS.clear()


os.register_at_fork(after_in_child=_close_lock_fds_in_child)
"""Work dirs this process holds: how many :func:`hold` calls are open on each."""


@contextmanager
def hold(work: Path, *, wait: bool = False, command: str | None = None) -> Iterator[None]:
    """Hold ``work``'s lock for the body (re-entrant in a process; a no-op in a process its
    holder started). A second holder stops with :class:`WorkDirBusy` (exit 2) naming the
    first, or with ``wait`` waits for it."""
    from packline.progress import console

    work = Path(work).resolve()
    if _HELD.get(work):
        _HELD[work] += 1
        try:
            yield
        finally:
            _HELD[work] -= 1
        return
    work.mkdir(parents=True, exist_ok=True)
    fd = os.open(work / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    _LOCK_FDS.add(fd)
    token = _inherited(work)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno in _NO_LOCKS:  # e.g. Lustre mounted without flock: work unlocked
                console.log(
                    f"[yellow]warning:[/] the filesystem of {work} has no file locks "
                    f"({os.strerror(exc.errno)}): packline cannot keep a second writer out "
                    "of it, and leaves temp dirs a killed run left where they are"
                )
                _LOCK_FDS.discard(fd)
                os.close(fd)
                fd = -1
                _HELD[work] = 1
                try:
                    yield
                finally:
                    _HELD.pop(work, None)
                return
            if exc.errno not in (errno.EAGAIN, errno.EACCES):
                raise
            info = holder(work)
            if token is not None and info.get("token") == token:
                _LOCK_FDS.discard(fd)
                os.close(fd)
                fd = -1
                yield  # a process of the holder: it works under the holder's lock
                return
            if not wait:
                raise WorkDirBusy(
                    [
                        f"{work} is in use by {_describe(info, held=True)}; fix: wait for "
                        "it to finish (or add --wait), or choose another work_dir"
                    ],
                    "another packline is writing this work dir",
                ) from None
            console.log(f"waiting for {work}: in use by {_describe(info, held=True)}")
            fcntl.flock(fd, fcntl.LOCK_EX)
        previous = holder(work)
        if previous.get("pid") and not previous.get("released"):
            console.log(
                f"[yellow]warning:[/] taking over the lock of {work} left by "
                f"{_describe(previous)}, which ended without releasing it (killed?)"
            )
        token = token or secrets.token_hex(8)
        info = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "command": command or shlex.join([Path(sys.argv[0]).name, *sys.argv[1:]]),
            "since": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "token": token,
        }
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(info).encode(), 0)
        if _inherited(work) is None:
            for path in remove_stale_temps(work):
                console.log(f"removed {path}, left by a run that was stopped")
        _HELD[work] = 1
        before = os.environ.get(LOCK_ENV)
        os.environ[LOCK_ENV] = f"{work}={token}"
        try:
            yield
        finally:
            _HELD.pop(work, None)
            if before is None:
                os.environ.pop(LOCK_ENV, None)
            else:
                os.environ[LOCK_ENV] = before
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps({**info, "released": True}).encode(), 0)
    finally:
        _LOCK_FDS.discard(fd)
        if fd >= 0:
            os.close(fd)
