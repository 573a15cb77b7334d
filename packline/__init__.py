"""packline domain library: packing, Energon glue, Qwen3-VL helpers, FLOPs, tracking.

Nothing in here imports NeMo-Run or the CLI; stages and pipelines call into it.
"""

__version__ = "0.1.0"
