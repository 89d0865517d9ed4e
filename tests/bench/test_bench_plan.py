"""``shardmuon bench plan``: the plan read on a fake process group against real steps.

The bytes and Newton–Schulz work the command computes, per rank, must equal what a real
gloo step of the same model and layout sends and runs (``last_step_stats``), at world sizes
2 and 4; ranks derived by symmetry must equal ranks really laid out; bad arguments exit 2.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
from dist_harness import free_ports, launch_world

from shardmuon.bench.optimizers import make_optimizer
from shardmuon.bench.plan import parse_meshes, parse_world_sizes, plan_world
from shardmuon.bench.plan_rank import PlanConfig, build_meta_model
from shardmuon.bench.report import TABLE_WIDTH
from shardmuon.cli import main
from shardmuon.harness.models import param_shapes
from shardmuon.harness.parallel import LAYOUTS, apply_layout, plan_layout
from shardmuon.ops.newton_schulz import NS_PRESETS
from shardmuon.planning.batches import newton_schulz_cost
from shardmuon.planning.placements import local_tensor

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
# A small tiny-moe: layer 0 dense, layer 1 MoE (8 experts, gate_up partitioned).
LAYERS, VOCAB = 2, 256
REAL_WORLDS = (2, 4)
REAL_LAYOUTS = ("fsdp", "ep", "hsdp")
OUT_ENV = "SHARDMUON_TEST_PLAN_OUT"
DION_ITERATIONS = len(NS_PRESETS["dion"])


def _plan_argv(*extra: str) -> list[str]:
    return ["bench", "plan", "--model", "tiny-moe", "--layers", str(LAYERS),
            "--vocab-size", str(VOCAB), "--no-progress", *extra]  # fmt: skip


# ------------------------------------------------------------ real steps (gloo)


def _real_step(layout: str):
    """A case: one real optimizer step of the plan command's model and layout, recorded."""

    def run(ctx) -> None:
        cfg = PlanConfig("tiny-moe", LAYERS, VOCAB, layout, "dion")
        model = build_meta_model(cfg)
        applied = apply_layout(model, layout, device_type="cpu")
        model.to_empty(device="cpu")
        gen = torch.Generator().manual_seed(ctx.rank)
        with torch.no_grad():
            for p in model.parameters():
                local = local_tensor(p)
                local.copy_(torch.randn(local.shape, generator=gen) * 0.02)
                p.grad = torch.zeros_like(p)
                local_tensor(p.grad).copy_(torch.randn(local.shape, generator=gen))
        # dion's first Newton–Schulz iteration only, to keep the test short: which matrices
        # run it, the bytes and the workspace do not depend on the count; FLOPs scale by it.
        opt = make_optimizer(
            "shardmuon",
            model,
            model_name="tiny-moe",
            lr=0.02,
            coefficients=[NS_PRESETS["dion"][0]],
            expert_mesh_name=applied.expert_mesh_name,
            meshes=applied.meshes,
        )
        opt.step()
        stats = opt.last_step_stats
        iterations = DION_ITERATIONS
        record = {
            "bytes_sent": stats.bytes_sent,
            "bytes_minimum": stats.bytes_minimum,
            "ns_flops": sum(
                b * iterations * newton_schulz_cost(r, c, None) for b, r, c in stats.ns_calls
            ),
            "matrices": stats.matrices_orthogonalized,
            "workspace_peak_bytes": stats.workspace_peak_bytes,
        }
        path = os.path.join(os.environ[OUT_ENV], f"{layout}-{ctx.world_size}-{ctx.rank}.json")
        with open(path, "w") as f:
            json.dump(record, f)

    return run


REAL_STEP_CASES = {layout: _real_step(layout) for layout in REAL_LAYOUTS}


@pytest.fixture(scope="module")
def real_steps(tmp_path_factory):
    """``{(layout, world): [per-rank record]}`` from real gloo steps at worlds 2 and 4."""
    out = tmp_path_factory.mktemp("real_steps")
    saved = os.environ.get(OUT_ENV)
    os.environ[OUT_ENV] = str(out)  # the spawned ranks inherit it
    worlds = []
    try:
        for world, port in zip(REAL_WORLDS, free_ports(len(REAL_WORLDS))):
            worlds.append(
                launch_world(
                    world,
                    "test_bench_plan:REAL_STEP_CASES",
                    list(REAL_LAYOUTS),
                    out / f"world{world}",
                    port=port,
                    timeout_s=300,
                )
            )
        for w in worlds:
            w.check(*REAL_LAYOUTS)
    finally:
        for w in worlds:
            w.kill()
        if saved is None:
            os.environ.pop(OUT_ENV, None)
        else:
            os.environ[OUT_ENV] = saved
    return {
        (layout, world): [
            json.loads((out / f"{layout}-{world}-{rank}.json").read_text()) for rank in range(world)
        ]
        for layout in REAL_LAYOUTS
        for world in REAL_WORLDS
    }


