"""The contracts, the bottom floor: the typed config, its rules, the tables' schemas and the
parallel layout as plain data. Imports nothing from ``packline``, ``stages`` or ``pipelines``
(``tests/unit/test_layering.py``), so loading a config imports no torch."""
