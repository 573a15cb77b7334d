"""The image the megatron backend needs, and the job's check for it.

``containers/Dockerfile`` cannot be built here (no container engine): it is parsed, and its
pinned Megatron-Bridge commit must be the one ``packline/megatron/container.py`` names. The job's
Bridge check reads the installed Bridge's files without importing them; it is run on real
package dirs on ``sys.path`` laid out like Bridge 0.5 (the file names of its tag) and like the
pinned 0.6.2 release (its own ``energon.py`` sources, copied unchanged).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from packline.megatron.container import (
    BRIDGE_COMMIT,
    NATIVE_PACKING_COMMIT,
    PACKLINE_IMAGE,
    bridge_problem,
)
from packline.qwen.processor import copy_tiny_processor
from schemas.config import PROJECT_ROOT, load_config
from schemas.errors import UserError
from stages.train_megatron import train_megatron
from tests.bridge_source import IndexUnreachable, fetch_sources

DOCKERFILE = PROJECT_ROOT / "containers" / "Dockerfile"
HELPER = PROJECT_ROOT / "containers" / "packline_requirements.py"
CLUSTER_CONFIGS = ["qwen3_vl_8b_lora_1node", "qwen3_vl_30b_a3b_lora_ep8_slurm"]
TORCH_WORD = re.compile(r"(?<![\w.-])torch(vision|audio)?(?![\w-])")


def instructions(path: Path = DOCKERFILE) -> list[tuple[str, str]]:
    """(KEYWORD, arguments) of each Dockerfile instruction: comments dropped, continuation
    lines joined, a heredoc's body kept out."""
    out: list[tuple[str, str]] = []
    lines = iter(path.read_text().splitlines())
    pending = ""
    for line in lines:
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        text = pending + line
        pending = ""
        heredoc = re.search(r"<<-?'?(\w+)'?", text)
        if heredoc:
            for body in lines:
                if body.strip() == heredoc.group(1):
                    break
        keyword, _, args = text.strip().partition(" ")
        out.append((keyword.upper(), " ".join(args.split())))
    return out


def build_args() -> dict[str, str]:
    return dict(a.partition("=")[::2] for k, a in instructions() if k == "ARG")


def install_commands() -> list[str]:
    """Every shell command of a RUN that installs packages."""
    commands = []
    for keyword, args in instructions():
        if keyword == "RUN":
            for cmd in re.split(r"&&|;|\|\|", args):
                if re.search(r"\b(pip|uv|conda|mamba|apt-get|apt)\b.*\binstall\b", cmd):
                    commands.append(cmd.strip())
    return commands


def test_dockerfile_pins_the_bridge_commit_train_megatron_names():
    args = build_args()
    assert re.fullmatch(r"[0-9a-f]{40}", BRIDGE_COMMIT)
    assert args["BRIDGE_COMMIT"] == BRIDGE_COMMIT
    assert re.fullmatch(r"[0-9a-f]{40}", args["MCORE_COMMIT"])
    # The oldest commit with native packing (#5285), the one the job's messages name.
    assert re.fullmatch(r"46d7e9f4f[0-9a-f]{31}", NATIVE_PACKING_COMMIT)
    assert PACKLINE_IMAGE == f"packline-bridge:{BRIDGE_COMMIT[:9]}"
    assert f"-t {PACKLINE_IMAGE} ." in DOCKERFILE.read_text()  # the build line it documents


def test_dockerfile_starts_from_the_nemo_container():
    steps = instructions()
    assert ("ARG", "BASE_IMAGE=nvcr.io/nvidia/nemo:26.06") in steps
    assert [a for k, a in steps if k == "FROM"] == ["${BASE_IMAGE}"]


def test_dockerfile_never_installs_torch_and_every_pip_install_keeps_it():
    commands = install_commands()
    assert len(commands) == 4, commands
    for cmd in commands:
        assert not TORCH_WORD.search(cmd), cmd
        assert "pip install" in cmd and ("--no-deps" in cmd or "-c keep-torch.txt" in cmd), cmd
    bridge = [c for c in commands if "Megatron-Bridge" in c]
    assert len(bridge) == 2 and all("--no-deps" in c for c in bridge)
    assert any("qwen-vl-utils==${QWEN_VL_UTILS_VERSION}" in c for c in commands)
    assert any(c.endswith("--no-deps -e ./src") for c in commands)  # packline itself


