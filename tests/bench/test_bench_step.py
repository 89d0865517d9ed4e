"""``shardmuon bench step``'s parts: the tiny-qwen3-moe preset, the Newton–Schulz replay,
the summary (step ÷ NS and its spread, first step, ABBA pooling), the implementation list,
the optional dion integration (a stand-in ``dion`` package) and the shared helpers.

No timing is asserted: only what was run, in which order, with which arguments.
"""

from __future__ import annotations

import dataclasses
import json
import math
import socket
import sys
import textwrap

import pytest
import torch

from shardmuon import Muon
from shardmuon.bench.common import name_seed, relative_difference
from shardmuon.bench.launch import RankContext
from shardmuon.bench.optimizers import DEFAULT_OFF, IMPLEMENTATIONS, fsdp_mesh, make_optimizer
from shardmuon.bench.step import parse_impls
from shardmuon.bench.step_summary import summarize
from shardmuon.bench.step_worker import StepConfig, replay_newton_schulz, run_order
from shardmuon.cli import main
from shardmuon.harness.models import build_model, param_shapes
from shardmuon.harness.parallel import apply_layout
from shardmuon.harness.processes import free_port, threads_per_rank
from shardmuon.ops.engines import ENGINES
from shardmuon.ops.normalize import Normalized
from shardmuon.routing import build_param_groups

# A stand-in for dion's Muon: its constructor signature and its checks on meshes, nothing
# of its algorithm (the step is plain SGD). Written into a temporary `dion` package.
FAKE_DION = '''
"""Stand-in for the dion package in tests: Muon's constructor signature only."""
import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

CALLS = []


class Muon(torch.optim.Optimizer):
    def __init__(self, params, distributed_mesh=None, lr=0.01, mu=0.95, betas=(0.9, 0.95),
                 weight_decay=0.01, epsilon=1e-8, nesterov=False, adjust_lr="spectral_norm",
                 flatten=False, use_triton=False, newton_schulz_func=None):
        defaults = dict(lr=lr, mu=mu, weight_decay=weight_decay, algorithm="muon",
                        epsilon=epsilon, nesterov=nesterov, adjust_lr=adjust_lr)
        super().__init__(params, defaults)
        if distributed_mesh is not None:
            if not isinstance(distributed_mesh, DeviceMesh) or distributed_mesh.ndim != 1:
                raise ValueError("distributed_mesh must be a 1-D DeviceMesh")
        for group in self.param_groups:
            if group["algorithm"] not in ("muon", "adamw"):
                raise ValueError(f"unknown algorithm {group['algorithm']!r}")
            for p in group["params"]:
                if isinstance(p, DTensor) and p.device_mesh != distributed_mesh:
                    raise RuntimeError(f"DTensor on {p.device_mesh}, optimizer on {distributed_mesh}")
        CALLS.append(dict(mesh=distributed_mesh, lr=lr, weight_decay=weight_decay,
                          nesterov=nesterov, adjust_lr=adjust_lr,
                          groups=[(g["algorithm"], len(g["params"])) for g in self.param_groups]))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-group["lr"])
'''


@pytest.fixture
def fake_dion(tmp_path, monkeypatch):
    """A ``dion`` package on ``sys.path`` (spawned ranks inherit it); returns its module."""
    package = tmp_path / "fake_site" / "dion"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(textwrap.dedent(FAKE_DION))
    monkeypatch.delitem(sys.modules, "dion", raising=False)
    monkeypatch.syspath_prepend(str(package.parent))
    import dion

    yield dion
    sys.modules.pop("dion", None)


@pytest.fixture
def no_dion(monkeypatch):
    # None in sys.modules makes `import dion` raise ImportError.
    monkeypatch.setitem(sys.modules, "dion", None)


@pytest.fixture(autouse=True)
def _restore_torch_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


# ------------------------------------------------------------------------ the model preset

