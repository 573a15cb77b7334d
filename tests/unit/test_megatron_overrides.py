"""The Megatron-Bridge overrides packline builds: their values, their strict application, and
that every key names a field of Bridge's config dataclasses (read from a pinned release's
source; Bridge itself cannot be imported here)."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from packline.megatron.overrides import (
    RECIPE_MODULE,
    apply_overrides,
    bridge_overrides,
    lora_target_modules,
    section_classes,
    unknown_field,
)
from packline.rules.megatron import megatron_problems
from schemas.config import PROJECT_ROOT, PipelineConfig, load_config
from schemas.errors import UserError
from tests.bridge_source import (
    CONTAINER,
    PINNED,
    ClassInfo,
    IndexUnreachable,
    SourceIndex,
    fetch_sources,
    unknown_keys,
)

DENSE = PROJECT_ROOT / "configs" / "qwen3_vl_8b_lora_1node.yaml"
MOE = PROJECT_ROOT / "configs" / "qwen3_vl_30b_a3b_lora_ep8_slurm.yaml"


#: Qwen3-VL's published image processor geometry (preprocessor_config.json).
QWEN3_VL_GEOMETRY = {
    "patch_size": 16,
    "merge_size": 2,
    "temporal_patch_size": 2,
    "size": {"shortest_edge": 65536, "longest_edge": 16777216},
}


def processor_stand_in(tmp_path: Path) -> Path:
    """A stand-in for the cluster's processor dir: its image processor config only (all the
    overrides and the Megatron rules read of it)."""
    out = tmp_path / "processor-stand-in"
    out.mkdir(exist_ok=True)
    (out / "preprocessor_config.json").write_text(json.dumps(QWEN3_VL_GEOMETRY))
    return out


def cluster_config(path: Path, tmp_path: Path, *overrides: str) -> PipelineConfig:
    """A shipped cluster config with a local work dir and processor stand-in."""
    processor = processor_stand_in(tmp_path)
    return load_config(
        path, [f"work_dir={tmp_path / 'work'}", f"processor.path={processor}", *overrides]
    )


@pytest.fixture(scope="module")
def bridge_index() -> SourceIndex:
    try:
        return SourceIndex(fetch_sources(), PROJECT_ROOT)
    except IndexUnreachable as exc:
        pytest.skip(f"cannot download the pinned Megatron-Bridge wheels from the index: {exc}")


def test_moe_overrides_ep8_alltoall_no_mtp_no_graphs_no_overlap(tmp_path: Path):
    o = bridge_overrides(cluster_config(MOE, tmp_path))
    assert o["model.expert_model_parallel_size"] == 8
    assert o["model.tensor_model_parallel_size"] == 1
    assert o["model.pipeline_model_parallel_size"] == 1
    assert o["model.context_parallel_size"] == 1
    assert o["model.mtp_num_layers"] == 0
    assert o["model.cuda_graph_impl"] == "none" and o["model.vision_cuda_graph_impl"] == "none"
    assert o["model.moe_token_dispatcher_type"] == "alltoall"
    assert o["model.overlap_moe_expert_parallel_comm"] is False
    assert o["model.delay_wgrad_compute"] is False
    assert o["dataset.pad_to_max_length"] is True  # EP > 1 packs fixed-width rows
    assert o["peft.target_modules"] == ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]


def test_native_packing_overrides_buffer_mbs1_per_token_loss_sum_reduction(tmp_path: Path):
    cfg = cluster_config(DENSE, tmp_path)
    o = bridge_overrides(cfg)
    assert o["dataset.packing_buffer_size"] == 16
    assert o["dataset.micro_batch_size"] == 1 and o["train.micro_batch_size"] == 1
    assert o["model.calculate_per_token_loss"] is True
    assert o["ddp.average_in_collective"] is False
    assert o["dataset.seq_length"] == o["model.seq_length"] == 4096
    # Bridge's ChatMLWebdataset view of prepare's shards
    assert o["dataset.path"] == str(tmp_path / "work" / "prepare" / "bridge.yaml")
    assert o["dataset.task_encoder.hf_processor_path"] == str(
        tmp_path / "work" / "connect" / "processor"
    )
    assert "model.expert_model_parallel_size" not in o  # dense: no MoE overrides
    unpacked = bridge_overrides(cluster_config(DENSE, tmp_path, "packing.enabled=false"))
    assert unpacked["dataset.packing_buffer_size"] is None


def test_the_geometry_connect_measured_with_reaches_the_task_encoder(tmp_path: Path):
    """The processor dir's geometry, or the config's processor.* in its place: never Bridge's
    own defaults (min 200,704 / max 1,003,520 pixels, patch 14)."""
    o = bridge_overrides(cluster_config(DENSE, tmp_path))
    encoder = {k: v for k, v in o.items() if k.startswith("dataset.task_encoder.")}
    assert encoder == {
        "dataset.task_encoder.hf_processor_path": str(tmp_path / "work/connect/processor"),
        "dataset.task_encoder.max_num_images": 10,
        "dataset.task_encoder.max_visual_tokens": 16384,
        # every pre-sampled frame (prepare rejects a video of more: Bridge's 60 would cut)
        "dataset.task_encoder.max_num_frames": 64,
        "dataset.task_encoder.min_pixels": 65536,
        "dataset.task_encoder.max_pixels": 16777216,
        "dataset.task_encoder.patch_size": 16,
        "dataset.task_encoder.temporal_patch_size": 2,
        "dataset.task_encoder.spatial_merge_size": 2,
    }
    set_in_config = bridge_overrides(
        cluster_config(DENSE, tmp_path, "processor.min_pixels=200704", "processor.patch_size=14")
    )
    assert set_in_config["dataset.task_encoder.min_pixels"] == 200704
    assert set_in_config["dataset.task_encoder.patch_size"] == 14
    assert set_in_config["dataset.task_encoder.max_pixels"] == 16777216


def test_weight_decay_reaches_the_optimizer_and_both_scheduler_fields(tmp_path: Path):
    """The scheduler writes every param group's weight_decay each step from its start/end
    values (the recipes set 0.033): the optimizer's alone would change nothing."""
    o = bridge_overrides(cluster_config(DENSE, tmp_path))
    assert o["optimizer.weight_decay"] == 0.0
    assert o["scheduler.start_weight_decay"] == o["scheduler.end_weight_decay"] == 0.0
    decayed = bridge_overrides(cluster_config(DENSE, tmp_path, "train.weight_decay=0.01"))
    assert decayed["optimizer.weight_decay"] == 0.01
    assert decayed["scheduler.start_weight_decay"] == decayed["scheduler.end_weight_decay"] == 0.01


