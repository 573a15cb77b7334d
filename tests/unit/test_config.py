from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from packline.rules.megatron import megatron_problems
from pipelines.cli import main
from schemas.config import (
    PROJECT_ROOT,
    Algorithm,
    Packer,
    PackingConfig,
    TrainBackend,
    load_config,
)
from schemas.errors import UserError
from tests.unit.test_megatron_overrides import processor_stand_in

SHIPPED = sorted((PROJECT_ROOT / "configs").glob("*.yaml"))


def cluster_stand_ins(path: Path, tmp_path: Path) -> list[str]:
    """Cluster configs name a processor dir on the cluster's filesystem: a local stand-in
    holding the image processor config the overrides read the geometry from."""
    raw = yaml.safe_load(path.read_text())
    if (raw.get("processor") or {}).get("path"):
        return [f"processor.path={processor_stand_in(tmp_path)}"]
    return []


@pytest.mark.parametrize("path", SHIPPED, ids=[p.name for p in SHIPPED])
def test_shipped_config_loads_and_validates(path: Path, tmp_path: Path):
    cfg = load_config(path, cluster_stand_ins(path, tmp_path))
    assert cfg.name
    assert cfg.packing.seq_length % cfg.packing.alignment == 0
    if cfg.train.backend == TrainBackend.megatron:
        assert megatron_problems(cfg) == []


def test_shipped_yaml_keys_each_have_a_comment():
    for path in SHIPPED:
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            stripped = line.strip()
            if not stripped or stripped.startswith("#") or stripped.endswith(":"):
                continue  # blank, comment, or a section header
            assert "#" in line, f"{path.name}:{lineno} has no comment: {line!r}"


def test_override_typo_and_type_error_reported_together():
    with pytest.raises(UserError) as info:
        load_config(None, ["packing.seq_lenght=4096", "train.max_steps=many"])
    problems = info.value.problems
    assert problems == [
        "override: unknown key 'packing.seq_lenght': 'seq_lenght' is not a setting of packing "
        "(did you mean 'seq_length'?)",
        "override: 'train.max_steps' = 'many' is invalid: expected int",
    ]


def test_cli_exit_2_lists_every_problem_without_traceback(capsys):
    code = main(["stage", "prepare", "packing.seq_lenght=4096", "train.max_steps=many", "lr=1"])
    err = capsys.readouterr().err
    assert code == 2
    assert "3 problem(s)" in err
    assert "seq_lenght" in err and "'many'" in err and "unknown key 'lr'" in err
    assert "Traceback" not in err


