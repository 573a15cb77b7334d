"""pip inputs for installing packline into an image whose torch must stay (containers/Dockerfile).

    python packline_requirements.py requirements pyproject.toml  # packline's deps, torch* left out
    python packline_requirements.py constraints                  # the installed torch* pinned

pyproject.toml pins the torch this project's venv uses; the NeMo container brings its own build
(CUDA, NCCL, transformer-engine compiled against it), which an install of packline's
requirements would replace. The requirements leave the torch family out and the constraints
hold it at the installed versions, so no package packline needs can pull another torch in.
"""

from __future__ import annotations

import importlib.metadata
import re
import sys
import tomllib
from pathlib import Path

TORCH_FAMILY = ("torch", "torchvision", "torchaudio")
"""Distributions the image's own build provides and nothing may reinstall."""


def _name(requirement: str) -> str:
    """The normalised distribution name of a requirement string (PEP 503)."""
    match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement)
    if not match:
        raise ValueError(f"not a requirement: {requirement!r}")
    return re.sub(r"[-_.]+", "-", match.group(1)).lower()


def requirements(pyproject: Path) -> list[str]:
    """``[project].dependencies`` of ``pyproject`` without the torch family."""
    deps = tomllib.loads(Path(pyproject).read_text())["project"]["dependencies"]
    return [d for d in deps if _name(d) not in TORCH_FAMILY]


def constraints() -> list[str]:
    """``name==version`` of each installed member of the torch family."""
    out = []
    for name in TORCH_FAMILY:
        try:
            out.append(f"{name}=={importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            continue
    return out


def main(argv: list[str]) -> int:
    if argv[:1] == ["requirements"] and len(argv) == 2:
        lines = requirements(Path(argv[1]))
    elif argv == ["constraints"]:
        lines = constraints()
    else:
        print(__doc__, file=sys.stderr)
        return 2
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