def test_eval_micro_batch_is_the_dataset_micro_batch(tmp_path: Path):
    for path in (DENSE, MOE):
        o = bridge_overrides(cluster_config(path, tmp_path))
        assert o["validation.eval_micro_batch_size"] == o["dataset.micro_batch_size"] == 1


def test_moe_with_tp_sends_sequence_parallel_as_bridge_runs_it(tmp_path: Path):
    """Bridge's MoE provider turns SP on when TP > 1: packline sends it on, so Bridge's own
    alignment check sees the SP it will run with. A dense model keeps the setting."""
    moe = bridge_overrides(cluster_config(MOE, tmp_path, "packing.tensor_parallel=2"))
    assert moe["model.sequence_parallel"] is True
    dense = bridge_overrides(cluster_config(DENSE, tmp_path, "packing.tensor_parallel=2"))
    assert dense["model.sequence_parallel"] is False


def test_bridge_mlflow_logger_points_at_packline_store(tmp_path: Path):
    cfg = cluster_config(DENSE, tmp_path)
    o = bridge_overrides(cfg, mlflow_tags={"packline.launch_id": "42"})
    assert o["logger.mlflow_tracking_uri"] == f"sqlite:///{tmp_path / 'work' / 'mlflow.db'}"
    assert o["logger.mlflow_experiment"] == "qwen3_vl_8b_lora_1node"
    assert o["logger.mlflow_run_name"] == "train-megatron"
    assert o["logger.mlflow_tags"]["packline.launch_id"] == "42"
    server = cluster_config(DENSE, tmp_path, "mlflow.tracking_uri=http://127.0.0.1:5000")
    assert bridge_overrides(server)["logger.mlflow_tracking_uri"] == "http://127.0.0.1:5000"
    off = bridge_overrides(cluster_config(DENSE, tmp_path, "mlflow.enabled=false"))
    assert not any(k.startswith("logger.mlflow") for k in off)


