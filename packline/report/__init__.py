"""What a training run came to, and packing on against off: computed once, rendered once.

- :mod:`~packline.report.summary`: :class:`RunSummary` (one run's figures, built by
  :func:`summarize_run` from its per-step and per-evaluation records) and
  :class:`PackingComparison` (the pair: speedups, FLOPs ratio, seconds to the same eval
  loss, and ``bench train``'s targets);
- :mod:`~packline.report.mlflow_store`: the training runs read back from an MLflow store
  into the same records, then the same :func:`summarize_run`;
- :mod:`~packline.report.table`: the one table of one or two summaries (train stage,
  ``packline compare``, ``packline bench train``);
- :mod:`~packline.report.plots`: loss, throughput and pack-fill plots;
- :mod:`~packline.report.compare`: ``packline compare`` as a function of a store.

The metric names all of them read are those of :mod:`packline.metrics`.
"""
