"""Faults of the machine, made for real in tests: a small tmpfs that fills, a read-only
mount, and processes that run as root without the capabilities that override file modes
(so a mode of 000 denies them, as it denies any user). Each needs root (CI runs as root);
where mounting or dropping capabilities is impossible the test skips, saying why.

    with tmpfs(tmp_path / "small", size="4m") as mnt: ...      # mounted, unmounted after
    remount(mnt, size="64m")                                    # the fix: a larger device
    with read_only(tmp_path / "work") as ro: ...                # the same dir, read-only
    run_cli(["stage", "prepare", ...], without_dac=True)        # EACCES on mode-000 files
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from schemas.config import PROJECT_ROOT

#: Run a command as root without CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH: file modes apply.
WITHOUT_DAC = [
    "setpriv",
    "--inh-caps=-dac_override,-dac_read_search",
    "--bounding-set=-dac_override,-dac_read_search",
    "--",
]


def _run(cmd: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60)


def _need_mount(what: str, result: subprocess.CompletedProcess) -> None:
    if result.returncode != 0:
        reason = f"cannot {what} here ({result.stderr.strip() or result.returncode})"
        if os.environ.get("CI"):
            pytest.fail(reason + "; CI runs as root and must mount")
        pytest.skip(reason)


@contextmanager
def tmpfs(path: Path, size: str) -> Iterator[Path]:
    """A tmpfs of ``size`` (e.g. ``4m``) mounted at ``path`` (made) for the body."""
    path.mkdir(parents=True, exist_ok=True)
    _need_mount(
        "mount a tmpfs", _run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)])
    )
    try:
        yield path
    finally:
        _run(["umount", "-l", str(path)])


def remount(path: Path, *, size: str | None = None, read_only: bool | None = None) -> None:
    """Change a mount made here: its size, or read-only / read-write."""
    opts = ["remount"]
    if size is not None:
        opts.append(f"size={size}")
    if read_only is not None:
        opts.append("ro" if read_only else "rw")
    result = _run(["mount", "-o", ",".join(opts), str(path)])
    assert result.returncode == 0, result.stderr


@contextmanager
def read_only(path: Path) -> Iterator[Path]:
    """``path`` (a dir) bind-mounted read-only over itself for the body."""
    _need_mount("bind-mount", _run(["mount", "--bind", str(path), str(path)]))
    try:
        _need_mount("remount read-only", _run(["mount", "-o", "remount,bind,ro", str(path)]))
        yield path
    finally:
        _run(["umount", "-l", str(path)])


def can_drop_dac() -> bool:
    """Whether a process started with :data:`WITHOUT_DAC` is denied a mode-000 file."""
    import tempfile

    if shutil.which("setpriv") is None or os.geteuid() != 0:
        return False
    with tempfile.NamedTemporaryFile() as f:
        os.chmod(f.name, 0)
        code = f"import os; print(os.access({f.name!r}, os.R_OK))"
        probe = _run([*WITHOUT_DAC, sys.executable, "-c", code])
    return probe.returncode == 0 and probe.stdout.strip() == "False"


def cli_env() -> dict[str, str]:
    """This process's environment for a ``packline`` child, without a work dir lock it may
    hold (a child with it would work under that lock)."""
    from packline.workdir import LOCK_ENV

    env = {k: v for k, v in os.environ.items() if k != LOCK_ENV}
    env["COLUMNS"] = "200"
    return env


def run_cli(
    args: list[str], *, without_dac: bool = False, cwd: Path = PROJECT_ROOT, timeout: float = 600
) -> subprocess.CompletedProcess:
    """``python -m pipelines.cli ARGS`` in a subprocess (as root without the DAC capabilities
    with ``without_dac``: skipped, saying why, where that is impossible)."""
    prefix: list[str] = []
    if without_dac:
        if not can_drop_dac():
            pytest.skip(
                "cannot run a process without CAP_DAC_OVERRIDE here (needs root and setpriv)"
            )
        prefix = WITHOUT_DAC
    return subprocess.run(
        [*prefix, sys.executable, "-m", "pipelines.cli", *args],
        capture_output=True, text=True, env=cli_env(), cwd=cwd, timeout=timeout,
    )  # fmt: skip


def sha256_tree(root: Path) -> dict[str, str]:
    """Every regular file under ``root`` (links not followed), by relative path: its sha256."""
    out = {}
    for path in sorted(root.rglob("*")):
        if path.is_file() and not path.is_symlink():
            out[str(path.relative_to(root))] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out