def test_extra_overrides_apply_last_and_parse_json(tmp_path: Path):
    cfg = cluster_config(
        DENSE, tmp_path, "megatron.extra_overrides=[train.train_iters=7,logger.log_interval=5]"
    )
    o = bridge_overrides(cfg)
    assert o["train.train_iters"] == 7 and o["logger.log_interval"] == 5


def test_lora_targets_map_to_megatron_names_and_unknown_ones_are_listed(tmp_path: Path):
    cfg = cluster_config(DENSE, tmp_path, "lora.target_modules=[q_proj,o_proj,fc9,up_proj,bad]")
    with pytest.raises(UserError) as info:
        lora_target_modules(cfg)
    assert len(info.value.problems) == 2 and "'fc9'" in info.value.render()
    ok = cluster_config(DENSE, tmp_path, "lora.target_modules=[q_proj,k_proj,down_proj]")
    assert lora_target_modules(ok) == ["linear_qkv", "linear_fc2"]


def test_megatron_problems_listed_together(tmp_path: Path):
    cfg = cluster_config(
        DENSE,
        tmp_path,
        "model.path=null",
        "packing.packer=bridge",
        "packing.algorithm=bfd",
        "train.parallel.expert_parallel=4",
        "packing.pad_to_max_length=true",  # EP > 1 needs it (a validate guardrail)
        "train.global_batch_size=12",
        "executor.slurm.gpus_per_node=8",
    )
    problems = megatron_problems(cfg)
    assert any("model.path" in p for p in problems)
    assert any("ffd" in p for p in problems)
    assert any("packing.max_carry_rounds" in p for p in problems)  # bridge's packer: none
    assert any("model.moe" in p for p in problems)
    assert any("global_batch_size 12" in p for p in problems)
    assert megatron_problems(cluster_config(MOE, tmp_path)) == []
    moe_on_6 = megatron_problems(cluster_config(MOE, tmp_path), world_size=6)
    assert any("expert_parallel 8 does not divide" in p for p in moe_on_6)


def test_an_extra_override_may_not_change_the_geometry_connect_measured_with(tmp_path: Path):
    extra = "megatron.extra_overrides=[dataset.task_encoder.min_pixels=200704]"
    problems = megatron_problems(cluster_config(DENSE, tmp_path, extra))
    assert len(problems) == 1
    assert "dataset.task_encoder.min_pixels=200704" in problems[0]
    assert "processor.min_pixels" in problems[0]
    same = "megatron.extra_overrides=[dataset.task_encoder.min_pixels=65536]"
    assert megatron_problems(cluster_config(DENSE, tmp_path, same)) == []


@dataclass
class _Inner:
    b: int = 0


@dataclass
class _Root:
    a: _Inner = field(default_factory=_Inner)
    c: str = ""


def test_apply_overrides_sets_fields_and_refuses_unknown_keys_before_setting_any():
    root = _Root()
    apply_overrides(root, {"a.b": 3, "c": "x"})
    assert root.a.b == 3 and root.c == "x"
    with pytest.raises(ValueError) as info:
        apply_overrides(root, {"c": "y", "a.z": 1, "d": 2})
    assert "a.z" in str(info.value) and "'d'" in str(info.value)
    assert root.c == "x" and not hasattr(root.a, "z")  # nothing applied


