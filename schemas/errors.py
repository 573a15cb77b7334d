"""The one user-facing error: what the user must change (config, inputs, order of stages).

Every check of packline that the user can fix raises :class:`UserError` with *every*
problem it found, so one run reports them all; the CLI prints it and exits 2. Internal
invariants use ``assert``.

>>> print(UserError(["train.lr must be > 0", "data.num_val must be >= 1"]))
invalid configuration (2 problem(s)):
  - train.lr must be > 0
  - data.num_val must be >= 1
"""

from __future__ import annotations


class UserError(ValueError):
    """Invalid configuration or input; ``problems`` lists every one found."""

    def __init__(self, problems: list[str], header: str = "invalid configuration"):
        self.problems = list(problems)
        self.header = header
        super().__init__(self.render())

    def render(self) -> str:
        lines = [f"{self.header} ({len(self.problems)} problem(s)):"]
        lines += [f"  - {p}" for p in self.problems]
        return "\n".join(lines)


class InputCrash(RuntimeError):
    r"""packline failed on a user's file in a way it has no reason for: a bug. It names the
    file and sample, what went wrong and the log that holds the traceback; the CLI prints it
    as one line (exit 1).

    >>> crash = InputCrash("a.jsonl line 7 (id 'a')", "KeyError: 'x'", "p.log")
    >>> print(str(crash).replace(" — ", "\n"))
    packline failed on a.jsonl line 7 (id 'a'): KeyError: 'x'
    a bug in packline, please report it with the traceback in p.log
    """

    def __init__(self, where: str, error: str, log: str = ""):
        super().__init__(where, error, log)  # as args: it pickles from a worker process
        self.where, self.error, self.log = where, error, log

    def __str__(self) -> str:
        log = f" with the traceback in {self.log}" if self.log else ""
        return (
            f"packline failed on {self.where}: {self.error} — a bug in packline, please "
            f"report it{log}"
        )
