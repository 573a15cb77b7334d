"""What pip installs is what the code imports: every third-party module that packline's
packages import at their top level comes from a distribution ``pyproject.toml`` declares."""

from __future__ import annotations

import ast
import importlib.metadata as md
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import packline

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("packline", "stages", "schemas", "pipelines")


def _name(dist: str) -> str:
    return re.sub(r"[-_.]+", "-", dist).lower()


def _declared() -> set[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return {_name(re.split(r"[<>=!~\[; ]", d, maxsplit=1)[0]) for d in project["dependencies"]}


def _imported() -> dict[str, set[str]]:
    """Top-level module → the files importing it, over every module of the packages."""
    found: dict[str, set[str]] = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                for name in names:
                    found.setdefault(name.split(".")[0], set()).add(str(path.relative_to(ROOT)))
    return found


def test_every_third_party_import_comes_from_a_declared_distribution():
    providers = md.packages_distributions()
    declared = _declared()
    missing = {}
    for module, files in _imported().items():
        if module in sys.stdlib_module_names or module in PACKAGES or module == "__future__":
            continue
        dists = {_name(d) for d in providers.get(module, [])}
        if dists and not dists & declared:
            missing[module] = (sorted(dists), sorted(files)[:3])
    assert not missing, f"imported but not declared in pyproject.toml: {missing}"


def test_version_flag_prints_the_package_version():
    out = subprocess.run(
        [sys.executable, "-m", "pipelines.cli", "--version"],
        capture_output=True, text=True, cwd=ROOT, timeout=60, check=True,
    ).stdout  # fmt: skip
    assert out.strip() == f"packline {packline.__version__}"
    assert md.version("packline") == packline.__version__
