"""``packline export`` with ``train.backend: megatron``: the command that runs Megatron-Bridge's
export in the training container (golden text), and the Bridge calls it makes there, checked
against Bridge main's source (the vendored archive, read with ``ast``, never imported).

Regenerate the golden file after an intended change (then review the diff):

    PACKLINE_UPDATE_GOLDEN=1 .venv/bin/python -m pytest tests/unit/test_export_bridge.py
"""

from __future__ import annotations

import ast
import inspect
import os
import tarfile
import textwrap
from pathlib import Path

import pytest

from packline.backends import export_run
from packline.serving import export
from packline.serving.export import latest_iteration
from pipelines.cli import main
from schemas.config import PROJECT_ROOT
from schemas.errors import UserError
from tests.bridge_data import MAIN_ARCHIVE
from tests.unit.test_megatron_overrides import cluster_config

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "export_megatron.txt"
UPDATE = os.environ.get("PACKLINE_UPDATE_GOLDEN") == "1"
CONFIG = PROJECT_ROOT / "configs" / "qwen3_vl_8b_lora_1node.yaml"
AUTO_BRIDGE = "src/megatron/bridge/models/conversion/auto_bridge.py"


def _validated(cfg) -> None:
    """What the validate stage leaves: the resolved config it checked."""
    out = cfg.work_path / "validate"
    out.mkdir(parents=True, exist_ok=True)
    (out / "pipeline.yaml").write_text(cfg.to_yaml())


def test_export_megatron_prints_the_container_command_golden(tmp_path):
    cfg = cluster_config(CONFIG, tmp_path)
    _validated(cfg)
    adapter = export_run(cfg, Path("/shared/exports/qwen3-vl-8b-adapter"))
    merged = export_run(cfg, Path("/shared/exports/qwen3-vl-8b-merged"), merge=True)
    text = "\n\n".join([adapter, merged]).replace(str(cfg.work_path), "<WORK>") + "\n"
    assert str(tmp_path) not in text
    if UPDATE:
        GOLDEN.write_text(text)
    assert text == GOLDEN.read_text(), f"regenerate with PACKLINE_UPDATE_GOLDEN=1 ({GOLDEN})"
    assert not Path("/shared/exports").exists()  # only printed: nothing written here


def test_export_megatron_cli_prints_command_and_writes_nothing(tmp_path, capsys):
    cfg = cluster_config(CONFIG, tmp_path)
    _validated(cfg)
    to = tmp_path / "out"
    args = [str(CONFIG), f"work_dir={cfg.work_path}", f"processor.path={cfg.processor.path}"]
    assert main(["export", *args, "--to", str(to), "--merge"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("run in the container:\nsrun --nodes=1 --ntasks=1")
    work = cfg.work_path
    assert f"--container-mounts=/shared:/shared,{work}:{work},{tmp_path}:{tmp_path} " in out
    assert out.rstrip().endswith(f"--to {to} --merge")
    assert not to.exists()


def test_export_megatron_without_validated_config_exits_2(tmp_path):
    cfg = cluster_config(CONFIG, tmp_path)
    with pytest.raises(UserError, match="no validated config"):
        export_run(cfg, tmp_path / "out")


def test_latest_iteration_is_the_highest_iter_dir(tmp_path):
    for name in ("iter_0000020", "iter_0000100", "iter_0000040", "iter_notes"):
        (tmp_path / name).mkdir()
    assert latest_iteration(tmp_path).name == "iter_0000100"
    with pytest.raises(UserError, match="no Bridge checkpoint"):
        latest_iteration(tmp_path / "iter_0000020")


def _bridge_source(path: str) -> ast.Module:
    with tarfile.open(MAIN_ARCHIVE) as tar:
        return ast.parse(tar.extractfile(path).read().decode())


def _method(tree: ast.Module, cls: str, name: str) -> ast.FunctionDef:
    klass = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls)
    return next(n for n in klass.body if isinstance(n, ast.FunctionDef) and n.name == name)


def _bridge_calls() -> dict[str, ast.Call]:
    """The calls :func:`packline.serving.export.bridge_export` makes on ``AutoBridge`` and on the
    bridge it makes, by method name."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(export.bridge_export)))
    calls = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            owner = node.func.value
            if isinstance(owner, ast.Name) and owner.id in ("AutoBridge", "bridge"):
                calls[node.func.attr] = node
    return calls


def test_bridge_calls_match_bridge_main_signatures():
    """Each Bridge method packline calls in the container exists on Bridge main's
    ``AutoBridge`` (``containers/Dockerfile``'s commit), takes the keywords packline passes,
    and gets every argument it requires; ``from_hf_pretrained`` is a classmethod and
    ``megatron.bridge`` exports ``AutoBridge``."""
    tree = _bridge_source(AUTO_BRIDGE)
    calls = _bridge_calls()
    assert set(calls) == {"from_hf_pretrained", "export_adapter_ckpt"}
    for name, call in calls.items():
        fn = _method(tree, "AutoBridge", name)
        params = [a.arg for a in fn.args.args][1:]  # without self / cls
        required = params[: len(params) - len(fn.args.defaults)]
        passed = params[: len(call.args)] + [k.arg for k in call.keywords]
        assert all(k.arg in params for k in call.keywords), (name, params)
        assert set(required) <= set(passed), (name, required, passed)
    decorators = [
        ast.unparse(d) for d in _method(tree, "AutoBridge", "from_hf_pretrained").decorator_list
    ]
    assert "classmethod" in decorators
    init = _bridge_source("src/megatron/bridge/__init__.py")
    assert any(
        isinstance(n, ast.ImportFrom) and any(a.name == "AutoBridge" for a in n.names)
        for n in init.body
    )
