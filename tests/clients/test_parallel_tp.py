"""Layout ``fsdp-tp`` (issue #13): tensor parallel over ``tp``, then FSDP2 over ``dp``.

* the layout itself: default meshes, the ``parallelize_module`` plan, bad head counts;
* one forward/backward on 4 gloo ranks (2x2 and 1x4 meshes) equals the one-process model's
  (loss and every grad within float tolerance), with torchtitan's placements;
* ``shardmuon train --layout fsdp-tp`` on 4 ranks: the losses of one process (AdamW and
  Muon), DCP checkpoints that resume bitwise at the same layout and at another (``fsdp``);
* ``shardmuon bench step --layout fsdp-tp --mesh 2x2``: runs, dion not applicable, the
  minimum all-to-all bytes.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F
from dist_harness import launch_world

from shardmuon.bench.step import parse_impls
from shardmuon.cli import main
from shardmuon.harness.models import model_config
from shardmuon.harness.parallel import LAYOUTS, plan_layout, tensor_parallel_plan
from shardmuon.train import TrainConfig
from shardmuon.train.cli import main as train_main
from shardmuon.train.run import run_training

# A vocabulary of 30 (the trainer's): lm_head / embed_tokens rows split 15 per tp rank,
# then 8 and 7 over dp (uneven FSDP shards of TP shards).
VOCAB = 30
LAYERS = 2  # tiny-moe: layer 0 dense (gate/up/down), layer 1 MoE (experts, router)


# ---------------------------------------------------------------------------- layout (fast)


def test_fsdp_tp_meshes():
    assert "fsdp-tp" in LAYOUTS
    assert plan_layout("fsdp-tp", 4).mesh_shape == (2, 2)
    assert plan_layout("fsdp-tp", 8).mesh_shape == (4, 2)
    assert plan_layout("fsdp-tp", 2).mesh_shape == (1, 2)
    assert plan_layout("fsdp-tp", 3).mesh_shape == (3, 1)
    assert plan_layout("fsdp-tp", 4, (1, 4)).mesh_dim_names == ("dp", "tp")
    with pytest.raises(ValueError, match="needs a 2-D mesh shape"):
        plan_layout("fsdp-tp", 4, (4,))
    with pytest.raises(ValueError, match="has 4 ranks but the world size is 2"):
        plan_layout("fsdp-tp", 2, (2, 2))


def test_tensor_parallel_plan_is_torchtitans():
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
    )
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(
            model_config("tiny-moe", num_layers=LAYERS, vocab_size=VOCAB)
        )
    plan = {name: type(style) for name, style in tensor_parallel_plan(model).items()}
    expected = {"model.embed_tokens": RowwiseParallel, "lm_head": ColwiseParallel}
    for i in range(LAYERS):
        attn = f"model.layers.{i}.self_attn"
        expected.update({f"{attn}.{n}_proj": ColwiseParallel for n in "qkv"})
        expected[f"{attn}.o_proj"] = RowwiseParallel
        expected.update({f"{attn}.{n}_norm": SequenceParallel for n in "qk"})
    mlp = "model.layers.0.mlp"
    expected.update({f"{mlp}.gate_proj": ColwiseParallel, f"{mlp}.up_proj": ColwiseParallel})
    expected[f"{mlp}.down_proj"] = RowwiseParallel
    # Experts, the router and the layer norms are left to FSDP.
    assert plan == expected


# ------------------------------------------------------------ forward/backward on 4 ranks


def _placements(param) -> tuple[str, ...]:
    return tuple(repr(p) for p in param.placements)


# Placements under (dp=2, tp=2), by the end of the parameter name.
EXPECTED_2X2 = {
    "q_proj.weight": ("_StridedShard(dim=0, sf=2)", "Shard(dim=0)"),
    "k_proj.weight": ("_StridedShard(dim=0, sf=2)", "Shard(dim=0)"),
    "v_proj.weight": ("_StridedShard(dim=0, sf=2)", "Shard(dim=0)"),
    "gate_proj.weight": ("_StridedShard(dim=0, sf=2)", "Shard(dim=0)"),
    "up_proj.weight": ("_StridedShard(dim=0, sf=2)", "Shard(dim=0)"),
    "lm_head.weight": ("_StridedShard(dim=0, sf=2)", "Shard(dim=0)"),
    "embed_tokens.weight": ("_StridedShard(dim=0, sf=2)", "Shard(dim=0)"),
    "o_proj.weight": ("Shard(dim=0)", "Shard(dim=1)"),
    "mlp.down_proj.weight": ("Shard(dim=0)", "Shard(dim=1)"),
    "q_norm.weight": ("Shard(dim=0)", "Replicate()"),
    "k_norm.weight": ("Shard(dim=0)", "Replicate()"),
    # FSDP over every rank (the flattened dp x tp mesh), on the expert dim.
    "experts.gate_up_proj": ("Shard(dim=0)",),
    "experts.down_proj": ("Shard(dim=0)",),
    "mlp.gate.weight": ("Shard(dim=0)",),
    "layernorm.weight": ("Shard(dim=0)",),
    "model.norm.weight": ("Shard(dim=0)",),
}


def _forward_backward(mesh: tuple[int, int]):
    """A case: one forward/backward of tiny-moe under fsdp-tp on ``mesh`` against one process."""

    def run(ctx) -> None:
        import torch.distributed as dist
        from torch.distributed.tensor import DTensor

        from shardmuon.harness.models import build_model
        from shardmuon.harness.parallel import apply_layout

        reference = build_model("tiny-moe", num_layers=LAYERS, vocab_size=VOCAB, seed=3)
        model = build_model("tiny-moe", num_layers=LAYERS, vocab_size=VOCAB, seed=3)
        applied = apply_layout(model, "fsdp-tp", mesh_shape=mesh, device_type="cpu")
        assert applied.plan.mesh_shape == mesh
        assert applied.expert_mesh_name is None
        dp = applied.meshes["dp"]
        assert (dp.size(), applied.meshes["tp"].size()) == mesh

        problems = []
        if mesh == (2, 2):
            for name, p in model.named_parameters():
                keys = [k for k in EXPECTED_2X2 if name.endswith(k)]
                assert len(keys) == 1, (name, keys)
                names = p.device_mesh.mesh_dim_names
                if ".experts." in name:
                    want_names = ("dp_tp",)
                else:
                    want_names = ("dp", "tp") if len(p.placements) == 2 else ("dp",)
                if _placements(p) != EXPECTED_2X2[keys[0]]:
                    problems.append(f"{name}: {_placements(p)} on {names}")
                elif names != want_names:
                    problems.append(f"{name}: mesh {names}, expected {want_names}")

        gen = torch.Generator().manual_seed(11)
        ids = torch.randint(0, VOCAB, (4, 9), generator=gen)
        labels = torch.randint(0, VOCAB, (4, 9), generator=gen)

        def loss_sum(m, rows):
            logits = m(input_ids=ids[rows]).logits
            return F.cross_entropy(
                logits.reshape(-1, VOCAB), labels[rows].reshape(-1), reduction="sum"
            )

        # The tp ranks of a dp slot share a slice of the batch.
        rows = torch.arange(4).tensor_split(dp.size())[dp.get_local_rank()]
        local = loss_sum(model, rows)
        # FSDP averages over dp: scale so that the grads are those of the global mean.
        (local * (dp.size() / ids.numel())).backward()
        total = local.detach().clone()
        dist.all_reduce(total, group=dp.get_group())
        expected = loss_sum(reference, torch.arange(4))
        (expected / ids.numel()).backward()
        torch.testing.assert_close(total, expected.detach(), rtol=1e-5, atol=0)

        ref_params = dict(reference.named_parameters())
        for name, p in model.named_parameters():
            grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            want = ref_params[name].grad
            error = float((grad - want).abs().max() / want.abs().max())
            if not error < 1e-4:
                problems.append(f"{name}: grad off by {error:.2e} (relative to its max)")
            if isinstance(p, DTensor) and p.grad.placements != p.placements:
                problems.append(f"{name}: grad {p.grad.placements} vs param {p.placements}")
        assert not problems, "\n".join(problems)

    return run


CASES = {
    "forward_backward_2x2": _forward_backward((2, 2)),
    "forward_backward_1x4": _forward_backward((1, 4)),
}


@pytest.mark.slow
def test_forward_backward_equals_one_process(tmp_path):
    world = launch_world(4, "test_parallel_tp:CASES", list(CASES), tmp_path, timeout_s=300)
    try:
        world.check(*CASES)
    finally:
        world.kill()


# ---------------------------------------------------------------------------- training

STEPS, HALF = 4, 2
BASE = TrainConfig(
    model="tiny-moe",
    num_layers=LAYERS,
    optimizer="muon",
    optim={"lr": 0.01},
    steps=STEPS,
    batch_size=8,
    min_len=2,
    max_len=6,
    nproc=4,
    layout="fsdp-tp",
    quiet=True,
)
# As in test_train: a re-sharded Muon run differs by bf16 rounding of Newton–Schulz inputs.
BF16_LOSS_RTOL = 0.03


def _run(**changes) -> dict[int, float]:
    return run_training(dataclasses.replace(BASE, **changes)).losses


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"layout": "fsdp", "mesh": (2, 2)}, "only layout 'fsdp-tp' takes a mesh"),
        ({"mesh": (2, 1)}, "has 2 ranks but the world size is 4"),
        ({"mesh": (4,)}, "needs a 2-D mesh shape"),
        ({"model": "tiny-qwen3-moe", "mesh": (1, 4)}, "tp=4 does not divide num_key_value_heads=2"),
    ],
)
def test_bad_fsdp_tp_config_is_rejected(changes, message):
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(BASE, **changes).validate()


def test_train_cli_mesh(capsys):
    assert train_main(["--layout", "fsdp-tp", "--mesh", "2by2", "--no-progress"]) == 2
    assert "bad --mesh '2by2'; accepted: DPxTP" in capsys.readouterr().err
    assert train_main(["--layout", "fsdp", "--mesh", "2x2", "--no-progress"]) == 2
    assert "only layout 'fsdp-tp' takes a mesh" in capsys.readouterr().err


@pytest.fixture(scope="module")
def tp_runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("train_tp")
    out = {"tmp": tmp}
    out["single"] = _run(nproc=1, layout="fsdp")
    out["TP"] = _run(checkpoint_dir=str(tmp / "TP"), checkpoint_every=HALF)
    resume = str(tmp / "TP" / f"step-{HALF:06d}")
    out["TP_resumed"] = _run(resume=resume)
    out["fsdp_resumed"] = _run(resume=resume, nproc=2, layout="fsdp")
    # A single-process run writes a dion-format file half way; fsdp-tp resumes from it.
    dion_file = tmp / "dion_half.pt"
    _run(nproc=1, layout="fsdp", steps=HALF, dion_out=str(dion_file))
    out["TP_from_dion"] = _run(resume_dion=str(dion_file))
    return out


@pytest.mark.slow
def test_adamw_fsdp_tp_trains_like_one_process():
    single = _run(optimizer="adamw", nproc=1, layout="fsdp", steps=3)
    tp = _run(optimizer="adamw", mesh=(2, 2), steps=3)
    assert sorted(tp) == [1, 2, 3]
    for step, loss in single.items():
        assert tp[step] == pytest.approx(loss, rel=1e-5), step


@pytest.mark.slow
def test_muon_fsdp_tp_trains_like_one_process(tp_runs):
    single, tp = tp_runs["single"], tp_runs["TP"]
    assert sorted(tp) == list(range(1, STEPS + 1))
    assert tp[1] == pytest.approx(single[1], rel=1e-5)  # before any update: the forward
    for step, loss in single.items():
        assert tp[step] == pytest.approx(loss, rel=BF16_LOSS_RTOL), step


@pytest.mark.slow
def test_fsdp_tp_checkpoint_resumes_bitwise_and_under_fsdp(tp_runs):
    tp = tp_runs["TP"]
    assert sorted(p.name for p in (tp_runs["tmp"] / "TP").iterdir()) == [
        f"step-{HALF:06d}",
        f"step-{STEPS:06d}",
    ]
    # Same layout: the exact continuation.
    assert tp_runs["TP_resumed"] == {s: tp[s] for s in range(HALF + 1, STEPS + 1)}
    # Another layout (DCP reshards the TP x FSDP state): the same curve within bf16 noise,
    # and the first step after the resume is the forward of the saved weights.
    resharded = tp_runs["fsdp_resumed"]
    assert sorted(resharded) == list(range(HALF + 1, STEPS + 1))
    assert resharded[HALF + 1] == pytest.approx(tp[HALF + 1], rel=1e-5)
    for step, loss in resharded.items():
        assert loss == pytest.approx(tp[step], rel=BF16_LOSS_RTOL)


@pytest.mark.slow
def test_fsdp_tp_resumes_from_a_dion_format_file(tp_runs):
    """Every rank keeps its FSDP2-over-TP slice of the whole tensors in the file: the first
    step after the resume is the single-process run's forward, the rest its curve."""
    single, resumed = tp_runs["single"], tp_runs["TP_from_dion"]
    assert sorted(resumed) == list(range(HALF + 1, STEPS + 1))
    assert resumed[HALF + 1] == pytest.approx(single[HALF + 1], rel=1e-5)
    for step, loss in resumed.items():
        assert loss == pytest.approx(single[step], rel=BF16_LOSS_RTOL), step


