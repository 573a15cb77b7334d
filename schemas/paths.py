"""What a path on this machine is, in the words a message gives the user: a file that is not
a regular one (a FIFO, a device, a socket: opening a FIFO blocks until someone writes it), a
file this user may not read, the nearest part of a path that exists. The config's rules, the
readers of a user's media and the faults of the machine (:mod:`packline.faults`) all ask here.

    >>> special_kind(Path("/dev/null")), not_regular(Path("/etc"))
    ('a character device', 'a directory')
    >>> special_kind(Path("/etc")) is None, nearest_existing(Path("/etc/no/such/dir"))
    (True, PosixPath('/etc'))
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

#: packline's checkout: the dir holding configs/, models/ and the packages.
PROJECT_ROOT = Path(__file__).resolve().parent.parent

_NOT_REGULAR = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def not_regular(path: Path, st: os.stat_result | None = None) -> str | None:
    """What ``path`` (followed if a link) is when it exists but is not a regular file (a
    directory, a FIFO, a device, a socket), else None; ``st``: its ``os.stat`` when the
    caller has it."""
    if st is None:
        try:
            st = os.stat(path)
        except OSError:
            return None
    for test, words in _NOT_REGULAR:
        if test(st.st_mode):
            return words
    return None if stat.S_ISREG(st.st_mode) else "not a regular file"


def special_kind(path: Path, st: os.stat_result | None = None) -> str | None:
    """What ``path`` is when it exists but is neither a regular file nor a directory."""
    what = not_regular(path, st)
    return None if what == "a directory" else what


def user_name() -> str:
    """This process's user, as a message names it."""
    try:
        import pwd

        return pwd.getpwuid(os.geteuid()).pw_name
    except (KeyError, ImportError):
        return f"uid {os.geteuid()}"


def unreadable(path: Path) -> str | None:
    """Why this user cannot read ``path`` (or list it, for a dir), None when it can. Root
    reads anything unless it runs without the capabilities that override file modes:
    ``os.access`` answers for the process as it is."""
    mode = os.R_OK | os.X_OK if Path(path).is_dir() else os.R_OK
    if os.access(path, mode):
        return None
    return f"permission denied for {user_name()}"


def nearest_existing(path: Path) -> Path:
    """``path`` or its nearest ancestor that exists."""
    path = Path(path)
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def work_dir_problem(work: Path) -> str | None:
    """Why ``work`` cannot be a work dir before anything is written: it, or a part of its
    path, is a file."""
    existing = nearest_existing(work)
    if existing.is_dir():
        return None
    what = special_kind(existing) or "a file"
    where = "is" if existing == work else f"lies under {existing}, which is"
    return (
        f"work_dir {work} {where} {what}, not a directory; fix: choose another work_dir, "
        "or move that file away"
    )
