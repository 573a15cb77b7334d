"""How far the whole config travels: a walk, read from the source with ``ast``, of every call
that hands a function the whole :class:`~schemas.config.PipelineConfig`.

The walk starts at a stage's entry point and follows each call whose arguments include the
config itself (a name bound to it: a parameter annotated ``PipelineConfig`` or one that
received it), into the function called when the source says which one it is (a function
of the same module, an imported name, ``module.function``, ``Class.method``,
``self.method``, or a class, whose ``__init__``/``from_config`` it enters). A slice of the
config (``cfg.packing``, a ``TrainerSettings``) ends the walk: the callee was handed what it
needs, not the whole. Each function is entered once.

Two figures (issue 45 item 2):

- ``modules``: the first-party modules the walk enters, the start's included;
- ``returns``: the calls it follows from one module into another; each one hands control
  back to a module already left when the callee returns, so this is how often a reader
  following the config must come back to a page they left.

``python -m tests.config_walk [ROOT]`` prints both for each stage's entry point, for the
checkout at ROOT (default: this one), so an old commit can be measured the same way
(``git worktree add /tmp/old <rev>``)."""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass, field
from pathlib import Path

PACKAGES = ("packline", "schemas", "stages", "pipelines")
CONFIG_CLASS = "PipelineConfig"

Function = tuple[str, str]
"""(dotted module, qualified name in it: ``f`` or ``Class.f``)."""


def _modules(root: Path) -> dict[str, Path]:
    modules = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join(parts)] = path
    return modules


@dataclass
class _Module:
    name: str
    functions: dict[str, ast.FunctionDef | ast.AsyncFunctionDef] = field(default_factory=dict)
    classes: set[str] = field(default_factory=set)
    imports: dict[str, str] = field(default_factory=dict)
    """local name -> absolute dotted name (a module, or ``module.name``)."""


def _read(name: str, path: Path) -> _Module:
    tree = ast.parse(path.read_text(), str(path))
    module = _Module(name)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                module.imports[alias.asname or alias.name.split(".")[0]] = (
                    alias.name if alias.asname else alias.name.split(".")[0]
                )
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            for alias in node.names:
                module.imports[alias.asname or alias.name] = f"{base}.{alias.name}"
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            module.functions[node.name] = node
        elif isinstance(node, ast.ClassDef):
            module.classes.add(node.name)
            for item in node.body:
                if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
                    module.functions[f"{node.name}.{item.name}"] = item
    return module


class Walk:
    """The walk over one checkout's source."""

    def __init__(self, root: Path) -> None:
        self.modules = {name: _read(name, path) for name, path in _modules(root).items()}

    def _defined(self, dotted: str, depth: int = 0) -> Function | None:
        """``module.name`` -> where ``name`` is defined (through re-exports)."""
        module_name, _, name = dotted.rpartition(".")
        module = self.modules.get(module_name)
        if module is None or depth > 8:
            return None
        if name in module.functions or name in module.classes:
            return module_name, name
        if name in module.imports:
            return self._defined(module.imports[name], depth + 1)
        return None

    def _entry(self, target: Function) -> Function | None:
        """A class called or named enters its ``__init__`` (else ``from_config``)."""
        module_name, name = target
        module = self.modules[module_name]
        if name in module.functions:
            return target
        for method in ("__init__", "from_config"):
            if f"{name}.{method}" in module.functions:
                return module_name, f"{name}.{method}"
        return None

    def _callee(self, module: _Module, qualname: str, call: ast.Call) -> Function | None:
        func = call.func
        if isinstance(func, ast.Name):
            if func.id in module.functions or func.id in module.classes:
                target: Function | None = (module.name, func.id)
            elif func.id in module.imports:
                target = self._defined(module.imports[func.id])
            else:
                return None
        elif isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
            owner = func.value.id
            if owner in ("self", "cls") and "." in qualname:
                target = (module.name, f"{qualname.split('.')[0]}.{func.attr}")
            elif owner in module.classes:
                target = (module.name, f"{owner}.{func.attr}")
            elif owner in module.imports:
                dotted = module.imports[owner]
                if dotted in self.modules:  # module.function
                    target = self._defined(f"{dotted}.{func.attr}")
                else:  # ImportedClass.method
                    cls = self._defined(dotted)
                    target = (cls[0], f"{cls[1]}.{func.attr}") if cls else None
            else:
                return None
        else:
            return None
        return self._entry(target) if target else None

    @staticmethod
    def _config_params(node: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
        return {
            a.arg
            for a in [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs]
            if a.annotation is not None and CONFIG_CLASS in ast.unparse(a.annotation)
        }

    @staticmethod
    def _bound(
        node: ast.FunctionDef | ast.AsyncFunctionDef, call: ast.Call, names: set[str]
    ) -> set[str]:
        """The callee's parameters that receive the config in ``call``."""
        params = [a.arg for a in [*node.args.posonlyargs, *node.args.args]]
        if params and params[0] in ("self", "cls"):
            params = params[1:]
        bound = set()
        for i, arg in enumerate(call.args):
            if isinstance(arg, ast.Name) and arg.id in names and i < len(params):
                bound.add(params[i])
        for kw in call.keywords:
            if isinstance(kw.value, ast.Name) and kw.value.id in names and kw.arg:
                bound.add(kw.arg)
        return bound

    def walk(self, start: Function) -> tuple[list[str], list[tuple[Function, Function]]]:
        """The modules entered (in order) and the cross-module calls followed."""
        seen: set[Function] = set()
        modules: list[str] = []
        hops: list[tuple[Function, Function]] = []

        def visit(fn: Function, names: set[str]) -> None:
            seen.add(fn)
            if fn[0] not in modules:
                modules.append(fn[0])
            module = self.modules[fn[0]]
            node = module.functions[fn[1]]
            names = names | self._config_params(node)
            for call in ast.walk(node):
                if not isinstance(call, ast.Call):
                    continue
                passed = [*call.args, *(k.value for k in call.keywords)]
                if not any(isinstance(a, ast.Name) and a.id in names for a in passed):
                    continue
                callee = self._callee(module, fn[1], call)
                if callee is None or callee in seen:
                    continue
                if callee[0] != fn[0]:
                    hops.append((fn, callee))
                target = self.modules[callee[0]].functions[callee[1]]
                visit(callee, self._bound(target, call, names))

        start_node = self.modules[start[0]].functions[start[1]]
        visit(start, self._config_params(start_node))
        return modules, hops


ENTRY_POINTS: dict[str, Function] = {
    "train": ("stages.train", "train"),
    "connect": ("stages.connect", "connect"),
}
"""Each stage's entry point named in issue 45 (``train_lora``/``connect_processor`` before the
stage-verb rename)."""


def main(argv: list[str]) -> None:
    root = Path(argv[0]) if argv else Path(__file__).resolve().parents[1]
    walk = Walk(root)
    for stage, (module, name) in ENTRY_POINTS.items():
        if name not in walk.modules[module].functions:  # an older name
            name = {"train": "train_lora", "connect": "connect_processor"}[stage]
        modules, hops = walk.walk((module, name))
        print(f"{stage:8s} {len(modules):3d} modules {len(hops):3d} returns  from {module}:{name}")


if __name__ == "__main__":
    main(sys.argv[1:])
