"""Every ``bash`` block of the tutorial, in page order, in one shell: a command that fails
fails the test. The shell runs in a temp dir holding links to the project's ``.venv``,
``configs/`` and ``tutorial/``, so the tutorial's relative paths (``runs/tutorial``,
``my_data``) land there."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
TUTORIAL = ROOT / "tutorial"
BLOCK = re.compile(r"^```bash\n(.*?)^```$", re.S | re.M)


def pages() -> list[Path]:
    return sorted(TUTORIAL.glob("[0-9][0-9]-*.md"))


def bash_blocks(page: Path) -> list[str]:
    return BLOCK.findall(page.read_text())


def test_pages_are_numbered_listed_and_end_with_commands():
    names = [p.name for p in pages()]
    assert names and [int(n[:2]) for n in names] == list(range(1, len(names) + 1))
    index = (TUTORIAL / "README.md").read_text()
    for page in pages():
        assert f"({page.name})" in index, f"{page.name} is not listed in tutorial/README.md"
        text = page.read_text().rstrip()
        assert text.endswith("```"), f"{page.name} does not end with a code block"
        assert bash_blocks(page), f"{page.name} has no commands to run"


def test_every_tutorial_command_runs_in_order(tmp_path: Path):
    lines = ["set -eo pipefail", "export COLUMNS=120"]
    for page in pages():
        for i, block in enumerate(bash_blocks(page), start=1):
            lines.append(f"echo '::: {page.name} block {i}' >&2")
            lines.append(block)
    script = tmp_path / "tutorial.sh"
    script.write_text("\n".join(lines) + "\n")
    for name in (".venv", "configs", "tutorial"):
        (tmp_path / name).symlink_to(ROOT / name)
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    env["PYTHONPATH"] = str(ROOT)  # torchrun's ranks import the project from the temp dir
    done = subprocess.run(
        ["bash", str(script)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    where = [line for line in done.stderr.splitlines() if line.startswith(":::")]
    assert done.returncode == 0, (
        f"tutorial failed after {where[-1] if where else 'the start'}:\n{done.stderr[-4000:]}"
    )
    assert (tmp_path / "runs" / "tutorial" / "train" / "comparison.json").is_file()
    assert (tmp_path / "runs" / "tutorial" / "compare" / "compare.json").is_file()
