"""The ``packline`` CLI, SIGKILLed in the middle of writing a checkpoint.

``python -m tests.integration.kill_in_checkpoint STEP FILE ARGS...`` runs ``packline ARGS...``
with a checkpoint write hook (:func:`packline.train.checkpoint.add_write_hook`) that kills
this process with SIGKILL as soon as ``FILE`` of checkpoint ``STEP`` is written: the torn
write the resume tests recover from.
"""

from __future__ import annotations

import os
import signal
import sys

from packline.train import checkpoint
from pipelines.cli import main


def run(argv: list[str]) -> int:
    step, name, *args = argv

    def kill(written_step: int, file_name: str) -> None:
        if written_step == int(step) and file_name == name:
            os.kill(os.getpid(), signal.SIGKILL)

    checkpoint.add_write_hook(kill)
    return main(args)


if __name__ == "__main__":
    raise SystemExit(run(sys.argv[1:]))