@pytest.mark.parametrize("path", [DENSE, MOE], ids=["8b", "30b-a3b-ep8"])
def test_every_override_key_is_a_bridge_config_field(path: Path, tmp_path: Path, bridge_index):
    cfg = cluster_config(path, tmp_path)
    keys = list(bridge_overrides(cfg, mlflow_tags={"packline.launch_id": "1"}))
    assert unknown_keys(bridge_index, keys, section_classes(cfg)) == []
    # The recipe and the forward step the in-container entry imports exist too.
    recipes = bridge_index._load(RECIPE_MODULE)
    assert recipes is not None and cfg.megatron.recipe in recipes[1]
    step = bridge_index._module_file(f"megatron.bridge.training.{cfg.megatron.step_func}")
    assert step is not None
    assert "forward_step" in {
        n.name for n in ast.parse(step.read_text()).body if isinstance(n, ast.FunctionDef)
    }


def test_field_check_catches_a_misspelt_key(tmp_path: Path, bridge_index):
    cfg = cluster_config(MOE, tmp_path)
    bad = ["ddp.average_in_colective", "model.moe_token_dispatcher", "dataset.packing_buffer"]
    assert len(unknown_keys(bridge_index, bad, section_classes(cfg))) == 3


# --- the shipped table of Bridge's config fields (packline/megatron/fields.py) -----------------

FIELDS_MODULE = PROJECT_ROOT / "packline" / "megatron" / "fields.py"


def run_sections() -> dict[str, list[str]]:
    """Each ``section_classes`` prefix → the classes packline's runs put there (dense, MoE;
    packline's dataset or Bridge's)."""
    out: dict[str, list[str]] = {}
    for moe in ("false", "true"):
        for packer in ("packline", "bridge"):
            cfg = load_config(None, [f"model.moe={moe}", f"packing.packer={packer}"])
            for prefix, qualified in section_classes(cfg).items():
                out.setdefault(prefix, [])
                if qualified not in out[prefix]:
                    out[prefix].append(qualified)
    return out


def bridge_field_table(
    index: SourceIndex, sections: dict[str, list[str]]
) -> dict[str, tuple[tuple[str, ...], dict[str, str]]]:
    """ConfigContainer and every config dataclass reachable from it, read from the pinned
    source: qualified name → (its dataclass bases, {own field: the config dataclass it holds,
    or ""}). A field ``sections`` names (a union on Bridge's side) is followed into the
    classes listed there instead of its declared type; private fields are not followed;
    classes with no field at all (in them or their bases) are left out."""
    trees: dict[Path, ast.Module] = {}

    def qualified(info: ClassInfo) -> str:
        return f"{info.module}.{info.name}"

    def decorated(info: ClassInfo) -> bool:
        path = index._module_file(info.module)
        assert path is not None
        tree = trees.setdefault(path, ast.parse(path.read_text()))
        return any(
            "dataclass" in ast.unparse(d)
            for node in tree.body
            if isinstance(node, ast.ClassDef) and node.name == info.name
            for d in node.decorator_list
        )

    def bases(info: ClassInfo) -> list[ClassInfo]:
        found = (index.resolve(info, b) for b in info.bases)
        return [b for b in found if b is not None and is_config(b)]

    config_memo: dict[str, bool] = {}

    def is_config(info: ClassInfo) -> bool:
        key = qualified(info)
        if key not in config_memo:
            config_memo[key] = False  # a cycle is not a config
            config_memo[key] = decorated(info) or bool(bases(info))
        return config_memo[key]

    unfollowed = set()
    for prefix in sections:
        parent, _, name = prefix.rpartition(".")
        for owner in sections[parent] if parent else [CONTAINER]:
            unfollowed.add((owner, name))
    table: dict[str, tuple[tuple[str, ...], dict[str, str]]] = {}
    todo = [index.find(q) for q in [CONTAINER, *(c for cs in sections.values() for c in cs)]]
    while todo:
        info = todo.pop()
        assert info is not None
        if qualified(info) in table:
            continue
        own: dict[str, str] = {}
        for name, annotation in info.fields.items() if decorated(info) else ():
            nested = None
            if annotation is not None and not name.startswith("_"):
                if (qualified(info), name) not in unfollowed:
                    nested = index.resolve(info, annotation)
            if nested is not None and is_config(nested):
                own[name] = qualified(nested)
                todo.append(nested)
            else:
                own[name] = ""
        table[qualified(info)] = (tuple(qualified(b) for b in bases(info)), own)
        todo += bases(info)

    def has_fields(name: str) -> bool:
        base_names, own = table[name]
        return bool(own) or any(has_fields(b) for b in base_names)

    kept = {n for n in table if has_fields(n)}
    return {
        name: (
            tuple(b for b in base_names if b in kept),
            {f: (c if c in kept else "") for f, c in own.items()},
        )
        for name, (base_names, own) in sorted(table.items())
        if name in kept
    }


