"""What a step launches (``shardmuon bench step --kernels``): the counter against hand
counts, and the launch budget of the 1/8-scale Qwen3-30B-A3B preset (4 layers), whose plan
has the full model's 75 batches at the default workspace.

The budget ratchets: it is today's count with a small margin, so a change that adds a pass,
a launch per slice or a host sync fails here. The goal (docs/benchmarks.md, "Launches per
step") is 2,000 ATen calls on the CPU path and 1,800 kernels on the accelerator path; both
meet it, the accelerator path with the fused Triton passes (normalisation,
decay-and-update), which the count takes wherever Triton imports.
"""

from __future__ import annotations

import dataclasses
import json

import torch

from shardmuon.bench.kernels import KernelConfig, count_step, measure_preset
from shardmuon.cli import main
from shardmuon.ops.fused_normalize import fused_normalize_available
from shardmuon.ops.normalize import normalize

# Today's counts (accelerator: 1,838 ATen calls, 1,496 kernels with Triton, 3,024 and 2,823
# without; CPU: 1,984 ATen calls).
TRITON = fused_normalize_available(torch.device("meta"))
BUDGET = {
    "accelerator": {"aten_calls": 1_860, "kernels": 1_520, "syncs": 0}
    if TRITON
    else {"aten_calls": 3_050, "kernels": 2_850, "syncs": 0},
    "cpu": {"aten_calls": 2_000},
}


def test_the_counter_against_a_hand_count() -> None:
    x = torch.empty(4, 8, device="meta")

    def step() -> None:
        y = x.mul(2)  # a kernel
        y.add_(1)  # a kernel
        y.view(32).t()  # views: nothing
        torch.empty(3, device="meta")  # an allocation: an ATen call, no kernel
        bool(y.sum() > 0)  # two kernels; is_nonzero and its host read
        y.tolist()  # a host read the dispatcher never sees

    report = count_step(step, "accelerator")
    total = report.total
    assert (total.aten_calls, total.kernels, total.syncs) == (7, 4, 2)
    assert report.phases["other"].aten_calls == 7
    assert sum(report.sync_sites.values()) == 2


def test_foreach_launches_and_the_per_tensor_path() -> None:
    tensors = [torch.empty(5, device="meta") for _ in range(3)]
    fast = count_step(lambda: torch._foreach_mul_(tensors, 0.5), "accelerator")
    assert fast.total.kernels == 1
    host_scalar = torch.tensor(0.5)  # a CPU tensor scalar: torch's per-tensor path
    slow = count_step(lambda: torch._foreach_mul_(tensors, host_scalar), "accelerator")
    assert slow.total.kernels == 3
    many = [torch.empty(2, device="meta") for _ in range(111)]
    assert count_step(lambda: torch._foreach_add_(many, 1.0), "accelerator").total.kernels == 2


def test_phases_and_the_accelerator_branch_of_the_normalisation() -> None:
    X = torch.empty(6, 8, 16, device="meta")
    on_device = count_step(lambda: normalize(X, 1e-7), "accelerator")
    assert on_device.phases["normalize"].kernels > 0
    assert on_device.total.syncs == 0  # the branch without a host check
    assert on_device.total.aten_calls == on_device.phases["normalize"].aten_calls
    if fused_normalize_available(torch.device("meta")):
        # the fp64 norm, then prescale, division, cast and mask in one kernel
        assert on_device.operators == {
            "aten.empty.memory_format": 2,
            "aten.linalg_vector_norm.default": 1,
            "shardmuon.normalize_into.default": 1,
        }
        assert on_device.total.kernels == 2
    else:
        assert "aten.frexp.Tensor" in on_device.operators  # the prescale of the fp64 norm
    on_cpu = count_step(lambda: normalize(torch.randn(6, 8, 16), 1e-7), "cpu")
    assert "aten.frexp.Tensor" not in on_cpu.operators  # the host check, no prescale


def test_the_launch_budget_of_a_moe_step() -> None:
    report = measure_preset(KernelConfig(device_path="accelerator"))
    assert report.batches == 75  # the full model's plan
    _within_budget(report, "accelerator")
    # The plan and its launches do not depend on the widths: 1/32 counts the same, and the
    # CPU path (which computes for real, slowly in bf16 on a CPU) is counted there.
    narrow = measure_preset(KernelConfig(device_path="accelerator", scale=32, warm_steps=1))
    assert narrow.batches == 75
    assert abs(narrow.total.aten_calls - report.total.aten_calls) <= 2
    assert narrow.total.kernels == report.total.kernels
    on_cpu = measure_preset(KernelConfig(device_path="cpu", scale=32, warm_steps=1))
    assert on_cpu.batches == 75
    _within_budget(on_cpu, "cpu")


def test_aol_keeps_the_plan_and_fuses_its_normalisation() -> None:
    """AOL's step on the accelerator path: the same 75 batches (its workspace estimate counts
    what it allocates, not CPU copies an accelerator does not make), no host sync, and no
    normalisation pass: the norm, then one kernel that writes only matrices out of the
    Gram's range, and its two m x m passes one kernel each, where Triton imports (today
    1,738 kernels with Triton)."""
    options = (("newton_schulz_preconditioner", "aol"),)
    report = measure_preset(KernelConfig(device_path="accelerator", options=options))
    assert report.batches == 75
    assert report.total.syncs == 0
    assert report.total.kernels <= (1_760 if TRITON else 3_700), report.table()
    if TRITON:
        assert report.operators["shardmuon.gram_ready_into.default"] == 75


def _within_budget(report, path: str) -> None:
    total = report.total
    for key, limit in BUDGET[path].items():
        assert getattr(total, key) <= limit, (key, getattr(total, key), limit, report.table())


def test_the_command(tmp_path, capsys) -> None:
    out = tmp_path / "launches.json"
    args = ["bench", "step", "--kernels", "--model", "tiny-moe", "--json", str(out)]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "accelerator path" in printed and "normalize" in printed
    data = json.loads(out.read_text())
    assert data["total"]["syncs"] == 0 and data["total"]["kernels"] > 0
    assert set(data["phases"]) >= {"momentum", "normalize", "iterate", "update", "adamw"}
    assert main(["bench", "step", "--scale", "2", "--nproc", "1"]) != 0
    assert "--scale 2 applies to --kernels only" in capsys.readouterr().err


def test_the_accelerator_path_takes_cudas_rules() -> None:
    """meta stands for CUDA wherever a rule asks for the device: Gram's GEMM dtype, "auto"'s
    choice (taken by the rule: nothing to time on meta), the guard's fp32-output product.
    Was a bug: they took the CPU's branch, and "auto" counted as folded everywhere."""
    import warnings

    from shardmuon.ops.newton_schulz_gram import gram_gemm_dtype
    from shardmuon.ops.orthogonalizer import auto_choice

    assert gram_gemm_dtype(torch.bfloat16, "meta") == torch.float16
    assert auto_choice((64, 256), "meta") == auto_choice((64, 256), "cuda") == "gram"
    config = KernelConfig(layers=2, scale=32, warm_steps=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no failed calibration
        auto = measure_preset(
            dataclasses.replace(config, options=(("newton_schulz_impl", "auto"),))
        )
    folded = measure_preset(config)
    gram = measure_preset(dataclasses.replace(config, options=(("newton_schulz_impl", "gram"),)))
    assert auto.total.syncs > 0  # the guarded Gram calls (the guard's one sync each)
    assert folded.total.kernels != auto.total.kernels != gram.total.kernels
