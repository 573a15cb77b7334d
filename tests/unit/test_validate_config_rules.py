"""The config-only rules of the validate stage (schemas/rules.py): each broken rule is
refused by ``load_config`` with its exact message and the CLI exits 2; all broken rules are
listed at once. The Megatron rules on the overrides Bridge gets (packline/megatron/overrides.py),
each alone, and ``run --executor slurm`` refusing what validate lists. Also: the LoRA target
matcher agrees with PEFT, the model is built on the meta device only, and the buffer memory
estimate's worked example."""

from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import OmegaConf
from peft import LoraConfig, get_peft_model
from peft.tuners.lora import LoraLayer

from packline.energon.packing import buffered_sample_bytes
from packline.megatron.overrides import bridge_alignment, bridge_run
from packline.qwen.model import build_meta_model, build_tiny_model, tiny_config
from packline.qwen.processor import copy_tiny_processor, load_processor
from packline.qwen.real_configs import real_config
from packline.rules.megatron import MEGATRON_RULES, megatron_findings, megatron_problems
from packline.train.setup import lora_target_matches
from pipelines.cli import main
from schemas.config import PROJECT_ROOT, TINY_BASE, load_config
from schemas.errors import UserError
from schemas.rules import CONFIG_RULES, config_findings
from tests.unit.test_megatron_overrides import DENSE, MOE, cluster_config

SHIPPED = sorted((PROJECT_ROOT / "configs").glob("*.yaml"))
#: warnings a shipped config is documented to raise (configs/README.md); none so far
EXPECTED_CONFIG_WARNINGS: dict[str, list[str]] = {}
MEGATRON = "train.backend=megatron"

# (rule id, overrides that break it, the exact problem line)
CONFIG_ERRORS = [
    (
        "packing.micro_batch",
        ["train.micro_batch_size=2"],
        "train.micro_batch_size is 2, but a packed micro-batch is exactly one row; fix: set "
        "train.micro_batch_size=1 (pack more conversations per row instead)",
    ),
    (
        "packing.alignment",  # schemas/config.py PackingConfig.rules, surfaced by validate
        [
            "packing.context_parallel=2",
            "packing.tensor_parallel=2",
            "packing.sequence_parallel=true",
            "packing.seq_length=2050",
        ],
        "packing.seq_length 2050 is not a multiple of the alignment m = lcm(2·CP, CP·TP) = 4 "
        "(TP 2, CP 2, SP True); use 2052 or 2048",
    ),
    (
        "packing.buffer",  # schemas/config.py PackingConfig.rules
        ["packing.packing_buffer_size=0"],
        "packing.packing_buffer_size must be > 0, got 0; fix: set packing.packing_buffer_size "
        "to a value > 0 (default 64)",
    ),
    (
        "packing.context_length",  # schemas/rules.py, the model's config.json
        ["packing.seq_length=131072"],
        f"packing.seq_length 131,072 exceeds the model's context length 128,000 "
        f"(max_position_embeddings of {TINY_BASE}/config.json): a row is one sequence to the "
        "model, and positions past its context were never trained; fix: set "
        "packing.seq_length <= 128000",
    ),
    (
        "processor.pixel_bounds",  # schemas/rules.py, the processor's own bounds
        ["processor.max_pixels=2048"],
        "processor.max_pixels 2,048 is below the processor's own min_pixels (the built-in tiny "
        "processor) 4,096: no image size lies within both; fix: set processor.max_pixels >= "
        "4096 (or processor.min_pixels <= 2048)",
    ),
    (
        "packing.per_token_loss",
        [MEGATRON, "megatron.calculate_per_token_loss=false"],
        "megatron.calculate_per_token_loss is false: a per-sequence mean weighs the "
        "conversations of a packed row by how they were packed; fix: set "
        "megatron.calculate_per_token_loss=true",
    ),
    (
        "packing.no_collective_average",
        [MEGATRON, "megatron.average_in_collective=true"],
        "megatron.average_in_collective is true: averaging in the all-reduce divides the "
        "already globally normalized per-token loss by the DP size again; fix: set "
        "megatron.average_in_collective=false",
    ),
    (
        "packing.fixed_width",
        [MEGATRON, "train.parallel.expert_parallel=8"],
        "packing.pad_to_max_length is false with train.parallel.expert_parallel 8 and "
        "train.parallel.pipeline_parallel 1: EP > 1 or PP > 1 needs every packed row padded to "
        "packing.seq_length; fix: set packing.pad_to_max_length=true",
    ),
    (
        "megatron.mtp",
        [MEGATRON, "megatron.mtp_num_layers=1"],
        "megatron.mtp_num_layers is 1: Megatron-Bridge rejects multi-token prediction "
        "with packed sequences; fix: set megatron.mtp_num_layers=0",
    ),
    (
        "megatron.cuda_graphs",
        [MEGATRON, "megatron.vision_cuda_graph_impl=transformer_engine"],
        "megatron.vision_cuda_graph_impl is 'transformer_engine': CUDA graphs replay "
        "fixed shapes and packed rows change shape every step, so Megatron-Bridge rejects them "
        "with packing; fix: set megatron.vision_cuda_graph_impl=none",
    ),
    (
        "megatron.pipeline_parallel",
        [MEGATRON, "train.parallel.pipeline_parallel=2", "packing.pad_to_max_length=true"],
        "train.parallel.pipeline_parallel is 2: Megatron-Bridge rejects pipeline parallelism "
        "with Energon packing; fix: set train.parallel.pipeline_parallel=1 (split the model "
        "with TP or EP instead; or train.backend=local, whose pipeline stages carry the "
        "packing metadata)",
    ),
    (
        "megatron.task_encoder",
        [MEGATRON, "megatron.task_encoder=LlavaEnergonTaskEncoderConfig"],
        "megatron.task_encoder is 'LlavaEnergonTaskEncoderConfig': Megatron-Bridge packs "
        "online only with QwenVLEnergonTaskEncoderConfig; fix: set "
        "megatron.task_encoder=QwenVLEnergonTaskEncoderConfig",
    ),
]