def field_table_source(table: dict[str, tuple[tuple[str, ...], dict[str, str]]]) -> str:
    """``packline/megatron/fields.py`` for ``table``: per class its bases, its plain fields as
    one space-separated string, and its fields holding a nested config dataclass."""
    lines = [
        '"""Megatron-Bridge\'s config dataclasses, as far as overrides reach into them: for its',
        "``ConfigContainer`` and every config dataclass reachable from it (with packline's",
        "``section_classes`` in place of the unions Bridge declares), the dataclass bases, the",
        "plain fields and the fields that hold a nested config dataclass. Only fields are listed,",
        "no values: ``packline.megatron.overrides`` checks every ``megatron.extra_overrides`` key",
        "against it without importing Bridge.",
        "",
        "Generated from the source of the pinned wheels",
        f"({', '.join(PINNED)}), and of packline's dataset for Bridge",
        "(packline/megatron/dataset.py), by tests/unit/test_megatron_overrides.py,",
        "which regenerates it and asserts it is equal. Do not edit: rewrite it with",
        "``PACKLINE_UPDATE_GOLDEN=1`` and",
        "",
        "    .venv/bin/python -m pytest tests/unit/test_megatron_overrides.py -k bridge_fields",
        '"""',
        "",
        "# ruff: noqa: E501 (generated: a qualified class name per line)",
        "",
        f"PINNED = {PINNED!r}",
        f"CONTAINER = {CONTAINER!r}",
        "",
        "#: qualified class name → (dataclass bases, its plain fields space-separated,",
        "#: {field: the config dataclass it holds})",
        "CLASSES: dict[str, tuple[tuple[str, ...], str, dict[str, str]]] = {",
    ]
    for name, (base_names, own) in table.items():
        plain = " ".join(f for f, c in own.items() if not c)
        nested = {f: c for f, c in own.items() if c}
        lines.append(f"    {name!r}: (")
        lines.append("        (" + "".join(f"{b!r}, " for b in base_names).rstrip() + "),")
        chunks = textwrap.wrap(plain, 80, break_long_words=False) or [""]
        if len(chunks) == 1:
            lines.append(f"        {chunks[0]!r},")
        else:
            lines.append("        (")
            lines += [f"            {(' ' if i else '') + c!r}" for i, c in enumerate(chunks)]
            lines.append("        ),")
        if nested:
            lines.append("        {")
            lines += [f"            {f!r}: {c!r}," for f, c in nested.items()]
            lines.append("        },")
        else:
            lines.append("        {},")
        lines.append("    ),")
    lines.append("}")
    return "\n".join(lines) + "\n"


def shipped_field_table() -> dict[str, tuple[tuple[str, ...], dict[str, str]]]:
    from packline.megatron.fields import CLASSES

    return {
        name: (bases, {**dict.fromkeys(plain.split(), ""), **nested})
        for name, (bases, plain, nested) in CLASSES.items()
    }


def test_bridge_fields_table_is_the_pinned_source_regenerated(bridge_index):
    table = bridge_field_table(bridge_index, run_sections())
    if os.environ.get("PACKLINE_UPDATE_GOLDEN") == "1":
        FIELDS_MODULE.write_text(field_table_source(table))
        ruff = Path(sys.executable).parent / "ruff"
        subprocess.run([str(ruff), "format", "-q", str(FIELDS_MODULE)], check=True)
        pytest.skip(f"rewrote {FIELDS_MODULE}: review its diff")
    from packline.megatron import fields as bridge_fields

    assert bridge_fields.PINNED == PINNED and bridge_fields.CONTAINER == CONTAINER
    got = shipped_field_table()
    assert {n: (b, sorted(f.items())) for n, (b, f) in got.items()} == {
        n: (b, sorted(f.items())) for n, (b, f) in table.items()
    }, "regenerate with PACKLINE_UPDATE_GOLDEN=1"