TINY_QWEN3_MOE_SHAPES = {
    "model.embed_tokens.weight": (1024, 512),
    "lm_head.weight": (1024, 512),
    "model.norm.weight": (512,),
    **{
        f"model.layers.{i}.{name}": shape
        for i in range(4)
        for name, shape in {
            "self_attn.q_proj.weight": (512, 512),  # 4 heads x 128
            "self_attn.k_proj.weight": (256, 512),  # 2 KV heads x 128
            "self_attn.v_proj.weight": (256, 512),
            "self_attn.o_proj.weight": (512, 512),
            "self_attn.q_norm.weight": (128,),
            "self_attn.k_norm.weight": (128,),
            "input_layernorm.weight": (512,),
            "post_attention_layernorm.weight": (512,),
            **(
                {
                    "mlp.gate_proj.weight": (1024, 512),
                    "mlp.up_proj.weight": (1024, 512),
                    "mlp.down_proj.weight": (512, 1024),
                }
                if i == 0
                else {
                    "mlp.experts.gate_up_proj": (8, 512, 512),  # 8 experts, 2 x 256
                    "mlp.experts.down_proj": (8, 512, 256),
                    "mlp.gate.weight": (8, 512),  # router
                }
            ),
        }.items()
    },
}


def test_tiny_qwen3_moe_has_the_shapes_of_issue_12():
    assert param_shapes("tiny-qwen3-moe") == TINY_QWEN3_MOE_SHAPES
    # The path bench step and training take: built, then laid out (one process: 'none').
    model = build_model("tiny-qwen3-moe", seed=0)
    applied = apply_layout(model, "none", world_size=1)
    shapes = {n: tuple(p.shape) for n, p in applied.model.named_parameters()}
    assert shapes == TINY_QWEN3_MOE_SHAPES
    # Routed: every matrix and stack to Muon, the router too; embeddings, head, norms to AdamW.
    routed = build_param_groups(model.named_parameters(), lr=0.02, weight_decay=0.1)
    by_algorithm = {"muon": 0, "adamw": 0}
    for group in routed.groups:
        by_algorithm[group["algorithm"]] += len(group["params"])
    # layer 0: q k v o + 3 MLP; layers 1-3: q k v o + 2 stacks + router.
    assert by_algorithm["muon"] == 7 + 3 * 7
    assert by_algorithm["adamw"] == len(TINY_QWEN3_MOE_SHAPES) - by_algorithm["muon"]


# ----------------------------------------------------------------- the Newton–Schulz replay


class _Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.grad_enabled: list[bool] = []
        self.keywords: list[dict] = []

    def __call__(self, X, coefficients, eps, **keywords):
        self.calls.append((tuple(X.shape), X.dtype, coefficients, eps))
        self.grad_enabled.append(torch.is_grad_enabled())
        self.keywords.append(keywords)
        return Normalized(X, torch.zeros(X.size(0), dtype=torch.bool))


@pytest.mark.parametrize("impl", ["folded", "unfolded", "gram"])
def test_replay_makes_the_steps_newton_schulz_calls(impl, monkeypatch):
    torch.manual_seed(0)
    # A fused gate_up stack (two partition blocks), a tall and a wide matrix, two of a shape.
    params = [
        torch.nn.Parameter(torch.randn(shape))
        for shape in [(3, 8, 6), (12, 5), (5, 12), (5, 12), (7,)]
    ]
    opt = Muon(
        [{"params": params[:4], "algorithm": "muon"}, {"params": params[4:], "algorithm": "adamw"}],
        lr=0.02,
        epsilon=1e-7,
        newton_schulz_impl=impl,
        newton_schulz_coefficients="keller",
        matrix_partitions={params[0]: (4, 4)},
    )
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    calls = list(opt.last_step_stats.ns_calls)
    assert calls, "the step made no Newton-Schulz call"
    recorder = _Recorder()
    engine = ENGINES[impl]
    monkeypatch.setitem(ENGINES, impl, dataclasses.replace(engine, run=recorder))
    barriers = []
    ctx = RankContext(0, 1, torch.device("cpu"), 1, False)
    monkeypatch.setattr(RankContext, "barrier", lambda self: barriers.append(1))
    times = replay_newton_schulz(opt, calls, ctx, repeats=3)
    assert len(times) == 3 and all(t >= 0 for t in times)
    assert len(barriers) == 3  # one before every replay: all ranks start together
    assert [c[0] for c in recorder.calls] == calls * 3  # the same calls, in the same order
    for _, dtype, coefficients, eps in recorder.calls:
        assert dtype == torch.bfloat16
        assert coefficients == opt.coefficients
        assert eps == pytest.approx(1e-7)
    assert not any(recorder.grad_enabled)  # as in the step: no autograd
    # The optimizer's own engine: Gram gets its dtype and restarts as in the step.
    expected = {
        "dtype": torch.bfloat16,
        "restarts": None,
        "overwrite_input": impl == "folded",
        "preconditioner": None,
    }
    assert recorder.keywords == [expected] * len(recorder.calls)
    # Every Muon element once; the partitioned stack as 4-row blocks, never as [8, 6].
    assert sum(b * r * c for b, r, c in calls) == 3 * 8 * 6 + 12 * 5 + 2 * 5 * 12
    assert not any(8 in (r, c) for _, r, c in calls)


