"""Qwen3-VL helpers: image geometry (``vision``), the processor (``processor``: the built-in
tiny one, and loading any Qwen-VL dir without torchvision) and token counts (``lengths``).

Import the submodules directly; this package module imports nothing itself.
"""
