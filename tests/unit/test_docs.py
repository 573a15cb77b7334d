"""The README is a front door and the docs tell the truth: the README stays short and starts
with the two set-up commands, every relative link of the README and ``docs/`` leads to a
file (and heading) that exists, the generated references match the schema and the parser,
and the Layout in ``docs/architecture.md`` matches the tree: every folder and file it names
exists, every top folder and every package of the library is named, and each top folder
has a README of its own."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from pipelines.reference import REGENERATE, references
from schemas.config import value_sources
from schemas.reference import config_reference

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
ARCHITECTURE = ROOT / "docs" / "architecture.md"
MAX_README_LINES = 150
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```[\w-]*\n(.*?)^```$", re.S | re.M)


def _slug(heading: str) -> str:
    """GitHub's anchor of a Markdown heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    return {_slug(m) for m in re.findall(r"^#+ (.+)$", page.read_text(), re.M)}


def _linked_pages() -> list[Path]:
    return [README, *sorted((ROOT / "docs").glob("*.md"))]


def test_readme_is_short_and_starts_with_make_run_and_make_test():
    text = README.read_text()
    assert len(text.splitlines()) <= MAX_README_LINES
    first = FENCE.search(text)
    assert first is not None, "README has no fenced block"
    commands = [line.split("#")[0].strip() for line in first.group(1).splitlines()]
    assert [c for c in commands if c] == ["make run", "make test"]


def test_readme_holds_the_run_output_block():
    text = README.read_text()
    block = text.split("<!-- run-output:start -->\n", 1)[1].split("<!-- run-output:end -->")[0]
    assert block.startswith("```text\n") and block.rstrip().endswith("```"), block[:200]


@pytest.mark.parametrize("page", _linked_pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page: Path):
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target):
            continue  # http(s):, mailto:
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        assert dest.exists(), f"{page.relative_to(ROOT)} links to {target}: no such file"
        if anchor and dest.suffix == ".md":
            assert anchor in _anchors(dest), f"{page.relative_to(ROOT)}: no heading #{anchor}"


@pytest.mark.parametrize("path", list(references()), ids=lambda p: p.name)
def test_generated_reference_is_current(path: Path):
    stale = f"{path.relative_to(ROOT)} is stale: run {REGENERATE}"
    assert path.is_file(), stale
    assert path.read_text() == references()[path], stale


def test_config_reference_has_one_row_per_setting_with_its_type_and_default():
    text = config_reference()
    keys = re.findall(r"^\| `([\w.]+)` \|", text, re.M)
    assert sorted(keys) == sorted(value_sources(None, []))
    assert "| `packing.seq_length` | int | `4096` |" in text
    assert "| `train.parallel.schedule` | one of `gpipe`, `1f1b` | `1f1b` |" in text
    assert "| `processor.path` | str or null | `null` |" in text
    assert "| `name` | str | required |" in text


# -- the Layout in docs/architecture.md ------------------------------------------------------


def _layout_lines() -> list[str]:
    text = ARCHITECTURE.read_text()
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
        assert found, f"docs/architecture.md's Layout names {path}, which is not in the tree"


def test_the_layout_names_every_top_folder_and_library_package_and_each_has_a_readme():
    tops, _ = _entries()
    assert set(tops) == _tracked_top_folders()
    packages = {p.parent.name + "/" for p in (ROOT / "packline").glob("*/__init__.py")}
    assert packages <= set(tops["packline/"]), packages - set(tops["packline/"])
    for top in tops:
        assert (ROOT / top / "README.md").is_file(), f"{top} has no README.md"
