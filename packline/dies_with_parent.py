"""Imported first by the fork server of packline's worker pools (multiprocessing's preload,
:func:`packline.workers.ordered_map`): asks Linux to end this process when the process that
started it ends (``PR_SET_PDEATHSIG``). A killed stage runs no cleanup; without this its
fork server, which holds the pool's resource tracker open, lives on until it next reads its
socket. The workers it forks watch their owner themselves (:func:`packline.workers.exit_with`).
Elsewhere than Linux this does nothing.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1  # linux/prctl.h


def ask() -> bool:
    """Set this process's parent-death signal to SIGKILL; whether it could be set. A parent
    already gone (this process reparented) ends this one at once."""
    if not sys.platform.startswith("linux"):
        return False
    parent = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        return False
    if os.getppid() != parent:
        os._exit(1)  # the parent ended before the signal was set
    return True


ask()
