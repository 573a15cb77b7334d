"""A train backend is one spec: the object every caller asks instead of branching on
``train.backend``. Each backend is one module (``local.py``: packline's own trainer;
``megatron.py``: Megatron-Bridge on SLURM) holding one :class:`Backend`; :data:`SPECS`
names them and :func:`backend` imports the one a config names. Adding a backend is its
module, its :class:`~schemas.choices.TrainBackend` member and its tests; no other module
compares ``train.backend`` (``tests/unit/test_layering.py`` checks).

What a spec answers, and who asks:

- how its train stage runs (``train_stage``: the stage page the runner calls), and what
  ``run --dryrun`` shows of it beyond the sbatch scripts (:meth:`Backend.plan`);
- what prepare and connect must make for it (``renders_for_bridge``: pre-sampled video
  frames, lengths measured as Bridge's encoder renders, the processor's frame sampling off);
- which validate rules apply (``renders_for_bridge``: Bridge's data rules and the Megatron
  book; ``trains_here``: the rules on the model packline itself splits, places and sizes);
- the forecast's packer and data-parallel ranks (:meth:`Backend.forecast_packer`,
  :meth:`Backend.data_parallel_ranks`);
- the train fingerprint's sections (:meth:`Backend.train_settings`);
- its export (:meth:`Backend.export`), what a finished run offers next (``trains_here``:
  an adapter dir, ``packline chat``) and how ``packline compare`` reads its runs
  (``compares_packers``: cluster runs per packer, else the packed/unpacked pair).

    >>> from schemas.config import load_config
    >>> backend(load_config(None, [])).trains_here
    True
    >>> backend(load_config(None, ["train.backend=megatron"])).renders_for_bridge
    True
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from schemas.choices import Balance, TrainBackend

if TYPE_CHECKING:
    from schemas.config import PipelineConfig

#: Each train backend's spec, by the module that holds it (imported when asked for).
SPECS = {
    TrainBackend.local: "packline.backends.local:LOCAL",
    TrainBackend.megatron: "packline.backends.megatron:MEGATRON",
}


@dataclass(frozen=True)
class Backend:
    """What callers ask of a train backend (see the module docstring)."""

    name: TrainBackend
    train_stage: str
    """``module:function`` of the stage page that trains (the runner imports it)."""
    renders_for_bridge: bool
    """The run trains in Megatron-Bridge: prepare writes each video's pre-sampled frames,
    connect measures as Bridge's encoder renders (media first, its frame cap, the
    processor's own frame sampling off), and Bridge's data rules and the Megatron book
    apply."""
    trains_here: bool
    """packline's own trainer builds, splits and places the model (the model's split,
    attention device and memory rules apply) and saves a PEFT adapter dir (``packline
    chat`` and the adapter's next step)."""
    compares_packers: bool
    """``packline compare`` reads the cluster runs per packer (Bridge's metrics beside the
    forecast's), not a packed/unpacked pair of local runs."""

    def forecast_packer(self, cfg: PipelineConfig) -> dict[str, Any]:
        """The packer the forecast simulates: ``algorithm``, ``max_carry_rounds`` and
        whether FLOPs balance is on (``balance``)."""
        raise NotImplementedError

    def data_parallel_ranks(self, cfg: PipelineConfig) -> int:
        """Data-parallel ranks the backend reads data with (Energon's world size)."""
        raise NotImplementedError

    def train_settings(self, cfg: PipelineConfig) -> dict[str, Any]:
        """The config sections the train stage's outputs depend on (its fingerprint)."""
        raise NotImplementedError

    def plan(self, cfg: PipelineConfig) -> list[str]:
        """What ``run --executor slurm --dryrun`` prints of the train job beyond its
        sbatch script."""
        return []

    def export(self, cfg: PipelineConfig, to: Path, *, merge: bool) -> Path | str:
        """``packline export`` into ``to``: the path written, or a command to run where the
        backend's own export runs."""
        raise NotImplementedError


def packline_packer(cfg: PipelineConfig) -> dict[str, Any]:
    """packline's task encoder as the forecast simulates it: ``packing.algorithm``,
    ``packing.max_carry_rounds`` and ``packing.balance``, as configured (the local backend's
    packer, and the megatron backend's with ``packing.packer: packline``)."""
    p = cfg.packing
    return {
        "algorithm": p.algorithm.value,
        "max_carry_rounds": p.max_carry_rounds,
        "balance": p.balance is Balance.flops,
    }


def backend(cfg: PipelineConfig) -> Backend:
    """The spec of ``cfg``'s ``train.backend``."""
    return spec(cfg.train.backend)


def spec(name: TrainBackend) -> Backend:
    """The spec of train backend ``name``."""
    module, _, attr = SPECS[name].partition(":")
    return getattr(importlib.import_module(module), attr)


def export_run(cfg: PipelineConfig, to: Path | None = None, *, merge: bool = False) -> Path | str:
    """``packline export``: the config's trained run into ``to`` (default
    :func:`~packline.catalog.export_dir`; the adapter, or with ``merge`` a merged HF
    checkpoint), as its backend exports (:meth:`Backend.export`). Returns ``to``, or for
    the megatron backend outside Bridge's container the command that exports there
    (nothing is written)."""
    from packline.catalog import export_dir

    to = Path(to or export_dir(cfg, merge)).expanduser().resolve()
    return backend(cfg).export(cfg, to, merge=merge)
