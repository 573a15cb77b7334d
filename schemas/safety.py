"""What packline refuses in a config before it touches anything: values that would run as
shell, and data that lies where a stage replaces its output.

Two facts make these rules necessary:

- Command lines are built from config values outside packline: NeMo-Run's packager runs
  ``tar -cf {job_dir}/{name}.tar.gz`` through a shell, unquoted, and writes ``export
  KEY=VALUE`` lines and paths into every sbatch script. A ``;``, ``$(…)``, a backtick or a
  space in such a value runs, or lands, somewhere else. packline quotes the commands it
  builds itself; these rules refuse the values that reach the others.
- A stage publishes by replacing ``<work_dir>/<stage>``; the built-in set is regenerated in
  ``<work_dir>/source``, connect's resumable parts are removed after their merge. A user's
  dataset inside one of those dirs would be deleted, and a dataset holding the work dir
  would change (and be rewritten) by every run.

Each function returns ``(setting, what is wrong, fix)`` triples; ``schemas/rules.py``
turns them into findings, so ``load_config`` refuses them all at once and validate lists
them.

>>> unsafe_reason("runs/my_run-1")
>>> unsafe_reason("x;touch /tmp/p")
"';' at character 2 (a shell metacharacter)"
>>> unsafe_reason("my runs")
"' ' at character 3 (whitespace)"
>>> bad_name("x$(id)")
"'$' at character 2: a name is letters, digits, '_', '.' and '-', starting with a letter or digit"
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Iterator
from pathlib import Path
from typing import Any

#: Characters a shell gives a meaning to (``~`` is expanded at the start of a path before any
#: rule runs; ``%`` is a SLURM file-name pattern in the log paths built from the work dir).
SHELL_METACHARACTERS = frozenset("`$;&|<>(){}[]*?!\\\"'#%")
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*\Z")
ENV_KEY_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")

#: Settings whose value is a path of this machine (``~`` expanded first).
PATH_SETTINGS = ("work_dir", "data.source", "data.media_dir", "processor.path", "model.path")
#: Settings of the SLURM executor that reach an sbatch script, a NeMo-Run command line or
#: the SSH tunnel.
CLUSTER_SETTINGS = (
    "executor.slurm.account",
    "executor.slurm.partition",
    "executor.slurm.mem",
    "executor.slurm.time",
    "executor.slurm.container_image",
    "executor.slurm.container_mounts",
    "executor.slurm.env",
    "executor.slurm.host",
    "executor.slurm.user",
    "executor.slurm.job_dir",
)
_FIX = "has no whitespace, no control character and none of " + "".join(
    sorted(SHELL_METACHARACTERS)
)

#: What packline replaces or removes under a work dir, besides the stage dirs: the built-in
#: set's generated copies, connect's parts, NeMo-Run's experiment dirs, the SLURM logs it
#: copies back.
WORK_SUBDIRS = ("source", "connect.parts", "nemorun", "logs")


def unsafe_reason(value: str) -> str | None:
    """What makes ``value`` unsafe on a shell or SLURM command line (its first bad
    character), or None when it is safe."""
    for i, ch in enumerate(value):
        if ch in SHELL_METACHARACTERS:
            return f"{ch!r} at character {i + 1} (a shell metacharacter)"
        if ch.isspace():
            return f"{ch!r} at character {i + 1} (whitespace)"
        if unicodedata.category(ch).startswith("C"):
            return f"{ch!r} at character {i + 1} (a control character)"
    return None


def bad_name(name: str) -> str | None:
    """Why ``name`` cannot be a pipeline name, or None: it names dirs, the MLflow experiment,
    SLURM job names and NeMo-Run's archive files."""
    if NAME_RE.match(name):
        return None
    if not name:
        return "it is empty"
    i = next(
        (i for i, ch in enumerate(name) if not re.match(r"[A-Za-z0-9_.-]", ch)),
        0,
    )
    return (
        f"{name[i]!r} at character {i + 1}: a name is letters, digits, '_', '.' and '-', starting "
        "with a letter or digit"
    )


def _values(setting: str, value: Any) -> Iterator[tuple[str, str]]:
    """``(where, text)`` of every string in a setting's value (a list's items, a dict's keys
    and values)."""
    if value is None:
        return
    if isinstance(value, dict):
        for k, v in value.items():
            yield f"{setting}.{k} (the name)", str(k)
            yield f"{setting}.{k}", str(v)
    elif isinstance(value, list | tuple):
        for i, v in enumerate(value):
            yield f"{setting}[{i}]", str(v)
    else:
        yield setting, str(value)


