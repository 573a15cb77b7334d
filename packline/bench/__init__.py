"""The packing benchmarks as library code (``packline bench packing`` and ``packline bench
loader`` wire them up in ``pipelines/bench.py``):

- :mod:`~packline.bench.lengths`: a seeded synthetic length distribution shaped like VLM
  SFT data, and the seeded sample stream.
- :mod:`~packline.bench.simulation`: the fill of every packing method on a list of lengths,
  simulated (no loader), and the time of ``select_packs``.
- :mod:`~packline.bench.processes`: the processes started under this one: their pids, their
  RSS polled in a thread, a wait until they have exited.
- :mod:`~packline.bench.loader`: the real Energon loader measured: worker RSS, throughput,
  the measured fill; the workers are checked to have exited after each run.
- :mod:`~packline.bench.targets`: the figures' targets, held or not.
- :mod:`~packline.bench.tables`: the figures as rich tables.

Every figure is taken at :data:`SEQ_LENGTH`, but the cluster comparison (Bridge's packer
against packline's in Bridge), at :data:`CLUSTER_SEQ_LENGTH`, as the cluster configs pack.
"""

#: The sequence length (pack capacity) the benchmark's figures are measured at.
SEQ_LENGTH = 2048
#: The cluster configs' ``packing.seq_length``: the cluster comparison's capacity.
CLUSTER_SEQ_LENGTH = 4096
