"""Megatron-Bridge's config dataclasses read from its source, without importing it.

Bridge needs Python 3.12, CUDA and transformer-engine, so the tests cannot import it. Instead
they download pinned wheels of megatron-bridge and megatron-core (``pip download --no-deps``,
cached under ``tests/.cache/``) and read the field names of the config dataclasses with ``ast``,
following base classes through each module's imports.
"""

from __future__ import annotations

import ast
import fcntl
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

#: The Bridge release checked against, and the Megatron-Core it was released with.
PINNED = ("megatron-bridge==0.6.2", "megatron-core==0.19.2")
CACHE = Path(__file__).resolve().parent / ".cache" / "megatron-src"
CONTAINER = "megatron.bridge.training.config.ConfigContainer"


class IndexUnreachable(RuntimeError):
    """pip could not reach the package index (no network): the check cannot run here."""


@contextmanager
def cache_lock(cache: Path = CACHE) -> Iterator[None]:
    """Hold the cache dir's lock: the suite's xdist workers (``make test`` runs two) may ask
    for the sources at once, and one of them downloads and unpacks while the others wait."""
    cache.mkdir(parents=True, exist_ok=True)
    with (cache / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def fetch_sources(cache: Path = CACHE) -> Path:
    """Download (once) and unpack the pinned wheels; return the dir holding ``megatron/``."""
    with cache_lock(cache):
        return _fetch_sources(cache)


def _fetch_sources(cache: Path) -> Path:
    src = cache / "src"
    stamp = cache / ("+".join(PINNED) + ".ok")
    if stamp.is_file():
        return src
    wheels = cache / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
        "--disable-pip-version-check", "--only-binary=:all:", "--python-version", "3.12",
        "--platform", "manylinux_2_28_x86_64", "-d", str(wheels), *PINNED,
    ]  # fmt: skip
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if result.returncode != 0:
        text = result.stderr + result.stdout
        network = ("Could not find a version", "No matching distribution", "connection", "resolve")
        if any(n.lower() in text.lower() for n in network):
            raise IndexUnreachable(text.strip().splitlines()[-1] if text.strip() else "pip failed")
        raise RuntimeError(f"pip download failed:\n{text}")
    for wheel in sorted(wheels.glob("*.whl")):
        with zipfile.ZipFile(wheel) as zf:
            for name in zf.namelist():
                if name.startswith("megatron/") and name.endswith(".py"):
                    zf.extract(name, src)
    stamp.write_text("\n".join(PINNED))
    return src


@dataclass
class ClassInfo:
    module: str
    name: str
    fields: dict[str, ast.expr | None]  # name → annotation
    bases: list[ast.expr]
    imports: dict[str, str] = field(default_factory=dict)  # local name → qualified name


class SourceIndex:
    """Classes of source trees by qualified name, with their (inherited) dataclass fields. A
    module is looked up in ``roots`` in order (the pinned Bridge source, then the project's own,
    whose dataset for Bridge subclasses Bridge's classes)."""

    def __init__(self, *roots: Path):
        self.roots = roots
        self._modules: dict[str, tuple[dict[str, ClassInfo], dict[str, str]] | None] = {}

    def _module_file(self, module: str) -> Path | None:
        for root in self.roots:
            base = root / Path(*module.split("."))
            for path in (base.with_suffix(".py"), base / "__init__.py"):
                if path.is_file():
                    return path
        return None

    def _load(self, module: str) -> tuple[dict[str, ClassInfo], dict[str, str]] | None:
        if module in self._modules:
            return self._modules[module]
        path = self._module_file(module)
        if path is None:
            self._modules[module] = None
            return None
        tree = ast.parse(path.read_text())
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        imports: dict[str, str] = {}
        classes: dict[str, ClassInfo] = {}
        for node in tree.body:
            if isinstance(node, ast.ImportFrom):
                origin = node.module or ""
                if node.level:
                    parts = package.split(".")
                    parent = ".".join(parts[: len(parts) - node.level + 1])
                    origin = f"{parent}.{origin}" if origin else parent
                for alias in node.names:
                    imports[alias.asname or alias.name] = f"{origin}.{alias.name}"
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    imports[alias.asname or alias.name.split(".")[0]] = (
                        alias.name if alias.asname else alias.name.split(".")[0]
                    )
            elif isinstance(node, ast.ClassDef):
                fields_: dict[str, ast.expr | None] = {}
                for item in node.body:
                    if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                        if "ClassVar" not in ast.unparse(item.annotation):
                            fields_[item.target.id] = item.annotation
                classes[node.name] = ClassInfo(module, node.name, fields_, node.bases, imports)
        self._modules[module] = (classes, imports)
        return self._modules[module]

    def find(self, qualified: str, _depth: int = 0) -> ClassInfo | None:
        """The class named ``module.Class`` (following re-exports)."""
        module, _, name = qualified.rpartition(".")
        loaded = self._load(module)
        if loaded is None or _depth > 10:
            return None
        classes, imports = loaded
        if name in classes:
            return classes[name]
        if name in imports:
            return self.find(imports[name], _depth + 1)
        return None

    def resolve(self, info: ClassInfo, expr: ast.expr) -> ClassInfo | None:
        """The class an annotation or base expression names, seen from ``info``'s module."""
        if isinstance(expr, ast.Subscript):  # Optional[X], List[X]: the single class inside
            return self.resolve(info, expr.slice)
        if isinstance(expr, ast.BinOp):  # X | None
            left = self.resolve(info, expr.left)
            return left or self.resolve(info, expr.right)
        if isinstance(expr, ast.Constant) and isinstance(expr.value, str):
            return self.resolve(info, ast.parse(expr.value, mode="eval").body)
        dotted = ast.unparse(expr)
        head, _, rest = dotted.partition(".")
        loaded = self._load(info.module)
        assert loaded is not None
        classes, imports = loaded
        if not rest and head in classes:
            return classes[head]
        if head in imports:
            return self.find(f"{imports[head]}.{rest}" if rest else imports[head])
        return None

    def all_fields(self, info: ClassInfo) -> dict[str, tuple[ClassInfo, ast.expr | None]]:
        """Own and inherited fields: name → (declaring class, annotation)."""
        out: dict[str, tuple[ClassInfo, ast.expr | None]] = {}
        for base in reversed(info.bases):
            parent = self.resolve(info, base)
            if parent is not None:
                out.update(self.all_fields(parent))
        out.update({n: (info, a) for n, a in info.fields.items()})
        return out


def unknown_keys(index: SourceIndex, keys: list[str], section_classes: dict[str, str]) -> list[str]:
    """Every dotted key whose path does not name a field, with the reason."""
    root = index.find(CONTAINER)
    assert root is not None, f"{CONTAINER} not found in the pinned source"
    problems = []
    for key in keys:
        info, parts = root, key.split(".")
        for i, part in enumerate(parts):
            known = index.all_fields(info)
            if part not in known:
                problems.append(f"{key}: {info.module}.{info.name} has no field {part!r}")
                break
            if i == len(parts) - 1:
                break
            prefix = ".".join(parts[: i + 1])
            if prefix in section_classes:
                nxt = index.find(section_classes[prefix])
            else:
                owner, annotation = known[part]
                nxt = index.resolve(owner, annotation) if annotation is not None else None
            if nxt is None:
                problems.append(f"{key}: cannot resolve the class of {prefix}")
                break
            info = nxt
    return problems