@pytest.mark.parametrize(
    ("rule", "overrides", "problem"), CONFIG_ERRORS, ids=[c[0] for c in CONFIG_ERRORS]
)
def test_config_rule_broken_exits_2_with_its_message(rule, overrides, problem, capsys, tmp_path):
    with pytest.raises(UserError) as info:
        load_config(None, overrides)
    assert info.value.problems == [problem]
    code = main(["stage", "validate", f"work_dir={tmp_path}", *overrides])
    err = capsys.readouterr().err
    assert code == 2
    assert f"  - {problem}\n" in err and "1 problem(s)" in err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    ("overrides", "finding"),
    [
        (
            [MEGATRON, "megatron.overlap_moe_expert_parallel_comm=true"],
            "megatron.overlap_moe_expert_parallel_comm is true: Megatron-Bridge forces it "
            "off with packing, so the run will not overlap the EP all-to-all; fix: set "
            "megatron.overlap_moe_expert_parallel_comm=false",
        ),
        (
            [MEGATRON, "megatron.delay_wgrad_compute=true"],
            "megatron.delay_wgrad_compute is true: Megatron-Bridge forces it off with "
            "packing; fix: set megatron.delay_wgrad_compute=false",
        ),
    ],
    ids=["megatron.ep_comm_overlap", "megatron.delay_wgrad"],
)
def test_config_warning_rule_loads_and_is_reported(overrides, finding):
    cfg = load_config(None, overrides)  # a warning never stops the run
    found = config_findings(cfg)
    assert [(f.severity, f.text) for f in found] == [("warning", finding)]


def test_config_breaking_three_rules_lists_all_three(capsys, tmp_path):
    overrides = [
        "train.micro_batch_size=4",
        "packing.context_parallel=2",
        "packing.seq_length=2047",
        MEGATRON,
        "megatron.mtp_num_layers=2",
    ]
    with pytest.raises(UserError) as info:
        load_config(None, overrides)
    assert info.value.problems == [
        "packing.seq_length 2047 is not a multiple of the alignment m = lcm(2·CP, CP·TP) = 4 "
        "(TP 1, CP 2, SP False); use 2048 or 2044",
        "train.micro_batch_size is 4, but a packed micro-batch is exactly one row; fix: set "
        "train.micro_batch_size=1 (pack more conversations per row instead)",
        "megatron.mtp_num_layers is 2: Megatron-Bridge rejects multi-token prediction "
        "with packed sequences; fix: set megatron.mtp_num_layers=0",
    ]
    code = main(["stage", "validate", f"work_dir={tmp_path}", *overrides])
    err = capsys.readouterr().err
    assert code == 2 and "3 problem(s)" in err
    assert all(f"  - {p}\n" in err for p in info.value.problems)


