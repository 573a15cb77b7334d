"""Expert parallelism (transformers' engine + packline's expert LoRA) equals one process on
the tiny Qwen3-VL-MoE, over gloo on CPU.

Two torchrun launches share their processes across the checks (start-up dominates):
2 ranks (EP 2 with FSDP 2, and FSDP 2 alone) and 4 ranks (EP 4 / FSDP 4, EP 2 / FSDP 4;
PP 2 × EP 2 with real pipeline stages is tests/integration/pp_check.py's). Each compares
with the ordinary one-process PEFT model (``target_modules`` + ``target_parameters``) on the same
real packed fixed-width rows of one step and the same adapter values
(``tests/integration/ep_check.py`` writes the figures; these tests assert them).

Gradients are compared per tensor as max |Δ| / max |reference|. The expert factors carry
the largest difference (up to ~8e-7): an expert's weight gradient sums the tokens of every
rank in one GEMM under EP, row by row on one process (fp32 rounding, not a layout error —
a wrong slice or a missing reduction is off by O(1)).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, get_peft_model
from torch import nn

from packline.train import expert_parallel as ep
from packline.train.distributed import torchrun_command
from stages.connect import connect
from stages.prepare import prepare
from tests.integration.parallel_rows import parallel_config

ROOT = Path(__file__).resolve().parents[2]
GRAD_REL = 1e-6
LOSS_ABS = 1e-6
UNPACKED_GRAD_REL = 1e-5  # packed vs padded: the attention kernels differ (one rank: ~1.4e-6)


@pytest.fixture(scope="session")
def ep_work(tmp_path_factory) -> Path:
    """A prepared and connected small set for the MoE on fixed-width rows (read-only)."""
    work = tmp_path_factory.mktemp("ep") / "work"
    cfg = parallel_config(work)
    prepare(cfg)
    connect(cfg)
    return work


def _launch(nproc: int, work: Path, out: Path, *args: str) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = torchrun_command(nproc, "tests.integration.ep_check", [str(work), str(out), *args])
    subprocess.run(cmd, cwd=ROOT, env=env, check=True, timeout=600)
    result = json.loads(out.read_text())
    print(json.dumps(result, indent=1))  # the figures, for the record (pytest -s)
    return result


@pytest.fixture(scope="module")
def two_ranks(ep_work, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("ep2") / "ep2.json"
    return _launch(
        2,
        ep_work,
        out,
        *("2", "1", "--unpacked", "2"),
        *("--unpacked-reference", "--no-tokens", "--inference"),
    )


@pytest.fixture(scope="module")
def four_ranks(ep_work, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("ep4") / "ep4.json"
    # (--stage-mesh, the PP layout's split alone, is left to pp_check's PP 2 x EP 2 launch)
    return _launch(4, ep_work, out, "4", "2", "--unpacked", "4", "--micro", "16")


def _assert_equals_one_process(case: dict) -> None:
    where = f"EP {case['E']} on {case['world']} ranks"
    assert case["same_default_group"], where  # transformers joined torchrun's group
    assert case["names_in_peft_order"], where
    assert case["initial_equals_peft"], where  # same seed, same adapters as PEFT
    assert case["roundtrip_exact"], where  # load_full_adapter_state -> merge
    assert not case["dense_params_dtensor"] and case["num_expert_params"] == 8, where
    # a rank holds its experts' bytes only, not the whole stack behind a view
    held = case["expert_local_bytes"]
    assert held and all(storage == part for storage, part in held), (where, held)
    assert abs(case["loss_packed"] - case["loss_reference"]) <= LOSS_ABS, where
    grads = case["grads_packed_vs_reference"]
    assert grads["max_rel"] <= GRAD_REL, (where, grads)
    assert case["grad_norm"] == pytest.approx(case["grad_norm_reference"], rel=1e-6)
    # the sliced AdamW step is the one-process step of the same gradients
    assert case["weights_after_step_same_grads"]["max_rel"] <= 1e-6, where
    # against the reference's own step, AdamW's lr·g/(|g|+eps) magnifies the rounding of
    # gradients near zero: a small fraction of the step itself
    assert case["weights_after_step"]["max_abs"] <= 0.05 * case["update_size"], where
    assert case["min_tokens_per_ep_rank"] > 0, where


def _assert_unpacked_equals_packed(case: dict) -> None:
    assert abs(case["loss_unpacked"] - case["loss_packed"]) <= LOSS_ABS
    assert case["grads_unpacked_vs_packed"]["max_rel"] <= UNPACKED_GRAD_REL


# -- the layout of the expert factors, against PEFT's own (one process, no data) -----------


class _Experts(nn.Module):
    """Two 3-D expert stacks, (experts, out, in) as HF stores them."""

    def __init__(self):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.randn(4, 6, 5))
        self.down_proj = nn.Parameter(torch.randn(4, 5, 3))


class _Holder(nn.Module):
    def __init__(self):
        super().__init__()
        self.experts = _Experts()


def test_expert_lora_slices_fold_as_peft_delta_of_their_experts():
    torch.manual_seed(0)
    model = get_peft_model(
        _Holder(),
        LoraConfig(
            r=2,
            lora_alpha=6,
            target_parameters=["experts.gate_up_proj", "experts.down_proj"],
            init_lora_weights=False,  # random B too
        ),
    )
    wrappers = [m for m in model.modules() if type(m).__name__ == "ParamWrapper"]
    assert {w.parameter_name for w in wrappers} == {"gate_up_proj", "down_proj"}
    for w in wrappers:
        full = w.get_delta_weight("default")  # (E, out, in)
        param = w.get_param()
        parts = []
        for ep_rank in range(2):
            lora = ep.ExpertLora(
                nn.Identity(),
                w.parameter_name,
                shape=tuple(param.shape),
                transposed=False,
                r=2,
                alpha=6,
                ep_rank=ep_rank,
                ep_size=2,
            )
            with torch.no_grad():
                lora.lora_A["default"].weight.copy_(lora.slice_a(w.lora_A["default"].weight))
                lora.lora_B["default"].weight.copy_(lora.slice_b(w.lora_B["default"].weight))
                local = lora.fold(torch.zeros(2, *param.shape[1:]))
            torch.testing.assert_close(local, full[2 * ep_rank : 2 * ep_rank + 2])
            parts.append(
                {
                    "A": lora.lora_A["default"].weight.detach().clone(),
                    "B": lora.lora_B["default"].weight.detach().clone(),
                    ep.EXPERT_SLICES: {
                        k: {
                            "factor": k,
                            "first_expert": lora.first_expert,
                            "num_local_experts": 2,
                            "num_experts": 4,
                            "r": 2,
                        }
                        for k in ("A", "B")
                    },
                }
            )
        merged = ep.merge_adapter_states(parts)
        assert torch.equal(merged["A"], w.lora_A["default"].weight.detach())
        assert torch.equal(merged["B"], w.lora_B["default"].weight.detach())  # strided columns


def test_merge_adapter_states_unions_stages_and_refuses_diverged_copies():
    a, b = torch.ones(2), torch.zeros(3)
    assert ep.merge_adapter_states([{"a": a}, {"b": b}, {"a": a.clone()}]).keys() == {"a", "b"}
    with pytest.raises(ValueError, match="replicas diverged"):
        ep.merge_adapter_states([{"a": a}, {"a": a + 1}])


# -- torchrun: 2 ranks --------------------------------------------------------------------


@pytest.mark.slow
def test_ep2_and_fsdp2_equal_one_process(two_ranks):
    assert [c["E"] for c in two_ranks["cases"]] == [2, 1]
    assert two_ranks["row_width"] == 2048 and max(two_ranks["rows"]) > 1  # packed, fixed width
    for case in two_ranks["cases"]:
        _assert_equals_one_process(case)


@pytest.mark.slow
def test_ep2_packed_equals_unpacked_as_on_one_rank(two_ranks):
    one_rank = two_ranks["one_rank"]
    assert abs(one_rank["loss_unpacked"] - one_rank["loss_packed"]) <= LOSS_ABS
    assert one_rank["grads_unpacked_vs_packed"]["max_rel"] <= UNPACKED_GRAD_REL
    _assert_unpacked_equals_packed(two_ranks["cases"][0])


@pytest.mark.slow
def test_ep2_rank_whose_experts_get_no_token_trains(two_ranks):
    r = two_ranks["no_tokens"]
    assert r["tokens_to_last_ep_rank"] == 0
    assert r["expert_grads_none_before_reduce"] == [False, False]  # zeros, still reduced
    assert abs(r["loss"] - r["loss_reference"]) <= LOSS_ABS
    assert r["grads_vs_reference"]["max_rel"] <= GRAD_REL


@pytest.mark.slow
def test_ep2_no_grad_forward_and_generate_match_one_process(two_ranks):
    r = two_ranks["inference"]
    assert r["no_grad_logits_max_abs"] <= 1e-5
    assert r["generated"] == r["generated_reference"] and r["generated_equal_across_ranks"]


# -- torchrun: 4 ranks --------------------------------------------------------------------


@pytest.mark.slow
def test_ep4_and_ep2_over_four_ranks_equal_one_process(four_ranks):
    assert [c["E"] for c in four_ranks["cases"]] == [4, 2]
    for case in four_ranks["cases"]:
        _assert_equals_one_process(case)
    _assert_unpacked_equals_packed(four_ranks["cases"][0])
