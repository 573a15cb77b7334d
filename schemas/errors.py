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