@pytest.mark.slow
@pytest.mark.parametrize("layout", REAL_LAYOUTS)
def test_plan_equals_what_a_real_step_sends_and_runs(layout, real_steps, tmp_path):
    out = tmp_path / "plan.json"
    argv = ["--layout", layout, "--world-size", ",".join(map(str, REAL_WORLDS)), "--json", str(out)]
    assert main(_plan_argv(*argv)) == 0
    results = {r["world_size"]: r for r in json.loads(out.read_text())["results"]}
    moved = False
    for world in REAL_WORLDS:
        real = real_steps[(layout, world)]
        planned = results[world]["per_rank"]
        for key in ("bytes_sent", "ns_flops", "matrices", "workspace_peak_bytes"):
            assert planned[key] == [r[key] for r in real], (world, key)
        # A real step sends exactly the minimum, which is what the plan computes.
        assert planned["bytes_sent"] == [r["bytes_minimum"] for r in real]
        moved |= any(planned["bytes_sent"])
        assert results[world]["a2a_gb_per_rank_max"] == max(planned["bytes_sent"]) / 1e9
    assert moved, f"test setup: layout {layout} moved no bytes at any world size"


# ------------------------------------------------------------ symmetry


@pytest.fixture(scope="module")
def tiny_base():
    return build_meta_model(PlanConfig("tiny-moe", LAYERS, VOCAB, "fsdp", "dion"))


@pytest.mark.parametrize(
    ("layout", "world", "mesh", "laid_out"),
    [
        # 256 hidden / 6 ranks: uneven shards; 8 experts over 6: 2/2/2/2/0/0 (two classes).
        ("fsdp", 6, None, [0, 4]),
        # 8 experts over 16 ranks: half hold none; kv rows 128 / 16.
        ("fsdp", 16, None, [0, 8]),
        # EP 4 x DP 2 over 8 experts: one whole expert per rank (FSDP's _StridedShard).
        ("ep", 8, (4, 2), [0]),
        # EP 2 x DP 3: 4 experts per EP rank, FSDP's chunks 2/2/0: ranks 4 and 5 hold none.
        ("ep", 6, (2, 3), [0, 4]),
        # EP 8 x DP 2 over 8 experts: more ranks than experts, so FSDP shards the rows.
        ("ep", 16, (8, 2), [0]),
        ("hsdp", 6, (2, 3), [0, 2]),
        ("none", 3, None, [0]),
    ],
)
def test_ranks_derived_by_symmetry_equal_ranks_laid_out(tiny_base, layout, world, mesh, laid_out):
    cfg = PlanConfig("tiny-moe", LAYERS, VOCAB, layout, "dion")
    plan = plan_layout(layout, world, mesh)
    derived = plan_world(tiny_base, cfg, plan)
    every = plan_world(tiny_base, replace(cfg, all_ranks=True), plan)
    assert derived.by_symmetry and not every.by_symmetry
    assert derived.evaluated == laid_out
    assert every.evaluated == list(range(world))
    assert derived.figures == every.figures
    assert derived.max_rank_bytes_by_param == every.max_rank_bytes_by_param


# ------------------------------------------------------------ large presets


