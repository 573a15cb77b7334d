"""A trained run, used: loaded and answering a prompt or replaying a sample (``chat.py``,
``packline chat``), and exported as a PEFT adapter, a merged Hugging Face checkpoint or, for
the megatron backend, the command that runs Bridge's own export (``export.py``,
``packline export``)."""
