"""The embedded (local) training backend: loop, LoRA model set-up, evaluation."""