# ---------------------------------------------------------------------------- bench step


def test_dion_does_not_apply_under_fsdp_tp():
    impls, skipped = parse_impls(None, 4, "fsdp-tp")
    assert "dion" not in impls and "torch-muon" not in impls
    assert "both matrix dims" in skipped["dion"]
    with pytest.raises(ValueError, match="--impl dion: dion's Muon takes one 1-D mesh"):
        parse_impls("dion", 4, "fsdp-tp")


@pytest.mark.slow
@pytest.mark.exhaustive  # 4 processes, 10 s; the layout's step is tests/runtime/test_tp.py's
def test_bench_step_fsdp_tp_2x2(tmp_path, capsys):
    out = tmp_path / "step.json"
    rc = main(
        ["bench", "step", "--nproc", "4", "--layout", "fsdp-tp", "--mesh", "2x2",
         "--layers", str(LAYERS), "--vocab-size", "64", "--steps", "2", "--ns-repeats", "1",
         "--impl", "shardmuon,adamw", "--json", str(out), "--no-progress"]
    )  # fmt: skip
    assert rc == 0
    assert "layout fsdp-tp (mesh 2x2)" in " ".join(capsys.readouterr().out.split())
    data = json.loads(out.read_text())
    assert data["config"]["mesh_shape"] == [2, 2]
    rows = {r["impl"]: r for r in data["results"]}
    assert set(rows) == {"shardmuon", "adamw"}
    sm = rows["shardmuon"]
    assert sm["a2a_over_minimum"] == 1.0
    assert sum(sm["bytes_sent"]) == sum(sm["bytes_minimum"]) > 0
    # Orthogonalized once in the world: the TP-sharded q, k, v, o of both layers and layer
    # 0's gate, up, down (11), and the expert stacks (8 gate_up + 8 down), sharded over all
    # four ranks on the expert dim. The router is FSDP over dp only, replicated over tp:
    # each tp rank's dp group steps it (2 x 1).
    assert sum(sm["matrices_orthogonalized"]) == 11 + 16 + 2 * 1
