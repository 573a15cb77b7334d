"""The ``packline`` CLI with a bug injected into prepare: what packline does with a failure
it has no reason for (the last line of defence: one line naming the input, exit 1, the
traceback in the stage's log).

``python -m tests.integration.bug_in_prepare ARGS...`` runs ``packline ARGS...`` with the
rows of a conversation folder read by a reader that raises ``KeyError('injected')`` at the
second row, as a bug in packline's reading code would.
"""

from __future__ import annotations

import sys

from packline.sources import jsonl
from pipelines.cli import main


def run(argv: list[str]) -> int:
    read = jsonl.jsonl_rows

    def buggy(path, on_offset=None):
        for n, row in enumerate(read(path, on_offset)):
            if n == 1:
                raise KeyError("injected")
            yield row

    jsonl.jsonl_rows = buggy  # the folder reader looks it up at call time
    return main(argv)


if __name__ == "__main__":
    raise SystemExit(run(sys.argv[1:]))