# ---------------------------------------------------------------------------- the summary


def _rank(steps, ns_times, calls=((2, 4, 4),), **traffic):
    figures = {"step_times_s": steps, "peak_bytes": 10, "transient_bytes": 4}
    figures.update(
        bytes_sent=8, bytes_received=8, bytes_minimum=8, padded_scheme_bytes=8,
        replica_bytes_sent=0, num_batches=1, matrices_orthogonalized=2,
        workspace_peak_bytes=6, offload_bytes_loaded=0, offload_bytes_stored=0,
        offload_workspace_peak_bytes=0,
        ns_calls=[list(c) for c in calls], ns_times_s=ns_times,
    )  # fmt: skip
    figures.update(traffic)
    return figures


def test_ns_impl_and_dtype_flags_set_every_shardmuon_impls_engine():
    cfg = StepConfig(
        model="tiny-moe", layers=1, vocab_size=None, layout="none", mesh_shape=None, steps=2,
        impls=("shardmuon", "shardmuon-gram"), coefficients="dion", lr=0.02, seed=0,
        progress=False, ns_impl="gram", ns_dtype="fp16",
    )  # fmt: skip
    assert cfg.ns_options() == {"newton_schulz_impl": "gram", "newton_schulz_dtype": "float16"}
    model = build_model("tiny-moe", num_layers=1)
    for impl in cfg.impls:
        opt = make_optimizer(
            impl, model, model_name="tiny-moe", lr=0.02, coefficients="dion",
            expert_mesh_name=None, meshes={}, shardmuon_overrides=cfg.ns_options(),
        )  # fmt: skip
        assert (opt.newton_schulz_impl, opt.newton_schulz_dtype) == ("gram", "float16")
    default = StepConfig(**{**cfg.__dict__, "ns_impl": None, "ns_dtype": None})
    assert default.ns_options() == {}


def test_summary_pools_passes_and_divides_by_each_ranks_own_newton_schulz():
    # Two passes (ABBA), two ranks, three steps each; rank 1's NS is twice rank 0's.
    passes = [
        [_rank([9.0, 2.0, 4.0], [1.0, 1.0, 3.0]), _rank([8.0, 3.0, 3.0], [2.0, 2.0, 2.0])],
        [_rank([7.0, 6.0, 2.0], [1.0, 5.0, 1.0]), _rank([6.0, 4.0, 4.0], [2.0, 2.0, 9.0])],
    ]
    row = summarize("shardmuon", passes)
    assert row["passes"] == 2
    # Per step the slowest rank: pass 1 [9, 3, 4], pass 2 [7, 6, 4]; median of 3, 4, 6, 4.
    assert row["step_times_s"] == [[9.0, 3.0, 4.0], [7.0, 6.0, 4.0]]
    assert row["step_s"] == 4.0
    assert row["first_step_s"] == 9.0  # the first pass's step 1
    # Own NS: median of both passes' replays; rank 0 -> 1.0, rank 1 -> 2.0; max 2.0.
    assert row["owned_ns_s"] == 2.0
    # Per rank: median of steps 2.. (rank 0: 2, 4, 6, 2 -> 3.0; rank 1: 3, 3, 4, 4 -> 3.5)
    # over its own NS: 3.0 and 1.75; the max.
    assert row["step_over_ns"] == 3.0
    # Each timed step's slowest ratio: max(2/1, 3/2), max(4/1, 3/2), max(6/1, 4/2), max(2/1, 4/2).
    assert row["step_over_ns_per_step"] == [2.0, 4.0, 6.0, 2.0]
    assert row["step_over_ns_spread"] == {
        "min": 2.0, "q1": 2.0, "median": 3.0, "q3": 4.5, "max": 6.0
    }  # fmt: skip
    assert row["ns_calls"] == [1, 1]
    assert row["a2a_over_minimum"] == 1.0


