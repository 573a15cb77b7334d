"""Assembly only: NeMo-Run experiments over the stages, executors, and the CLI."""
