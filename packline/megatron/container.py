"""What packline knows of the Megatron-Bridge it runs on the cluster: the Bridge main commit
``containers/Dockerfile`` installs (the first one that packs natively is older), the image it
builds, and :func:`bridge_problem`, which says from an installed Bridge's files, never
importing them, whether that Bridge can run the megatron backend. The train job checks it
before any Bridge import; the image's build runs it as its last step."""

from __future__ import annotations

import ast
import importlib
import importlib.util
from collections.abc import Callable
from pathlib import Path
from typing import Any

NATIVE_PACKING_COMMIT = "46d7e9f4f9ee71832ab24c13228aecbf09a0df46"
"""Megatron-Bridge main, "enable native Energon packing for Qwen3-VL" (#5285, 2026-08-10): the
oldest Bridge commit the megatron backend can pack with."""
BRIDGE_COMMIT = "067f987df03b8355b03192d88d70f1709fedf51a"
"""The Megatron-Bridge main commit ``containers/Dockerfile`` installs (its ``BRIDGE_COMMIT``
build arg; tests/unit/test_megatron_container.py checks they agree): a descendant of
:data:`NATIVE_PACKING_COMMIT`, the newest of the main snapshot packline's Bridge facts were
read from (2026-08-22)."""
PACKLINE_IMAGE = f"packline-bridge:{BRIDGE_COMMIT[:9]}"
"""The tag ``containers/Dockerfile`` is built as (the cluster configs' container image)."""
BRIDGE_FIX = (
    f"use the image containers/Dockerfile builds ({PACKLINE_IMAGE}: the NeMo container plus "
    f"Megatron-Bridge main at {BRIDGE_COMMIT[:9]}) as executor.slurm.container_image — the "
    f"megatron backend needs a Bridge at or after main commit {NATIVE_PACKING_COMMIT[:9]} "
    "(PR #5285, native Energon packing), which no release has yet"
)

SpecLookup = Callable[[str], Any]
"""``importlib.util.find_spec``-style: a module name → its spec, or None."""


def _defines_method(path: Path, cls: str, method: str) -> bool:
    """Whether the module file at ``path`` defines class ``cls`` with ``method`` in its body
    (read with ``ast``, never imported)."""
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (OSError, SyntaxError, UnicodeDecodeError):
        return False
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == cls:
            return any(
                isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef) and n.name == method
                for n in node.body
            )
    return False


def bridge_problem(
    *, packing: bool, find_spec: SpecLookup = importlib.util.find_spec
) -> str | None:
    """Why the Megatron-Bridge that ``find_spec`` finds cannot run the megatron backend (None:
    it can), with the fix. Only ``megatron.bridge`` itself is looked up; its files are read,
    not imported: importing Bridge ≤ 0.5's missing energon builder would end in a
    ModuleNotFoundError, and 0.6.x would train unpacked."""
    try:
        spec = find_spec("megatron.bridge")
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        return (
            "train.backend megatron needs megatron.bridge, which is not installed here: it runs "
            f"inside the cluster's NeMo container (--executor slurm); {BRIDGE_FIX}"
        )
    root = Path(locations[0])
    if not (root / "data" / "builders" / "energon.py").is_file():
        return (
            f"the Megatron-Bridge at {root} has no megatron.bridge.data.builders.energon: it is "
            "0.5 or older (nvcr.io/nvidia/nemo:26.06 carries 0.5.0), with no Energon dataset "
            f"builder and no native packing; {BRIDGE_FIX}"
        )
    encoder = root / "models" / "qwen_vl" / "data" / "energon.py"
    if packing and not _defines_method(encoder, "QwenVLTaskEncoder", "select_samples_to_pack"):
        return (
            f"the Megatron-Bridge at {root} has no QwenVLTaskEncoder.select_samples_to_pack "
            f"({encoder}): a release (0.6.x) that would train unpacked; {BRIDGE_FIX}, or set "
            "packing.enabled=false"
        )
    return None