def test_summary_leaves_out_ranks_without_newton_schulz():
    passes = [[_rank([5.0, 2.0], [1.0]), _rank([5.0, 9.0], [1e-6], calls=())]]
    row = summarize("shardmuon", passes)
    # Rank 1 orthogonalized nothing: its near-zero replay time must not make a huge ratio.
    assert row["step_over_ns"] == 2.0
    assert row["step_over_ns_per_step"] == [2.0]
    assert row["owned_ns_s"] == 1.0
    idle = summarize("shardmuon", [[_rank([5.0, 2.0], [1e-6], calls=())]])
    assert idle["step_over_ns"] is None and idle["step_over_ns_spread"] is None


def test_summary_of_a_non_shardmuon_impl_has_time_and_memory_only():
    row = summarize(
        "adamw", [[{"step_times_s": [3.0, 1.0], "peak_bytes": 5, "transient_bytes": 1}]]
    )
    assert (row["step_s"], row["first_step_s"], row["peak_bytes"]) == (1.0, 3.0, 5)
    assert "step_over_ns" not in row and "a2a_gb_per_rank" not in row


def test_abba_order_mirrors_the_implementations():
    assert run_order(("a", "b", "c"), "abba") == ["a", "b", "c", "c", "b", "a"]
    assert run_order(["a", "b"], "sequential") == ["a", "b"]
    with pytest.raises(ValueError, match="unknown order 'zigzag'"):
        run_order(["a"], "zigzag")


# ------------------------------------------------------------------ implementations, dion


def test_default_impls_leave_out_compiled_and_missing_dion(no_dion):
    impls, skipped = parse_impls(None, 2, "fsdp")
    assert impls == ["shardmuon", "shardmuon-unfolded", "shardmuon-no-rotation", "adamw"]
    assert skipped["shardmuon-compiled"] == DEFAULT_OFF["shardmuon-compiled"]
    assert skipped["dion"].startswith("the dion package is not installed")
    assert "torch-muon" in skipped and "shardmuon-split-replicas" in skipped
    # Asked for by name: compiled runs; dion is still skipped, with its reason.
    impls, skipped = parse_impls("shardmuon-compiled,dion,adamw", 2, "fsdp")
    assert impls == ["shardmuon-compiled", "adamw"]
    assert list(skipped) == ["dion"]
    with pytest.raises(ValueError, match="nothing to run"):
        parse_impls("dion", 2, "fsdp")
    assert set(IMPLEMENTATIONS) >= {"shardmuon-compiled", "dion"}


def test_dion_runs_when_importable_except_under_ep(fake_dion):
    impls, skipped = parse_impls(None, 1, "none")
    assert "dion" in impls and "dion" not in skipped
    impls, skipped = parse_impls(None, 2, "ep")
    assert "dion" not in impls and "1-D mesh" in skipped["dion"]
    with pytest.raises(ValueError, match="--impl dion: dion's Muon takes one 1-D mesh"):
        parse_impls("dion", 2, "ep")


def test_dion_is_built_from_the_routed_groups(fake_dion, tmp_path):
    out = tmp_path / "dion.json"
    rc = main(
        ["bench", "step", "--nproc", "1", "--layout", "none", "--model", "tiny-dense",
         "--layers", "1", "--steps", "2", "--impl", "dion,adamw", "--threads", "1",
         "--json", str(out), "--no-progress"]
    )  # fmt: skip
    assert rc == 0
    (call,) = fake_dion.CALLS
    assert call["mesh"] is None  # one process, plain tensors
    assert (call["lr"], call["weight_decay"], call["nesterov"], call["adjust_lr"]) == (
        0.02, 0.1, True, "rms_norm"
    )  # fmt: skip
    model = build_model("tiny-dense", num_layers=1)
    routed = build_param_groups(model.named_parameters(), lr=0.02, weight_decay=0.1)
    assert call["groups"] == [(g["algorithm"], len(g["params"])) for g in routed.groups]
    assert {a for a, _ in call["groups"]} == {"muon", "adamw"}
    rows = {r["impl"]: r for r in json.loads(out.read_text())["results"]}
    assert set(rows) == {"dion", "adamw"}
    assert len(rows["dion"]["step_times_s"][0]) == 2


