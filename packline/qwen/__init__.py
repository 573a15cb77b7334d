"""Qwen3-VL helpers: image geometry (``vision``), the processor (``processor``: the built-in
tiny one, a standard ``Qwen3VLProcessor`` dir, and loading any Qwen-VL dir), token counts
(``lengths``), encoding (``encode``), M-RoPE positions (``rope``), tiny models (``model``),
released architectures (``real_configs``), THD attention (``attention``) and the guarded
packed forward (``forward``).

Import the submodules directly; this package module imports nothing itself.
"""
