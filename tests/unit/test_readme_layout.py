"""README's "Layout" tells the truth about the tree: every folder and file it names exists,
every top folder and every package of the library is named, and each top folder has a
README of its own."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _layout_lines() -> list[str]:
    text = (ROOT / "README.md").read_text()
    block = text.split("## Layout\n", 1)[1].split("```\n", 2)[1]
    return block.splitlines()


def _entries() -> tuple[dict[str, list[str]], list[str]]:
    """(top folder -> the entries indented under it, every file name or path the block
    mentions together with the top folder it is mentioned under)."""
    tops: dict[str, list[str]] = {}
    mentions: list[str] = []
    top = ""
    for line in _layout_lines():
        name = line.split()[0] if line.strip() else ""
        if line and not line[0].isspace():
            top = name
            tops[top] = []
        elif line.startswith("  ") and not line.startswith("   ") and name:
            tops[top].append(name)
        for path in re.findall(r"[\w/.-]+\.(?:py|yaml|sh)\b", line):
            mentions.append(path if "/" in path else f"{top}{path}")
    return tops, mentions


def _tracked_top_folders() -> set[str]:
    files = subprocess.run(
        ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    return {f.split("/")[0] + "/" for f in files if "/" in f and not f.startswith(".")}


def test_every_folder_and_file_the_layout_names_exists():
    tops, mentions = _entries()
    for top, subs in tops.items():
        assert (ROOT / top).is_dir(), top
        for sub in subs:
            assert (ROOT / top / sub).exists(), f"{top}{sub}"
    for path in mentions:
        top, _, rest = path.partition("/")
        found = (ROOT / path).exists() or any((ROOT / top).rglob(Path(rest).name))
        assert found, f"README's Layout names {path}, which is not in the tree"


def test_the_layout_names_every_top_folder_and_library_package_and_each_has_a_readme():
    tops, _ = _entries()
    assert set(tops) == _tracked_top_folders()
    packages = {p.parent.name + "/" for p in (ROOT / "packline").glob("*/__init__.py")}
    assert packages <= set(tops["packline/"]), packages - set(tops["packline/"])
    for top in tops:
        assert (ROOT / top / "README.md").is_file(), f"{top} has no README.md"
