"""The layers, read from the source with ``ast`` (nothing here imports the packages it reads):
``pipelines/`` only wires (no module over ``MAX_PIPELINE_LINES`` lines), the library
(``packline/``) never imports ``stages/`` or ``pipelines/``, and no first-party modules import
each other in a cycle. Imports inside functions count like those at the top of a module;
only those under ``if TYPE_CHECKING:`` do not (annotations: they never run)."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("packline", "schemas", "stages", "pipelines")
MAX_PIPELINE_LINES = 300


def _modules() -> dict[str, Path]:
    """Every first-party module by dotted name (a package by its ``__init__.py``)."""
    modules = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join(parts)] = path
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _import_nodes(node: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement under ``node``, at any depth, except under TYPE_CHECKING."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.Import | ast.ImportFrom):
            yield child
        elif isinstance(child, ast.If) and _is_type_checking(child.test):
            for other in child.orelse:
                yield from _import_nodes(other)
        else:
            yield from _import_nodes(child)


def _imported_names(name: str, path: Path) -> list[str]:
    """The absolute dotted names a module imports: ``import a.b`` gives ``a.b``, ``from a
    import b`` gives ``a.b`` (a submodule, or a name defined in ``a``)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    names = []
    for node in _import_nodes(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
            continue
        base = node.module or ""
        if node.level:  # relative: from .x import y, from .. import z
            anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
            base = ".".join([*anchor, *([base] if base else [])])
        names += [f"{base}.{alias.name}" for alias in node.names]
    return names


def _graph() -> dict[str, set[str]]:
    """Module -> the first-party modules it imports: the module named, or for a name defined
    in a module or package (``from packline.packing import align_up``), that one. The
    packages above a module are not counted: Python has them in ``sys.modules`` before it
    runs the module, so ``packline.packing.forecast`` importing ``packline.packing.selection``
    is no cycle with ``packline/packing/__init__.py`` importing ``forecast``."""
    modules = _modules()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for imported in _imported_names(name, path):
            target = imported if imported in modules else imported.rpartition(".")[0]
            if target in modules and target != name:
                graph[name].add(target)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each as one
    cycle through all of them where there is one, else as its members, sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(components)


def _a_cycle(graph: dict[str, set[str]], members: list[str]) -> list[str]:
    """One import path from the first member back to itself, inside the component."""
    start, inside = members[0], set(members)
    paths = {start: [start]}
    queue = [start]
    while queue:
        node = queue.pop(0)
        for nxt in sorted(graph[node] & inside):
            if nxt == start:
                return [*paths[node], start]
            if nxt not in paths:
                paths[nxt] = [*paths[node], nxt]
                queue.append(nxt)
    raise AssertionError(f"{members} is no cycle")  # a component of > 1 always has one


def test_imports_are_read_at_any_depth_relative_ones_resolved(tmp_path: Path):
    source = tmp_path / "mod.py"
    source.write_text(
        "from typing import TYPE_CHECKING\n"
        "import packline.qwen.vision\n"
        "from .sibling import name\n"
        "from .. import other\n"
        "if TYPE_CHECKING:\n"
        "    from schemas.config import PipelineConfig\n"
        "def f():\n"
        "    from stages.base import stage_dir\n"
    )
    assert _imported_names("packline.qwen.mod", source) == [
        "typing.TYPE_CHECKING",
        "packline.qwen.vision",
        "packline.qwen.sibling.name",
        "packline.other",
        "stages.base.stage_dir",
    ]
    graph = _graph()
    assert "stages.base" in graph["stages.train_megatron"]
    # imported inside a function only
    assert "packline.train.expert_parallel" in graph["packline.train.engine"]
    assert "schemas.rules" in graph["schemas.config"]
    assert "schemas.config" not in graph["schemas.rules"]  # annotations only


def test_pipeline_modules_only_wire():
    long = {
        name: n
        for name, path in _modules().items()
        if name.split(".")[0] == "pipelines"
        and (n := len(path.read_text().splitlines())) > MAX_PIPELINE_LINES
    }
    assert not long, f"pipelines/ modules over {MAX_PIPELINE_LINES} lines: {long}"


def test_the_library_imports_no_stage_and_no_pipeline():
    found = sorted(
        f"{name} imports {imported}"
        for name, path in _modules().items()
        if name.split(".")[0] == "packline"
        for imported in _imported_names(name, path)
        if imported.split(".")[0] in ("stages", "pipelines")
    )
    assert not found, "packline/ must not import stages/ or pipelines/:\n" + "\n".join(found)


def test_no_import_cycle_between_first_party_modules():
    graph = _graph()
    cycles = [" -> ".join(_a_cycle(graph, members)) for members in _cycles(graph)]
    assert not cycles, "import cycles (each: one path through its modules):\n" + "\n".join(cycles)


def test_schemas_is_the_bottom_floor():
    found = sorted(
        f"{name} imports {imported}"
        for name, path in _modules().items()
        if name.split(".")[0] == "schemas"
        for imported in _imported_names(name, path)
        if imported.split(".")[0] in ("packline", "stages", "pipelines")
    )
    assert not found, "schemas/ must import no packline/, stages/ or pipelines/:\n" + "\n".join(
        found
    )


def test_loading_and_refusing_a_config_imports_no_heavy_library():
    """A config error prints its table before torch could even load (in a fresh
    interpreter: what was imported, by ``sys.modules``, not by time)."""
    import subprocess
    import sys

    script = (
        "import sys\n"
        "from schemas.config import load_config\n"
        "from schemas.errors import UserError\n"
        "load_config(None, [])\n"
        "try:\n"
        "    load_config(None, ['packing.seq_length=-1'])\n"
        "except UserError as exc:\n"
        "    assert 'packing.seq_length' in str(exc), exc\n"
        "heavy = ('torch', 'transformers', 'megatron', 'nemo_run', 'mlflow', 'pandas')\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in heavy))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, check=True
    )
    assert done.stdout.strip() == "[]", done.stdout + done.stderr


#: Every other module of stages/ is a stage page (train's cluster backend is one too); only
#: the runner wires pages together (it picks train's backend).
MAX_STAGE_LINES = 300
NOT_STAGES = ("stages.base", "stages.runner", "stages")


def test_a_stage_imports_no_other_stage_only_stages_base():
    found = sorted(
        f"{name} imports {imported}"
        for name, path in _modules().items()
        if name.split(".")[0] == "stages" and name not in NOT_STAGES
        for imported in _imported_names(name, path)
        if imported.split(".")[0] == "stages" and not imported.startswith("stages.base")
    )
    assert not found, "a stage imports another stage:\n" + "\n".join(found)


def test_a_stage_module_is_a_page():
    long = {
        name: n
        for name, path in _modules().items()
        if name.split(".")[0] == "stages"
        and (n := len(path.read_text().splitlines())) > MAX_STAGE_LINES
    }
    assert not long, f"stages/ modules over {MAX_STAGE_LINES} lines: {long}"


def test_rule_books_are_made_in_schemas_rules_and_packline_rules_only():
    homes = sorted(
        name
        for name, path in _modules().items()
        if "RuleBook()" in path.read_text() and name.split(".")[0] != "tests"
    )
    assert homes == [
        "packline.rules.data",
        "packline.rules.megatron",
        "packline.rules.model",
        "schemas.rules",
    ]


#: Where a source format may be named outside packline/sources/ and schemas/: an Energon
#: dataset is adopted in place, not read into shards (prepare's adoption, its dataset path).
SOURCE_KIND_ELSEWHERE = {"stages.prepare": {"energon"}, "packline.catalog": {"energon"}}


def test_a_source_format_is_one_module_of_packline_sources():
    """Every ``data.source`` kind has its reader in a module of ``packline/sources/`` (the
    registry names it), and no other library or stage module branches on a kind: adding a
    format is its module (and its kind and detection in schemas/config.py) plus its tests."""
    from packline.sources import READERS
    from schemas.choices import SourceKind

    assert set(READERS) == set(SourceKind)
    modules = _modules()
    for kind, where in READERS.items():
        module = where.partition(":")[0]
        assert module.startswith("packline.sources.") and module in modules, (kind, module)
    members = "|".join(k.name for k in SourceKind)
    named = re.compile(rf"SourceKind\.({members})\b")
    found = {
        name: set(named.findall(path.read_text()))
        for name, path in modules.items()
        if name.split(".")[0] in ("packline", "stages", "pipelines")
        and not name.startswith("packline.sources")
    }
    found = {name: kinds for name, kinds in found.items() if kinds}
    assert found == SOURCE_KIND_ELSEWHERE, found


#: Packages of packline/ that hold one feature whole rather than one floor: the shapes set's
#: words stand under the tiny tokenizer (packline/qwen), its base's pretraining over the
#: trainer. Each of their modules is a room of its own.
FEATURES = ("packline.shapes",)


def _room(name: str) -> str:
    """The library's rooms: a subpackage of packline/ (a layer: packing, qwen, energon, ...)
    counts as one, a top module or a module of a :data:`FEATURES` package as one."""
    parts = name.split(".")
    if parts[0] != "packline" or len(parts) == 1:
        return parts[0]
    package = ".".join(parts[:2])
    if package in FEATURES or not ROOT.joinpath(*parts[:2]).is_dir():
        return name
    return package


def test_the_library_is_floors_no_import_runs_up():
    """Between the library's rooms (a subpackage, or a top module) the imports run one way:
    no two rooms import each other, by any path. So the rooms stand on floors (the order
    the imports give) and nothing on a lower floor reaches a higher one: the simulator of
    ``packline/packing/`` imports no assembly from the config above it."""
    rooms: dict[str, set[str]] = {}
    for name, targets in _graph().items():
        if name.split(".")[0] != "packline":
            continue
        room = _room(name)
        rooms.setdefault(room, set())
        rooms[room] |= {_room(t) for t in targets if t.split(".")[0] == "packline"} - {room}
    graph = {room: targets & set(rooms) for room, targets in rooms.items()}
    cycles = [" -> ".join(_a_cycle(graph, members)) for members in _cycles(graph)]
    assert not cycles, "rooms of packline/ importing each other:\n" + "\n".join(cycles)


def test_the_packing_simulator_takes_integers_not_the_config():
    """``packline/packing/`` below everything it packs for: no torch in its selection,
    carry-over, balance and forecast, no config, no other room of packline/ but the names
    of the metrics; the assembly from the config is ``packline/forecast.py``'s."""
    pure = ("selection", "carry", "balance", "forecast")
    found = []
    for name, path in _modules().items():
        if not name.startswith("packline.packing"):
            continue
        for imported in _imported_names(name, path):
            top = imported.split(".")[0]
            other_room = top == "packline" and _room(imported) not in (
                "packline.packing",
                "packline.metrics",
            )
            if (
                other_room
                or imported.startswith("schemas.")
                and not imported.startswith("schemas.choices")
            ):
                found.append(f"{name} imports {imported}")
            if name.rpartition(".")[2] in pure and top in ("torch", "numpy", "pandas"):
                found.append(f"{name} imports {imported}")
    assert not found, "\n".join(found)


#: Where a train backend may be compared by name: its spec (packline/backends/). Who packs
#: with it (``packing.packer``) is the megatron backend's own business (packline/megatron/).
BACKEND_HOMES = {
    "TrainBackend": ("packline.backends",),
    "Packer": ("packline.backends", "packline.megatron"),
}


def _compared_choices(path: Path) -> set[str]:
    """The choices a module compares against by name: ``TrainBackend``/``Packer`` members
    in a comparison (``is``, ``==``, ``in`` ...), and ``.train.backend`` itself compared."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, ast.Compare):
            continue
        for operand in (node.left, *node.comparators):
            for sub in ast.walk(operand):
                if isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name):
                    if sub.value.id in BACKEND_HOMES:
                        found.add(sub.value.id)
                if isinstance(sub, ast.Attribute) and sub.attr == "backend":
                    if isinstance(sub.value, ast.Attribute) and sub.value.attr == "train":
                        found.add("TrainBackend")
    return found


def test_only_a_backends_spec_compares_train_backend():
    """Every caller asks the spec (``packline.backends.backend(cfg)``): no module of the
    library, the stages or the pipelines branches on ``train.backend`` or ``packing.packer``
    outside their homes (schemas/ defines them and checks what load_config refuses)."""
    found = sorted(
        f"{name} compares {choice}"
        for name, path in _modules().items()
        if name.split(".")[0] in ("packline", "stages", "pipelines")
        for choice in _compared_choices(path)
        if not name.startswith(BACKEND_HOMES[choice])
    )
    assert not found, "ask packline.backends.backend(cfg) instead:\n" + "\n".join(found)
    assert _compared_choices(ROOT / "schemas" / "rules.py") == {"TrainBackend"}  # it sees


#: The library modules that still ask the catalog for another stage's artefact, and why; a
#: stage hands every other one its paths, tables and values. The list only shrinks.
CATALOG_READERS = {
    "packline.megatron.overrides": "Bridge's config names prepare's and connect's paths",
    "packline.train.setup": "training_stream(cfg): the tutorial's look at a prepared work dir",
    "packline.serving.chat": "packline chat: a finished run's adapter, processor and data",
    "packline.serving.export": "packline export: the config validate checked",
    "packline.backends": "export_run's default target",
    "packline.workdir": "a dir holding a stage's completion record counts as packline's own",
}


def test_no_library_module_computes_another_stages_path():
    """Where each artefact of a work dir lies is ``packline/catalog.py``'s; the stages read
    and write through it (``stages/base.py`` re-exports it) and hand the library what it
    needs. Library modules outside :data:`CATALOG_READERS` never import it or spell a
    stage's file names."""
    found = sorted(
        f"{name} imports {imported}"
        for name, path in _modules().items()
        if name.split(".")[0] == "packline"
        and name != "packline.catalog"
        and name not in CATALOG_READERS
        for imported in _imported_names(name, path)
        if imported.startswith("packline.catalog")
    )
    assert not found, "take the path from the stage instead:\n" + "\n".join(found)
    spelled = sorted(
        name
        for name, path in _modules().items()
        if name.split(".")[0] == "packline"
        and name != "packline.catalog"
        and re.search(r"\"(lengths\.parquet|forecast\.json|_COMPLETE\.json)\"", path.read_text())
    )
    assert not spelled, f"these spell a stage's file name (use the catalog's): {spelled}"


#: Issue 45's targets for the walk of the whole config (tests/config_walk.py says how it is
#: measured): from train's entry point ≤ 20 modules and ≤ 20 returns, from connect's ≤ 12
#: and ≤ 12. Reached: train 9 modules, 13 returns; connect 9 and 12 (the stage framework's
#: record bookkeeping, stages.base, takes the work dir, not the config).
WALK_CEILINGS = {"train": (20, 20), "connect": (12, 12)}


def test_the_whole_config_travels_through_few_modules():
    from tests.config_walk import ENTRY_POINTS, Walk

    walk = Walk(ROOT)
    for stage, start in ENTRY_POINTS.items():
        modules, returns = walk.walk(start)
        most_modules, most_returns = WALK_CEILINGS[stage]
        assert modules[0] == start[0]
        assert len(modules) <= most_modules, (stage, modules)
        assert len(returns) <= most_returns, (stage, returns)


def test_the_config_walk_follows_the_whole_config_not_its_slices(tmp_path: Path):
    """The walk follows a call handed the config itself (by any name it was bound to,
    through ``module.f``, an imported name, ``self.f`` and a class), and stops at a slice."""
    from tests.config_walk import Walk

    (tmp_path / "stages").mkdir()
    (tmp_path / "packline").mkdir()
    (tmp_path / "stages" / "s.py").write_text(
        "from packline import a\nfrom packline.b import B\n"
        "def entry(cfg: PipelineConfig):\n"
        "    a.f(cfg)\n    B(cfg.packing)\n    a.f(cfg)\n    here(cfg)\n"
        "def here(c):\n    B(c)\n"
    )
    (tmp_path / "packline" / "a.py").write_text(
        "from packline.c import g\ndef f(config):\n    g(config.train)\n"
    )
    (tmp_path / "packline" / "b.py").write_text(
        "from packline.c import g\nclass B:\n"
        "    def __init__(self, cfg):\n        self.go(cfg)\n"
        "    def go(self, cfg):\n        g(cfg)\n"
    )
    (tmp_path / "packline" / "c.py").write_text("def g(x):\n    pass\n")
    modules, returns = Walk(tmp_path).walk(("stages.s", "entry"))
    assert modules == ["stages.s", "packline.a", "packline.b", "packline.c"]
    assert [(a[0], b[0]) for a, b in returns] == [
        ("stages.s", "packline.a"),
        ("stages.s", "packline.b"),
        ("packline.b", "packline.c"),
    ]
