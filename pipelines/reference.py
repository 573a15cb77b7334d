"""The generated references under ``docs/``: ``config.md`` from the schema
(:func:`schemas.reference.config_reference`) and ``cli.md`` from the ``packline`` parser
(:func:`pipelines.cli.build_parser`), every command's ``--help``.

    python -m pipelines.reference           # rewrite both
    python -m pipelines.reference --check   # exit 1 naming each stale file
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pipelines.cli import build_parser
from schemas.config import PROJECT_ROOT
from schemas.reference import config_reference

REGENERATE = ".venv/bin/python -m pipelines.reference"
WIDTH = 100
"""Columns the help text is wrapped to, whatever the terminal."""


def _help(parser: argparse.ArgumentParser) -> str:
    parser.formatter_class = lambda prog: argparse.HelpFormatter(prog, width=WIDTH)
    return parser.format_help().rstrip()


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def cli_reference() -> str:
    """The Markdown of ``docs/cli.md``: ``packline --help``, then each command's."""
    parser = build_parser()
    out = [
        "# CLI reference",
        "",
        "Every `packline` command's `--help`, generated from the parser (`pipelines/cli.py`)",
        f"by `{REGENERATE}`: do not edit by hand. Exit codes: 0 ok, 2 invalid",
        "config or input (every problem listed, no traceback), 1 any other failure.",
        "",
        "```text",
        _help(parser),
        "```",
    ]
    for name, sub in _subcommands(parser).items():
        out += ["", f"## `packline {name}`", "", "```text", _help(sub), "```"]
    return "\n".join(out) + "\n"


def references() -> dict[Path, str]:
    """Each generated file under the project root and the text it must hold."""
    docs = PROJECT_ROOT / "docs"
    return {docs / "config.md": config_reference(), docs / "cli.md": cli_reference()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pipelines.reference", description=__doc__)
    p.add_argument("--check", action="store_true", help="write nothing; exit 1 if stale")
    check = p.parse_args(argv).check
    stale = []
    for path, text in references().items():
        if path.is_file() and path.read_text() == text:
            continue
        stale.append(path.relative_to(PROJECT_ROOT))
        if not check:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    for path in stale:
        print(f"{path} is stale: run {REGENERATE}" if check else f"wrote {path}")
    return 1 if check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