def _get(d: dict[str, Any], dotted: str) -> Any:
    for part in dotted.split("."):
        if not isinstance(d, dict) or part not in d:
            return None
        d = d[part]
    return d


def shell_problems(config: dict[str, Any], work: Path) -> list[tuple[str, str, str]]:
    """Every setting of ``config`` (the resolved config as a plain dict; ``work`` the work
    dir it resolves to) that would run as shell or escape its place on a command line: one
    ``(setting, what is wrong, fix)`` each. Paths are checked as written and as packline
    uses them (absolute, links resolved)."""
    found: list[tuple[str, str, str]] = []
    name = config.get("name")
    if isinstance(name, str) and (why := bad_name(name)) is not None:
        found.append(
            (
                "name",
                f"name {name!r}: {why}",
                "choose a name such as my-run_2 (it names the work dir, the MLflow "
                "experiment and the SLURM jobs)",
            )
        )
    for setting in PATH_SETTINGS:
        value = _get(config, setting)
        if setting == "work_dir" and value is None and "name" not in {f[0] for f in found}:
            value = str(work)  # runs/<name> under the current dir, as packline resolves it
        if value is None or (setting == "data.source" and value == "synthetic"):
            continue
        path = Path(str(value)).expanduser()
        written, used = str(path), str(path.resolve())
        if setting == "data.source":  # a glob (Parquet files) is Python's, never a shell's:
            # data.source travels in the config file only, on no command line
            written, used = (re.sub(r"[*?\[\]]", "", text) for text in (written, used))
        why = unsafe_reason(written) or unsafe_reason(used)
        if why is not None:
            found.append(
                (setting, f"{setting} {str(value)!r}: {why}", f"move it to a path that {_FIX}")
            )
    for setting in CLUSTER_SETTINGS:
        for where, text in _values(setting, _get(config, setting)):
            if where.endswith("(the name)"):
                if not ENV_KEY_RE.match(text):
                    found.append(
                        (
                            setting,
                            f"{where} {text!r}: not a shell variable name",
                            "name it with letters, digits and '_', not starting with a digit",
                        )
                    )
            elif (why := unsafe_reason(text)) is not None:
                found.append((setting, f"{where} {text!r}: {why}", f"set a value that {_FIX}"))
    return found


def _inside(path: Path, root: Path) -> bool:
    return path == root or root in path.parents


def replaced_dirs(work: Path, stages: tuple[str, ...]) -> list[Path]:
    """The dirs under ``work`` that packline replaces or removes: every stage's, the
    built-in set's, connect's parts, NeMo-Run's and the copied logs."""
    return [work / name for name in (*stages, *WORK_SUBDIRS)]


def data_placement_problems(
    work: Path, stages: tuple[str, ...], inputs: dict[str, Path]
) -> list[tuple[str, str, str]]:
    """Where the user's inputs (``inputs``: setting → resolved path; a source folder, a
    LLaVA file and its media dir, an Energon dataset, a processor or model dir) and the work
    dir overlap so that a run would delete or rewrite them: an input inside a dir packline
    replaces, a work dir inside a data input, or a replaced dir that is a symlink."""
    found: list[tuple[str, str, str]] = []
    dirs = replaced_dirs(work, stages)
    for d in dirs:
        if d.is_symlink():
            found.append(
                (
                    "work_dir",
                    f"work_dir: {d} is a symbolic link (to {d.resolve()}): packline replaces "
                    "that dir and would delete what it points to",
                    f"remove the link {d}, or choose another work_dir",
                )
            )
    for setting, path in inputs.items():
        hit = next((d for d in dirs if _inside(path, d.resolve())), None)
        if hit is not None:
            found.append(
                (
                    setting,
                    f"{setting} {str(path)!r} lies inside {hit}, which packline replaces "
                    "on a run: it would be deleted",
                    f"move it out of {work}, or choose another work_dir",
                )
            )
        elif setting.startswith("data.") and path.is_dir() and _inside(work, path):
            found.append(
                (
                    "work_dir",
                    f"work_dir {str(work)!r} lies inside {setting} {str(path)!r}: every run "
                    "would write into the dataset and change what prepare reads",
                    f"choose a work_dir outside {path}",
                )
            )
    return found