def test_qwen_bytes_match_the_shapes_by_hand(tmp_path):
    """FSDP over 8: every exchanged Muon matrix (attention and router; the experts are local)
    has 7 of its 8 row pieces sent to the owner and back, in bf16."""
    out = tmp_path / "qwen.json"
    argv = ["bench", "plan", "--model", "qwen3-30b-a3b", "--layers", "2", "--world-size", "8",
            "--json", str(out), "--no-progress"]  # fmt: skip
    assert main(argv) == 0
    result = json.loads(out.read_text())["results"][0]
    exchanged = sum(
        math.prod(shape)
        for name, shape in param_shapes("qwen3-30b-a3b", 2).items()
        if len(shape) == 2 and "embed_tokens" not in name and "lm_head" not in name
    )
    # Summed over ranks (owners differ in load: 2 layers give batches shorter than 8).
    assert sum(result["per_rank"]["bytes_sent"]) == 2 * 2 * exchanged * 7 // 8
    assert result["evaluated_ranks"] == [0]
    # Each rank: 16 of the 128 experts, 2 stacks, 2 layers, local; the 10 exchanged
    # matrices (q, k, v, o, router per layer) have one owner each.
    matrices = result["per_rank"]["matrices"]
    assert min(matrices) >= 2 * 2 * 16
    assert sum(matrices) == 8 * 2 * 2 * 16 + 10


# ------------------------------------------------------------ command line


def test_plan_writes_json_png_and_a_table(tmp_path, capsys):
    out, png = tmp_path / "plan.json", tmp_path / "plan.png"
    argv = ["--layout", "ep", "--world-size", "4,8", "--json", str(out), "--plot", str(png)]
    assert main(_plan_argv(*argv)) == 0
    printed = capsys.readouterr()
    lines = printed.out.splitlines()
    assert lines and all(len(line.rstrip()) <= TABLE_WIDTH for line in lines), lines
    legend = ("a2a GB max", "a2a GB mean", "NS TFLOP max", "NS max ÷ mean", "workspace GiB max")
    for entry in (*legend, "laid out"):
        assert any(line.strip().startswith(f"{entry}:") for line in lines), entry
    assert f"wrote results (JSON): {out}" in printed.err
    assert f"wrote plot (PNG): {png}" in printed.err
    data = json.loads(out.read_text())
    assert data["benchmark"] == "plan"
    assert data["environment"]["command"].startswith("shardmuon bench plan")
    assert data["config"]["layout"] == "ep"
    rows = data["results"]
    assert [(r["world_size"], r["mesh_shape"]) for r in rows] == [(4, [2, 2]), (8, [4, 2])]
    for r in rows:
        per_rank = r["per_rank"]
        assert len(per_rank["bytes_sent"]) == r["world_size"]
        assert r["a2a_gb_per_rank_mean"] == pytest.approx(
            sum(per_rank["bytes_sent"]) / 1e9 / r["world_size"]
        )
        assert r["ns_max_over_mean"] >= 1.0
        assert sum(r["bytes_by_param_max_rank"].values()) == max(per_rank["bytes_sent"])
    assert png.read_bytes()[:8] == PNG_MAGIC


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--world-size", "0"], "bad --world-size '0'"),
        (["--world-size", "8,x"], "bad --world-size '8,x'"),
        (["--world-size", "4,8", "--mesh", "2x2"], "--mesh 2x2 gives 1 shape(s) for 2 world"),
        (["--layout", "hsdp", "--world-size", "8", "--mesh", "3x3"], "has 9 ranks"),
        (["--world-size", "8", "--mesh", "2xq"], "bad --mesh '2xq'"),
        (
            ["--layout", "ep", "--world-size", "8,16", "--mesh", "4x2,4x2"],
            "--mesh 4x2 has 8 ranks, but --world-size 16: the mesh dims must multiply to 16",
        ),
        (["--json", "."], "--json .: is a directory"),
    ],
)
def test_bad_arguments_exit_2_with_one_line(extra, message, capsys):
    assert main(_plan_argv(*extra)) == 2
    err = capsys.readouterr().err
    assert message in err
    assert len(err.strip().splitlines()) == 1
    assert "Traceback" not in err


def test_refuses_to_run_inside_a_process_group(capsys):
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert main(_plan_argv()) == 2
    finally:
        dist.destroy_process_group()
    assert "run it as a single process" in capsys.readouterr().err


def test_help_and_world_size_parsing(capsys):
    assert parse_world_sizes("8,64,1024") == [8, 64, 1024]
    assert parse_meshes("8x1,8x8", 2) == [(8, 1), (8, 8)]
    assert parse_meshes(None, 3) == [None] * 3
    with pytest.raises(SystemExit) as exc:
        main(["bench", "plan", "--help"])
    assert exc.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    for item in ("(default: qwen3-30b-a3b)", "(default: fsdp)", "(default: 8)", "--all-ranks"):
        assert item in text, item
    assert "{" + ",".join(LAYOUTS) + "}" in text