@pytest.mark.slow
def test_two_ranks_abba_with_dion_on_the_fsdp_mesh(fake_dion, tmp_path, capsys):
    # The stand-in raises unless every DTensor param lives on the 1-D mesh it is given.
    out = tmp_path / "abba.json"
    rc = main(
        ["bench", "step", "--nproc", "2", "--layout", "fsdp", "--model", "tiny-dense",
         "--layers", "1", "--steps", "2", "--impl", "shardmuon,dion", "--order", "abba",
         "--ns-repeats", "2", "--json", str(out), "--no-progress"]
    )  # fmt: skip
    assert rc == 0
    printed = capsys.readouterr().out
    assert "of both passes (ABBA order)" in printed
    assert "step ÷ NS at each timed step" in printed
    data = json.loads(out.read_text())
    assert data["config"]["order"] == "abba"
    rows = {r["impl"]: r for r in data["results"]}
    assert set(rows) == {"shardmuon", "dion"}
    for impl, row in rows.items():
        assert row["passes"] == 2
        assert [len(steps) for steps in row["step_times_s"]] == [2, 2]
        assert len(data["per_pass"][impl]) == 2  # two passes ...
        assert all(len(ranks) == 2 for ranks in data["per_pass"][impl])  # ... of two ranks
    sm = rows["shardmuon"]
    # Two passes of one timed step each; a ratio per step, max over ranks.
    assert len(sm["step_over_ns_per_step"]) == 2
    assert sm["step_over_ns_spread"]["max"] == max(sm["step_over_ns_per_step"])
    assert all(len(r["ns_times_s"]) == 2 for p in data["per_pass"]["shardmuon"] for r in p)
    # the step beside its floor: every rank measured one, the row holds the busiest
    assert "the step beside its floor" in printed
    floors = [r["floor"] for r in data["per_pass"]["shardmuon"][0]]
    assert sm["floor"] == max(floors, key=lambda f: f["seconds"])
    assert sm["step_over_floor"] == pytest.approx(sm["step_s"] / sm["floor"]["seconds"])
    assert "floor" not in rows["dion"]


def test_dion_mesh_is_the_shard_mesh():
    class Mesh:
        def __init__(self, ndim: int) -> None:
            self.ndim = ndim
            self.sliced = None

        def __getitem__(self, name: str):
            self.sliced = name
            return "dp_shard sub-mesh"

    assert fsdp_mesh({}) is None
    flat = Mesh(1)
    assert fsdp_mesh({"dp": flat}) is flat
    hsdp = Mesh(2)
    assert fsdp_mesh({"dp": hsdp}) == "dp_shard sub-mesh" and hsdp.sliced == "dp_shard"


# ------------------------------------------------------------------------ shared helpers


def test_name_seed_is_stable_and_tells_names_apart():
    assert name_seed(0, "w", "lm_head.weight", 1) == name_seed(0, "w", "lm_head.weight", 1)
    assert name_seed(0, "w", "a", 1) != name_seed(0, "w", "a", 0)
    assert 0 <= name_seed("x") < 2**31


def test_relative_difference_of_tensors_and_of_lists():
    ref = torch.tensor([3.0, 4.0])
    assert relative_difference(torch.tensor([3.0, 4.5]), ref) == pytest.approx(0.1)
    # Lists: the norms of the concatenation, not a mean of ratios.
    ours = [torch.tensor([3.0, 4.5]), torch.zeros(2)]
    refs = [ref, torch.tensor([0.0, 0.0])]
    assert relative_difference(ours, refs) == pytest.approx(0.1)
    two = [torch.tensor([1.0]), torch.tensor([0.0])]
    assert relative_difference(two, [torch.tensor([0.0]), torch.tensor([1.0])]) == math.sqrt(2)
    with pytest.raises(ValueError, match="equally long"):
        relative_difference([ref], [ref, ref])
    with pytest.raises(ValueError, match="equally long"):
        relative_difference([], [])


def test_threads_per_rank_and_free_port(monkeypatch):
    monkeypatch.setattr("os.cpu_count", lambda: 8)
    assert [threads_per_rank(w) for w in (1, 2, 3, 16)] == [8, 4, 2, 1]
    assert threads_per_rank(2, threads=3) == 3
    monkeypatch.setattr("os.cpu_count", lambda: None)
    assert threads_per_rank(2) == 1
    port = free_port()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", port))  # still free