def test_yaml_unknown_key_missing_value_and_rule_reported_together(tmp_path: Path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("packing:\n  algoritm: ffd\n  seq_length: 0\ntrain:\n  lr: 1e-3\n")
    with pytest.raises(UserError) as info:
        load_config(bad)
    text = "\n".join(info.value.problems)
    assert "unknown key 'packing.algoritm'" in text and "did you mean 'algorithm'" in text
    assert "missing value: 'name' must be set" in text
    assert "packing.seq_length must be > 0, got 0" in text


def test_enum_override_lists_allowed_values():
    with pytest.raises(UserError) as info:
        load_config(None, ["packing.algorithm=greedy"])
    assert info.value.problems == [
        "override: 'packing.algorithm' = 'greedy' is invalid: expected one of 'ffd', 'bfd', "
        "'refined'"
    ]


def test_default_algorithm_is_refined_with_carry_over_and_every_shipped_config_packs_so(
    tmp_path: Path,
):
    assert load_config(None, []).packing.algorithm is Algorithm.refined
    assert PackingConfig().algorithm is Algorithm.refined
    assert PackingConfig().max_carry_rounds == 4 and PackingConfig().packer is Packer.packline
    for path in SHIPPED:  # the cluster configs too: Bridge trains on packline's packer
        cfg = load_config(path, cluster_stand_ins(path, tmp_path))
        assert cfg.packing.algorithm is Algorithm.refined, path.name
        assert cfg.packing.max_carry_rounds == 4 and cfg.packing.packer is Packer.packline


def test_overrides_apply_after_yaml():
    cfg = load_config(None, ["packing.algorithm=bfd", "lora.target_modules=[q_proj,v_proj]"])
    assert cfg.packing.algorithm is Algorithm.bfd
    assert cfg.lora.target_modules == ["q_proj", "v_proj"]


def test_project_interpolation_names_a_path_inside_the_checkout(tmp_path: Path):
    yaml_path = tmp_path / "mine.yaml"
    yaml_path.write_text("name: mine\nmodel:\n  path: ${project:models/other}\n")
    assert load_config(yaml_path).model.path == str(PROJECT_ROOT / "models" / "other")
    cfg = load_config(None, ["model.path=${project:models/tiny-base}"])
    assert cfg.model.path == str(PROJECT_ROOT / "models" / "tiny-base")


def test_a_base_rebuilt_at_the_same_path_changes_the_train_fingerprint(tmp_path: Path):
    from packline.fingerprints import stage_fingerprint

    base = tmp_path / "base"
    base.mkdir()
    (base / "config.json").write_text("{}")
    (base / "model.safetensors").write_bytes(b"a" * 8)
    cfg = load_config(None, [f"work_dir={tmp_path / 'w'}", f"model.path={base}"])
    first = stage_fingerprint(cfg, "train")
    assert stage_fingerprint(cfg, "train") == first
    (base / "model.safetensors").write_bytes(b"b" * 9)  # rebuilt: same config, new weights
    assert stage_fingerprint(cfg, "train") != first


def test_the_local_layout_is_not_part_of_the_train_fingerprint(tmp_path: Path):
    """A local run restarted on other ranks or split otherwise resumes its checkpoints (any
    layout loads any other's), so its run dir is kept; any other train setting, or the
    Megatron backend's layout, starts it over."""
    from packline.fingerprints import stage_fingerprint

    def fp(*overrides: str) -> str:
        return stage_fingerprint(load_config(None, [f"work_dir={tmp_path}", *overrides]), "train")

    base = fp()
    assert fp("train.nproc_per_node=2") == base
    moe = ("model.moe=true", "model.path=null", "packing.pad_to_max_length=true")
    ep2 = ("train.nproc_per_node=2", "train.parallel.expert_parallel=2")
    assert fp(*moe, *ep2) == fp(*moe)
    assert fp("train.global_batch_size=8") != base
    assert fp("train.num_workers=1") != base  # the loader's state is per worker


@pytest.mark.parametrize(
    ("tp", "cp", "sp", "expected"),
    [
        (1, 1, False, 1),
        (1, 2, False, 4),
        (4, 1, True, 4),
        (2, 2, True, 4),
        (4, 2, True, 8),
        (4, 3, True, 12),
    ],
)
def test_alignment_is_lcm_of_cp_and_sp_terms(tp, cp, sp, expected):
    cfg = PackingConfig(
        tensor_parallel=tp, context_parallel=cp, sequence_parallel=sp, seq_length=2400
    )
    assert cfg.alignment == expected


def test_add_and_delete_work_in_free_form_maps_and_say_what_to_write_elsewhere():
    cfg = load_config(None, ["+executor.slurm.env.HF_HOME=/data/hf"])
    assert cfg.executor.slurm.env == {"HF_HOME": "/data/hf"}
    both = ["+executor.slurm.env.A=1", "+executor.slurm.env.B=2", "~executor.slurm.env.A"]
    assert load_config(None, both).executor.slurm.env == {"B": "2"}
    with pytest.raises(UserError) as info:
        load_config(None, ["+packing.seq_lenght=1", "+packing.seq_length=1", "~train.lr"])
    assert info.value.problems == [
        "override: unknown key 'packing.seq_lenght': 'seq_lenght' is not a setting of packing "
        "(did you mean 'seq_length'?); keys can be added only to executor.slurm.env",
        "override '+packing.seq_length=1': '+' adds a key that is not there, and "
        "'packing.seq_length' is: write packing.seq_length=1",
        "override '~train.lr': '~' deletes a key of a free-form map (executor.slurm.env); "
        "'train.lr' is a setting, which always has a value: set it (train.lr=VALUE), or leave "
        "it out of the config for its default",
    ]


def test_config_command_prints_the_resolved_yaml_and_where_values_came_from(capsys):
    assert main(["config", "packing.seq_length=1024", "+executor.slurm.env.A=b"]) == 0
    out = capsys.readouterr().out
    yaml_part = out.split("set by the config file")[0]
    assert load_config(None, ["packing.seq_length=1024"]).to_yaml().splitlines()[0] in yaml_part
    rows = {
        line.split("│")[1].strip(): [c.strip() for c in line.split("│")[2:-1]]
        for line in out.splitlines()
        if line.count("│") == 4
    }
    assert rows["packing.seq_length"] == ["1024", "override"]
    assert rows["executor.slurm.env.A"] == ["b", "override"]
    assert rows["packing.algorithm"] == ["refined", "tiny_cpu.yaml"]
    assert "train.grad_clip" not in rows  # left at its default