def test_megatron_settings_are_inert_with_the_local_backend():
    cfg = load_config(None, ["megatron.mtp_num_layers=1", "megatron.max_num_images=0"])
    _, checks = CONFIG_RULES.run(cfg)
    status = {c.rule: c.status for c in checks}
    assert status["megatron.mtp"] == "not applicable"
    assert status["megatron.pipeline_parallel"] == "not applicable"
    assert status["packing.micro_batch"] == "ok"
    assert status["packing.fixed_width"] == "ok"  # train.parallel applies to both backends
    assert status["train.parallel"] == "ok"


def test_packing_rules_do_not_apply_when_nothing_trains_packed():
    cfg = load_config(
        None, ["packing.enabled=false", "train.compare_packing=false", "train.micro_batch_size=4"]
    )
    assert config_findings(cfg) == []


@pytest.mark.parametrize("path", SHIPPED, ids=[p.name for p in SHIPPED])
def test_shipped_config_breaks_no_guardrail(path: Path, tmp_path: Path):
    # The cluster configs name a processor dir on the cluster's filesystem: point it here.
    names_a_processor = OmegaConf.load(path).get("processor", {}).get("path")
    cfg = load_config(path, [f"processor.path={tmp_path}"] if names_a_processor else [])
    found = config_findings(cfg)
    assert [f.text for f in found if f.severity == "error"] == []
    assert [f.text for f in found] == EXPECTED_CONFIG_WARNINGS.get(path.name, [])


# --- the Megatron rules, on the overrides Bridge really gets --------------------------------

EXTRA = "megatron.extra_overrides"
# (rule id, config, overrides, severity): one Bridge rule broken, on the config alone
#: Bridge's own packer (its dataset config has the legacy in-batch packing fields).
BRIDGE_PACKER = ("packing.packer=bridge", "packing.algorithm=ffd", "packing.max_carry_rounds=0")

MEGATRON_BREAKS = [
    ("megatron.executor", DENSE, ["executor.kind=local"], "error"),
    ("megatron.paths", DENSE, ["model.path=null"], "error"),
    (
        "megatron.algorithm",
        DENSE,
        ["packing.packer=bridge", "packing.algorithm=bfd", "packing.max_carry_rounds=0"],
        "error",
    ),
    (
        "megatron.micro_batch_setting",
        DENSE,
        ["packing.enabled=false", "train.micro_batch_size=2"],
        "error",
    ),
    (
        "megatron.dense_experts",
        DENSE,
        ["train.parallel.expert_parallel=2", "packing.pad_to_max_length=true"],
        "error",
    ),
    ("megatron.world", DENSE, ["train.global_batch_size=12"], "error"),
    ("megatron.world", MOE, ["executor.slurm.gpus_per_node=4"], "error"),
    ("megatron.lora_targets", DENSE, ["lora.target_modules=[q_proj,qkv]"], "error"),
    ("megatron.extra_override_fields", DENSE, [f"{EXTRA}=[optimizer.weight_decy=0.1]"], "error"),
    ("megatron.extra_override_fields", DENSE, [f"{EXTRA}=[model.vision_config.depth=2]"], "error"),
    ("megatron.extra_override_guardrails", MOE, [f"{EXTRA}=[model.mtp_num_layers=1]"], "error"),
    (
        "megatron.extra_override_guardrails",
        DENSE,
        [f"{EXTRA}=[ddp.average_in_collective=true]"],
        "error",
    ),
    (
        "megatron.extra_override_guardrails",
        MOE,
        [f"{EXTRA}=[model.delay_wgrad_compute=true]"],
        "warning",
    ),
    ("megatron.extra_override_measured", DENSE, [f"{EXTRA}=[dataset.seq_length=8192]"], "error"),
    (
        "megatron.micro_batch",
        DENSE,
        ["packing.enabled=false", f"{EXTRA}=[train.micro_batch_size=2]"],
        "error",
    ),
    (
        "megatron.eval_micro_batch",
        DENSE,
        [f"{EXTRA}=[validation.eval_micro_batch_size=4]"],
        "error",
    ),
    ("megatron.dist_train", MOE, [f"{EXTRA}=[model.dist_train.use_dist_train=true]"], "error"),
    (
        "megatron.in_batch_packing",
        DENSE,
        [*BRIDGE_PACKER, f"{EXTRA}=[dataset.enable_in_batch_packing=true]"],
        "error",
    ),
    (
        "megatron.in_batch_packing",
        DENSE,
        [*BRIDGE_PACKER, f"{EXTRA}=[dataset.defer_in_batch_packing_to_step=true]"],
        "error",
    ),
    ("megatron.alignment", DENSE, [f"{EXTRA}=[dist.eval_context_parallel_size=3]"], "error"),
    ("megatron.alignment", MOE, ["packing.tensor_parallel=4", "packing.seq_length=4094"], "error"),
    (
        "megatron.alignment",
        MOE,
        ["packing.tensor_parallel=4", "packing.seq_length=4096"],
        "warning",
    ),
]