@pytest.mark.parametrize("path", [DENSE, MOE], ids=["8b", "30b-a3b-ep8"])
def test_shipped_field_table_agrees_with_the_pinned_source(path: Path, tmp_path, bridge_index):
    """What validate checks an extra override against (no Bridge import) says what the
    source says: every override key packline sends, the keys the Bridge rules read, and
    misspelt ones."""
    cfg = cluster_config(path, tmp_path)
    classes = section_classes(cfg)
    good = [
        *bridge_overrides(cfg, mlflow_tags={"packline.launch_id": "1"}),
        "model.dist_train.use_dist_train",
        "dist.eval_context_parallel_size",
        "dataset.do_validation",
        "comm_overlap.tp_comm_overlap_cfg.qkv_dgrad",
    ]
    assert unknown_keys(bridge_index, good, classes) == []
    assert [k for k in good if unknown_field(k, classes) is not None] == []
    # Bridge's legacy in-batch packing: fields of its own dataset config, not of packline's
    legacy = ["dataset.enable_in_batch_packing", "dataset.defer_in_batch_packing_to_step"]
    own = section_classes(cluster_config(path, tmp_path, "packing.packer=bridge"))
    assert unknown_keys(bridge_index, legacy, own) == []
    assert [unknown_field(k, own) for k in legacy] == [None, None]
    assert len(unknown_keys(bridge_index, legacy, classes)) == 2
    assert all("PacklineEnergonDataset" in unknown_field(k, classes) for k in legacy)
    bad = ["ddp.average_in_colective", "model.dist_train.use_dist", "dataset.task_encoder.x"]
    assert len(unknown_keys(bridge_index, bad, classes)) == 3
    assert [unknown_field(k, classes) for k in bad] == [
        "DistributedDataParallelConfig at ddp has no field 'average_in_colective' (did you "
        "mean 'average_in_collective'?)",
        "DistTrainConfig at model.dist_train has no field 'use_dist' (did you mean "
        "'use_dist_train'?)",
        "QwenVLEnergonTaskEncoderConfig at dataset.task_encoder has no field 'x'",
    ]


#: The modules that run only where Megatron-Bridge is (the container; Bridge main's vendored data
#: path in tests): they import it at the top. No other module imports them at the top.
BRIDGE_SIDE = ("packline/megatron/dataset.py", "packline/megatron/task_encoder.py")
#: The modules that call Bridge in the container and import it there, inside functions: the
#: train stage's backend, and ``packline export``'s adapter export (AutoBridge).
BRIDGE_CALLERS = ("stages/train_megatron.py", "packline/serving/export.py")


def test_only_train_megatron_and_export_import_bridge_and_only_inside_functions():
    importers, bridge_side_importers = {}, {}
    bridge_side = {m.removesuffix(".py").replace("/", ".") for m in BRIDGE_SIDE}
    packages = ("packline", "stages", "schemas", "pipelines")
    for path in (p for pkg in packages for p in (PROJECT_ROOT / pkg).rglob("*.py")):
        tree = ast.parse(path.read_text())
        top_level = set(tree.body)
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            rel = str(path.relative_to(PROJECT_ROOT))
            if any(n.startswith("megatron.bridge") for n in names):
                importers.setdefault(rel, []).append(node in top_level)
            if any(n in bridge_side for n in names):
                bridge_side_importers.setdefault(rel, []).append(node in top_level)
    assert sorted(importers) == sorted([*BRIDGE_CALLERS, *BRIDGE_SIDE])
    for caller in BRIDGE_CALLERS:
        assert not any(importers[caller]), caller  # lazily, inside functions
    for rel, top in bridge_side_importers.items():
        assert rel in BRIDGE_SIDE or not any(top), f"{rel} imports a Bridge-side module at the top"