def test_requirements_helper_leaves_out_torch_and_pins_the_installed_one():
    deps = tomllib.loads((PROJECT_ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    out = subprocess.run(
        [sys.executable, str(HELPER), "requirements", str(PROJECT_ROOT / "pyproject.toml")],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split("\n")[:-1]
    assert out == [d for d in deps if not re.match(r"torch(vision|audio)?\b", d)]
    assert len(out) == len(deps) - 2 and not any(TORCH_WORD.match(d) for d in out)
    keep = subprocess.run(
        [sys.executable, str(HELPER), "constraints"], capture_output=True, text=True, check=True
    ).stdout.split()
    assert f"torch=={importlib.metadata.version('torch')}" in keep
    assert f"torchvision=={importlib.metadata.version('torchvision')}" in keep


@pytest.mark.parametrize("name", CLUSTER_CONFIGS)
def test_cluster_configs_run_the_image_the_dockerfile_builds(name: str):
    text = (PROJECT_ROOT / "configs" / f"{name}.yaml").read_text()
    assert OmegaConf.create(text).executor.slurm.container_image == PACKLINE_IMAGE
    line = next(ln for ln in text.splitlines() if "container_image:" in ln)
    assert "containers/Dockerfile" in line  # its comment says where the image comes from


def test_docs_name_the_bridge_commit_and_the_image():
    for doc in ("README.md", "tutorial/09-slurm.md", "containers/README.md"):
        text = (PROJECT_ROOT / doc).read_text()
        assert NATIVE_PACKING_COMMIT[:9] in text and BRIDGE_COMMIT[:9] in text, doc
        assert PACKLINE_IMAGE in text and "containers/Dockerfile" in text, doc


# -- the job's Bridge check -----------------------------------------------------------------

# Megatron-Bridge v0.5.0's data/builders/ (no energon.py) and no models/qwen_vl/data/.
BRIDGE_05 = [
    "megatron/bridge/__init__.py",
    "megatron/bridge/package_info.py",
    "megatron/bridge/data/__init__.py",
    "megatron/bridge/data/builders/__init__.py",
    "megatron/bridge/data/builders/finetuning_dataset.py",
    "megatron/bridge/data/builders/hf_dataset.py",
]
# Files of the pinned 0.6.2 wheel the check reads, copied unchanged.
BRIDGE_06_SOURCES = [
    "megatron/bridge/data/builders/energon.py",
    "megatron/bridge/models/qwen_vl/data/energon.py",
]


def _empty_files(root: Path, names: list[str]) -> None:
    for name in names:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text("")


@pytest.fixture
def on_path(tmp_path: Path, monkeypatch):
    """A package dir put first on ``sys.path``; nothing under ``megatron.bridge`` may be
    imported by the check."""
    root = tmp_path / "site"
    root.mkdir()
    monkeypatch.syspath_prepend(str(root))
    yield root
    assert not [m for m in sys.modules if m.startswith("megatron.bridge")]


@pytest.fixture(scope="module")
def bridge_06() -> Path:
    try:
        return fetch_sources()
    except IndexUnreachable as exc:
        pytest.skip(f"cannot download the pinned Megatron-Bridge wheels from the index: {exc}")


def test_bridge_check_finds_the_package_dir_on_sys_path(on_path: Path):
    _empty_files(on_path, BRIDGE_05)
    spec = importlib.util.find_spec("megatron.bridge")
    assert Path(spec.origin) == on_path / "megatron/bridge/__init__.py"


def test_bridge_05_is_refused_with_the_fix_before_any_import(on_path: Path):
    _empty_files(on_path, BRIDGE_05)
    for packing in (True, False):  # the energon builder is needed either way
        problem = bridge_problem(packing=packing)
        assert "has no megatron.bridge.data.builders.energon" in problem
        assert "0.5 or older" in problem and "nemo:26.06" in problem
        assert f"containers/Dockerfile builds ({PACKLINE_IMAGE}" in problem
        assert NATIVE_PACKING_COMMIT[:9] in problem


def test_bridge_06_without_select_samples_to_pack_is_refused_when_packing(
    on_path: Path, bridge_06: Path
):
    _empty_files(on_path, ["megatron/bridge/__init__.py"])
    for name in BRIDGE_06_SOURCES:
        (on_path / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(bridge_06 / name, on_path / name)
    source = (on_path / BRIDGE_06_SOURCES[1]).read_text()
    assert "class QwenVLTaskEncoder(" in source and "select_samples_to_pack" not in source
    problem = bridge_problem(packing=True)
    assert "has no QwenVLTaskEncoder.select_samples_to_pack" in problem
    assert "0.6.x" in problem and "packing.enabled=false" in problem
    assert f"containers/Dockerfile builds ({PACKLINE_IMAGE}" in problem
    assert bridge_problem(packing=False) is None  # it has the builder: it trains unpacked


def test_bridge_with_native_packing_passes(on_path: Path):
    """Laid out like main from 46d7e9f4f: the builder, and the method in the class body."""
    _empty_files(on_path, ["megatron/bridge/__init__.py", BRIDGE_06_SOURCES[0]])
    encoder = on_path / BRIDGE_06_SOURCES[1]
    encoder.parent.mkdir(parents=True)
    encoder.write_text(
        "class QwenVLTaskEncoder:\n    def select_samples_to_pack(self, samples):\n        ...\n"
    )
    assert bridge_problem(packing=True) is None


def test_no_bridge_names_where_the_job_runs(tmp_path: Path):
    problem = bridge_problem(packing=True, find_spec=lambda name: None)
    assert "not installed here" in problem and PACKLINE_IMAGE in problem


def test_train_megatron_stops_on_bridge_05_with_the_fix(on_path: Path, tmp_path: Path):
    """The job's own path: config rules pass, then the Bridge check stops it, before any
    Bridge import (``on_path`` asserts nothing was imported)."""
    _empty_files(on_path, BRIDGE_05)
    processor = copy_tiny_processor(tmp_path / "processor")  # stands in for the real one
    cfg = load_config(
        PROJECT_ROOT / "configs" / "qwen3_vl_8b_lora_1node.yaml",
        [f"work_dir={tmp_path / 'work'}", f"processor.path={processor}"],
    )
    with pytest.raises(UserError, match="no megatron.bridge.data.builders.energon") as err:
        train_megatron(cfg, "fingerprint")
    assert "containers/Dockerfile" in str(err.value)