@pytest.mark.parametrize(
    ("rule", "config", "overrides", "severity"),
    MEGATRON_BREAKS,
    ids=[f"{r[0]}-{'+'.join(r[2])}" for r in MEGATRON_BREAKS],
)
def test_megatron_rule_broken_alone_is_the_only_finding(
    rule, config, overrides, severity, tmp_path
):
    cfg = cluster_config(config, tmp_path, *overrides)
    found, checks, _ = megatron_findings(cfg)
    assert [(f.rule, f.severity) for f in found] == [(rule, severity)], [f.text for f in found]
    assert {c.rule: c.status for c in checks}[rule] == severity
    assert megatron_problems(cfg) == ([found[0].text] if severity == "error" else [])


@pytest.mark.parametrize("config", [DENSE, MOE], ids=["8b_1node", "30b_a3b_ep8"])
def test_shipped_cluster_configs_break_no_megatron_rule(config, tmp_path):
    found, checks, run = megatron_findings(cluster_config(config, tmp_path))
    assert found == [] and {c.status for c in checks} <= {"ok", "not applicable"}
    assert run is not None and bridge_alignment(run) == run.cfg.packing.alignment == 1


def test_megatron_rules_are_inert_with_the_local_backend(tmp_path):
    cfg = load_config(None, [f"work_dir={tmp_path}", f"{EXTRA}=[train.micro_batch_size=2]"])
    found, checks, run = megatron_findings(cfg)
    assert found == [] and run is None
    assert {c.status for c in checks} == {"not applicable"}
    assert len(checks) == len(MEGATRON_RULES.rules)


def test_alignment_counts_the_eval_cp_size_and_the_sp_the_moe_provider_turns_on(tmp_path):
    eval_cp = cluster_config(DENSE, tmp_path, f"{EXTRA}=[dist.eval_context_parallel_size=4]")
    assert bridge_alignment(bridge_run(eval_cp)) == 8  # lcm(1, 2·4)
    moe = cluster_config(MOE, tmp_path, "packing.tensor_parallel=2", "packing.context_parallel=2")
    assert moe.packing.alignment == 4  # lcm(2·2), SP off in packline's config
    assert bridge_alignment(bridge_run(moe)) == 4  # lcm(2·2, 2·2)
    moe_tp4 = cluster_config(MOE, tmp_path, "packing.tensor_parallel=4")
    assert bridge_alignment(bridge_run(moe_tp4)) == 4  # lcm(1, 1·4): SP on
    dense_tp4 = cluster_config(DENSE, tmp_path, "packing.tensor_parallel=4")
    assert bridge_alignment(bridge_run(dense_tp4)) == 1  # a dense model keeps SP off


def test_an_extra_override_is_checked_as_the_value_bridge_gets(tmp_path):
    """Extra overrides are applied last: the rules read them, not packline's values."""
    ok = cluster_config(
        DENSE, tmp_path, f"{EXTRA}=[train.micro_batch_size=1,logger.log_interval=5]"
    )
    assert megatron_problems(ok) == []
    run = bridge_run(cluster_config(DENSE, tmp_path, f"{EXTRA}=[train.micro_batch_size=2]"))
    assert run.base["train.micro_batch_size"] == 1 and run.get("train.micro_batch_size") == 2


