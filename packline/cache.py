"""packline's cache dir: what is slow to build and the same every time (the built-in tiny
processor), kept between runs. ``$PACKLINE_CACHE_DIR``, else ``~/.cache/packline``; deleting
it only costs a rebuild."""

from __future__ import annotations

import os
from pathlib import Path

CACHE_DIR_ENV = "PACKLINE_CACHE_DIR"
"""Environment variable naming packline's cache dir."""


def cache_dir() -> Path:
    """packline's cache dir: ``$PACKLINE_CACHE_DIR``, else ``~/.cache/packline``."""
    return Path(os.environ.get(CACHE_DIR_ENV) or Path.home() / ".cache" / "packline")