def test_train_megatron_refuses_a_config_it_cannot_run_before_importing_bridge(tmp_path: Path):
    import sys

    from stages.train_megatron import train_megatron

    cfg = cluster_config(DENSE, tmp_path, "model.path=null")
    with pytest.raises(UserError, match="model.path"):
        train_megatron(cfg, "fingerprint")
    # A runnable config outside the container: told where it runs, not a traceback.
    with pytest.raises(UserError, match="NeMo container"):
        train_megatron(cluster_config(DENSE, tmp_path), "fingerprint")
    assert "megatron.bridge" not in sys.modules


def test_bridge_run_is_nested_under_the_stage_run_by_launch_id(tmp_path: Path):
    from mlflow.tracking import MlflowClient

    from packline.tracking import PARENT_TAG, Tracker, tracking_uri
    from stages.train_megatron import LAUNCH_TAG, _nest_bridge_run

    cfg = cluster_config(DENSE, tmp_path)
    stage = Tracker.start(cfg, "train")
    client = MlflowClient(tracking_uri=tracking_uri(cfg))
    exp = client.get_experiment_by_name(cfg.name)
    # What Bridge's logger leaves behind (tags from bridge_overrides, one metric).
    tags = bridge_overrides(cfg, mlflow_tags={LAUNCH_TAG: "77"})["logger.mlflow_tags"]
    bridge_run = client.create_run(exp.experiment_id, run_name="train-megatron", tags=tags)
    client.log_metric(bridge_run.info.run_id, "lm loss", 1.5)
    other = client.create_run(exp.experiment_id, tags={LAUNCH_TAG: "78"})
    metrics = _nest_bridge_run(cfg, "77", stage.run_id)
    assert metrics == {"megatron/lm loss": 1.5}
    assert client.get_run(bridge_run.info.run_id).data.tags[PARENT_TAG] == stage.run_id
    assert PARENT_TAG not in client.get_run(other.info.run_id).data.tags


# The Bridge override each validated ``megatron.*`` (or ``train.parallel.*``) setting travels in.
VALIDATED = {
    "calculate_per_token_loss": "model.calculate_per_token_loss",
    "average_in_collective": "ddp.average_in_collective",
    "parallel.pipeline_parallel": "model.pipeline_model_parallel_size",
    "cuda_graph_impl": "model.cuda_graph_impl",
    "vision_cuda_graph_impl": "model.vision_cuda_graph_impl",
    "max_num_images": "dataset.task_encoder.max_num_images",
}
VALIDATED_MOE = {
    "parallel.expert_parallel": "model.expert_model_parallel_size",
    "mtp_num_layers": "model.mtp_num_layers",
    "overlap_moe_expert_parallel_comm": "model.overlap_moe_expert_parallel_comm",
    "delay_wgrad_compute": "model.delay_wgrad_compute",
}


@pytest.mark.parametrize("path", [DENSE, MOE], ids=["8b_1node", "30b_a3b_ep8"])
def test_overrides_send_exactly_what_validate_passed(path: Path, tmp_path: Path):
    from schemas.rules import config_findings

    cfg = cluster_config(path, tmp_path)
    assert [f.text for f in config_findings(cfg) if f.severity == "error"] == []
    o = bridge_overrides(cfg)
    pairs = {**VALIDATED, **(VALIDATED_MOE if cfg.model.moe else {})}
    for setting, key in pairs.items():
        section, _, name = setting.rpartition(".")
        value = getattr(cfg.train.parallel if section else cfg.megatron, name)
        assert o[key] == getattr(value, "value", value), (setting, key)
    assert o["dataset.micro_batch_size"] == o["train.micro_batch_size"] == 1
    assert o["dataset.pad_to_max_length"] == (
        cfg.packing.pad_to_max_length or cfg.train.parallel.expert_parallel > 1
    )


def test_a_setting_validate_rejects_never_reaches_bridge(tmp_path: Path):
    with pytest.raises(UserError) as info:
        cluster_config(MOE, tmp_path, "megatron.mtp_num_layers=1", "megatron.cuda_graph_impl=local")
    text = info.value.render()
    assert "megatron.mtp_num_layers is 1" in text and "megatron.cuda_graph_impl is 'local'" in text