def test_run_on_slurm_refuses_what_validate_lists(tmp_path, capsys):
    overrides = [
        f"work_dir={tmp_path / 'work'}",
        f"processor.path={cluster_config(DENSE, tmp_path).processor.path}",
        f"{EXTRA}=[train.micro_batch_size=2,model.dist_train.use_dist_train=true]",
    ]
    expected = megatron_problems(load_config(DENSE, overrides))
    assert len(expected) == 2
    assert main(["run", str(DENSE), *overrides, "--dryrun"]) == 2
    err = capsys.readouterr().err
    assert "2 problem(s)" in err and all(f"  - {p}\n" in err for p in expected)


# --- the model side: meta device, LoRA matching ---------------------------------------------


@pytest.fixture(scope="module")
def processor(tmp_path_factory):
    return load_processor(copy_tiny_processor(tmp_path_factory.mktemp("tiny") / "processor"))


def test_meta_model_holds_no_weights_even_for_the_real_30b_config():
    model = build_meta_model(real_config("qwen3-vl-30b-a3b"))
    params = list(model.parameters())
    assert sum(p.numel() for p in params) > 30e9  # the whole 30B-A3B, shapes only
    assert {p.device.type for p in params} == {"meta"}
    assert {b.device.type for b in model.buffers()} <= {"meta"}


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_lora_target_matches_equal_what_peft_wraps(processor, moe):
    modules = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    params = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"] if moe else []
    meta = build_meta_model(tiny_config(processor, moe=moe))
    matches = lora_target_matches(meta, modules, params)
    ours = {name for m in matches if m.kind == "module" for name in m.matched}
    ours_params = {name for m in matches if m.kind == "parameter" for name in m.matched}

    peft = get_peft_model(
        build_tiny_model(processor, moe=moe),
        LoraConfig(target_modules=modules, target_parameters=params or None),
    )
    prefix = "base_model.model."
    wrapped = {
        n.removeprefix(prefix).removesuffix(".base_layer")
        for n, mod in peft.named_modules()
        if isinstance(mod, LoraLayer)
    }
    experts = {p.rsplit(".", 1)[0] for p in ours_params}
    assert ours | experts == wrapped
    if moe:
        by_target = {m.target: len(m.matched) for m in matches}
        assert by_target["gate_proj"] == by_target["up_proj"] == by_target["down_proj"] == 0
        assert by_target["mlp.experts.gate_up_proj"] == 2  # one per layer


def test_lora_default_targets_on_the_real_30b_a3b_config_miss_the_experts():
    meta = build_meta_model(real_config("qwen3-vl-30b-a3b"))
    dense = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    matches = {m.target: len(m.matched) for m in lora_target_matches(meta, dense, [])}
    assert matches == {
        "q_proj": 48,
        "k_proj": 48,
        "v_proj": 48,
        "o_proj": 48,
        "gate_proj": 0,  # the silent no-op: 128 experts x 48 layers untouched
        "up_proj": 0,
        "down_proj": 0,
    }
    fixed = lora_target_matches(meta, [], ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    assert [len(m.matched) for m in fixed] == [48, 48]
    assert all(meta.get_parameter(n).dim() == 3 for m in fixed for n in m.matched)


def test_buffered_sample_bytes_worked_example():
    args = dict(num_tokens=300, num_images=1, image_bytes=32768, num_patches=1024, patch_dim=1536)
    assert buffered_sample_bytes("lazy", **args) == 300 * 9 + 32768 == 35468
    assert buffered_sample_bytes("eager", **args) == 300 * 33 + 1024 * 1536 * 4 + 24 == 6301380
    with pytest.raises(ValueError, match="unknown encoder mode"):
        buffered_sample_bytes("greedy", **args)


def test_meta_model_parameters_never_touch_memory(processor):
    model = build_meta_model(tiny_config(processor, moe=True))
    assert all(p.is_meta for p in model.parameters())
    with pytest.raises(NotImplementedError):  # meta tensors carry no data to read
        model.get_parameter("lm_head.weight").cpu()
