"""Memory of a training step: measured with torch's own tracker.

:func:`measured_peak` runs a step under ``torch.distributed._tools.mem_tracker.MemTracker``
(which follows every tensor's storage, by module and by kind: parameters, gradients,
activations, optimizer state, on any device, the CPU included) and returns the step's peak
by kind. MemTracker installs a gradient hook on every parameter of each module it sees,
which a frozen parameter refuses (a LoRA model's base is frozen): :class:`FrozenAwareTracker`
lets those through without one (they never get a gradient to count).
"""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch
from torch.distributed._tools.mem_tracker import MemTracker

_NO_HOOK = SimpleNamespace(remove=lambda: None)


class FrozenAwareTracker(MemTracker):
    """torch's MemTracker for a model with frozen parameters (see the module docstring)."""

    def track_model(self, model: torch.nn.Module) -> None:
        for param in model.parameters():
            if not param.requires_grad:
                self._param_to_grad_hook_handles[param] = (_NO_HOOK, _NO_HOOK)
        self.track_external(model)


class _Forward(torch.nn.Module):
    """A step's forward as one module call: MemTracker counts a module called twice outside
    a common parent (the chunked loss's LM head, called per chunk) as a second iteration."""

    def __init__(self, model: torch.nn.Module, forward: Callable[[], torch.Tensor]):
        super().__init__()
        self.model = model
        self.run = forward

    def forward(self) -> torch.Tensor:
        return self.run()


def measured_peak(
    model: torch.nn.Module, forward: Callable[[], torch.Tensor], *extra: Any
) -> dict[str, int]:
    """The peak bytes of a training step of ``model``: ``forward()`` (returning the loss) and
    its backward, by kind (``Parameter``, ``Gradient``, ``Activation``, ``Temp``,
    ``Optstate``, ``Other`` and ``Total``), summed over devices; ``extra``: optimizers or
    tensors made outside the step to count too."""
    tracker = FrozenAwareTracker()
    whole = _Forward(model, forward)
    tracker.track_model(whole)
    if extra:
        tracker.track_external(*extra)
    with tracker:
        whole().backward()
    peak: dict[str, int] = {}
    for by_kind in tracker.get_tracker_snapshot("peak").values():
        for kind, value in by_kind.items():
            name = getattr(kind, "value", str(kind))
            peak[name] = peak.get(name, 0) + int(value)
    return peak
