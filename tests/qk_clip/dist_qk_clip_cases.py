"""QK-clip on gloo (issue #22, run by ``tests/qk_clip/test_qk_clip_dist.py``): each case lays a
tiny Hugging Face model out as a trainer does (``shardmuon.harness.parallel.apply_layout``:
FSDP2, HSDP 2x2, FSDP2 over TP 2x2), splits the batch over the data-parallel ranks, runs
forward passes and ``QKClip.apply()`` twice, and compares every parameter shard bitwise with
one process that ran the same micro-batches one after another and applied the same clip
(the reference's full tensors cut with FSDP2's own layout, ``local_slice``). Each
``apply()`` must issue exactly one collective, an all-reduce; ranks that disagree on the
threshold or the layer list must all get the error.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
import torch.distributed as dist
import transformers
from dist_cases import expect_raises
from dist_checks import Context, fail_on, make_context
from dist_collective_pairing_cases import issued_collectives

from shardmuon.harness.parallel import apply_layout
from shardmuon.planning.placements import local_slice, local_tensor
from shardmuon.qk_clip import QKClip

__all__ = ["CASES", "cases_for", "make_context"]

CASES: dict[str, Callable[[Context], None]] = {}
WORLDS: dict[str, tuple[int, ...]] = {}
VOCAB = 64
ROUNDS = 2


def case(name: str, worlds: tuple[int, ...]):
    def register(fn):
        CASES[name], WORLDS[name] = fn, worlds
        return fn

    return register


def cases_for(world_size: int) -> list[str]:
    return [name for name in CASES if world_size in WORLDS[name]]


def tiny_model(kind: str, layers: int = 2, seed: int = 0) -> torch.nn.Module:
    """Llama (GQA 4/2, no QK-norm), Qwen3 (QK-norm) or Phi-3 (fused [Q; K; V]); layer 0's
    q/k blown up so that its heads exceed the threshold by different amounts."""
    common = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
        tie_word_embeddings=False,
    )  # fmt: skip
    classes = {
        "llama": transformers.LlamaConfig,
        "qwen3": transformers.Qwen3Config,
        "phi3": transformers.Phi3Config,
    }
    if kind == "phi3":
        common["pad_token_id"] = 0
    config = classes[kind](**common)
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    attention = model.model.layers[0].self_attn
    with torch.no_grad():
        if kind == "qwen3":
            attention.q_norm.weight.mul_(6.0)
            attention.k_norm.weight.mul_(6.0)
        else:
            projections = (
                (attention.qkv_proj,) if kind == "phi3" else (attention.q_proj, attention.k_proj)
            )
            for proj in projections:
                rows = torch.linspace(0.3, 1.5, proj.weight.shape[0] // 16).repeat_interleave(16)
                proj.weight.mul_(16.0 * rows[:, None])
    return model.train()


def own_group() -> dist.ProcessGroup:
    """A group of this rank alone (every rank calls it): the one-process reference's."""
    group, _ = dist.new_subgroups(group_size=1)
    return group


def micro_batch(data_rank: int, round_: int) -> torch.Tensor:
    """The micro-batch data-parallel rank ``data_rank`` sees in ``round_`` (varied sizes)."""
    gen = torch.Generator().manual_seed(1000 * round_ + data_rank)
    return torch.randint(1, VOCAB, (1 + data_rank % 2, 6 + 2 * data_rank), generator=gen)


def _compare(model, reference, label: str) -> list[str]:
    problems = []
    ref = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        local = local_tensor(param).detach()
        full = ref[name].detach()
        expected = local_slice(full, param) if hasattr(param, "placements") else full
        if not torch.equal(local, expected):
            diff = (local.double() - expected.double()).abs().max().item()
            problems.append(f"{label}: {name} differs from one process (max |diff| {diff:.3g})")
    return problems


def run_layout(
    ctx: Context,
    kind: str,
    layout: str,
    mesh_shape: tuple[int, ...] | None,
    tau: float = 6.0,
    layers: int = 2,
    same_maxima: bool = False,
    dtype: torch.dtype = torch.float32,
) -> None:
    """The comparison described in the module docstring, for one model and layout.

    ``same_maxima``: the reference clips with the maxima the distributed run reduced (which
    must be within 1e-5 of its own), so that the weights compare bitwise even where the
    forward itself rounds differently (tensor parallel's row-parallel sums, from layer 1 on).
    """
    model = tiny_model(kind, layers).to(dtype)
    reference = copy.deepcopy(model)
    if layout == "tp":  # tensor parallel alone: every rank the same data, its own heads
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import parallelize_module

        from shardmuon.harness.parallel import tensor_parallel_plan

        mesh = init_device_mesh("cpu", (ctx.world_size,), mesh_dim_names=("tp",))
        parallelize_module(model, mesh, tensor_parallel_plan(model))
        data_rank, data_world = 0, 1
    else:
        dp = apply_layout(model, layout, mesh_shape=mesh_shape).meshes["dp"]
        # HSDP's dp mesh is 2-D (replicate, shard): every rank its own data.
        data_rank = dp.get_local_rank() if dp.ndim == 1 and layout == "fsdp-tp" else ctx.rank
        data_world = dp.size() if layout == "fsdp-tp" else ctx.world_size
    clip, ref_clip = QKClip(model, tau), QKClip(reference, tau, process_group=own_group())
    problems = []
    try:
        for round_ in range(ROUNDS):
            model(micro_batch(data_rank, round_))
            for r in range(data_world):
                reference(micro_batch(r, round_))
            with issued_collectives() as calls:
                stats = clip.apply()
            if same_maxima:
                for recorder, layer in zip(ref_clip._recorders, stats.layers):
                    own = recorder.maxima
                    recorder.maxima = torch.tensor(layer.max_logits, dtype=torch.float32)
                    if not torch.allclose(own, recorder.maxima, rtol=1e-5, atol=0):
                        problems.append(f"round {round_}: {layer.name} maxima {own} vs {layer}")
            ref_stats = ref_clip.apply()
            kinds = [c.op for c in calls]
            if kinds != ["all_reduce"]:
                problems.append(f"round {round_}: apply() issued {kinds}, not one all-reduce")
            if stats.layers != ref_stats.layers:
                problems.append(f"round {round_}: stats {stats.layers} != one process's")
            if round_ == 0 and stats.clipped_heads == 0:
                problems.append("test setup: nothing was clipped")
            problems += _compare(model, reference, f"{layout} {kind} round {round_}")
    finally:
        clip.remove()
        ref_clip.remove()
    fail_on(problems)


@case("fsdp_llama_gqa", (2, 4))
def _fsdp_llama(ctx: Context) -> None:
    run_layout(ctx, "llama", "fsdp", None)


@case("fsdp_qwen3_qk_norm", (2, 4))
def _fsdp_qwen3(ctx: Context) -> None:
    run_layout(ctx, "qwen3", "fsdp", None)


@case("fsdp_phi3_fused_qkv", (2,))
def _fsdp_phi3(ctx: Context) -> None:
    """FSDP2 cuts the fused [Q; K; V] rows across its Q/K/V boundaries."""
    run_layout(ctx, "phi3", "fsdp", None)


@case("fsdp_llama_bf16_weights", (2,))
def _fsdp_bf16(ctx: Context) -> None:
    run_layout(ctx, "llama", "fsdp", None, dtype=torch.bfloat16)


@case("hsdp_2x2_llama", (4,))
def _hsdp_llama(ctx: Context) -> None:
    run_layout(ctx, "llama", "hsdp", (2, 2))


@case("fsdp_over_tp_2x2_llama_one_layer", (4,))
def _fsdp_tp_llama(ctx: Context) -> None:
    """One layer: tensor parallel's row-parallel sums would round a second layer's inputs
    differently from one process; the first layer's q/k are the same GEMMs per column."""
    run_layout(ctx, "llama", "fsdp-tp", (2, 2), layers=1)


@case("fsdp_over_tp_2x2_llama_two_layers_same_maxima", (4,))
def _fsdp_tp_llama_deep(ctx: Context) -> None:
    run_layout(ctx, "llama", "fsdp-tp", (2, 2), layers=2, same_maxima=True)


@case("tp_only_llama_one_layer", (2,))
def _tp_llama(ctx: Context) -> None:
    """Tensor parallel without FSDP: each rank computes 2 of the 4 query heads (and 1 of the
    2 key heads); the maxima are placed at each rank's head offset."""
    run_layout(ctx, "llama", "tp", None, layers=1)


@case("fsdp_over_tp_2x2_qwen3_one_layer", (4,))
def _fsdp_tp_qwen3(ctx: Context) -> None:
    run_layout(ctx, "qwen3", "fsdp-tp", (2, 2), layers=1)


@case("ranks_that_disagree_all_raise", (2, 4))
def _disagree(ctx: Context) -> None:
    problems = []
    model = tiny_model("llama")
    apply_layout(model, "fsdp")
    last = ctx.world_size - 1
    tau = 7.0 if ctx.rank == last else 6.0
    problems += expect_raises(
        ValueError,
        ["ranks disagree on the QK-clip threshold (largest 7.0, smallest 6.0)", "when QKClip"],
        lambda: QKClip(model, tau).remove(),
    )
    problems += expect_raises(
        ValueError,
        ["ranks disagree on the QK-clip alpha"],
        lambda: QKClip(model, 6.0, alpha=0.25 if ctx.rank == 0 else 0.5).remove(),
    )
    # A different layer list: one rank's model has a layer more.
    other = tiny_model("llama", layers=3 if ctx.rank == last else 2)
    problems += expect_raises(
        ValueError, ["ranks disagree on the QK-clip layer list"], lambda: QKClip(other, 6.0)
    )
    # Agreed at build time, edited on one rank afterwards: apply() refuses on every rank.
    clip = QKClip(model, 6.0)
    try:
        model(micro_batch(ctx.rank, 0))
        clip.threshold = 9.0 if ctx.rank == 0 else 6.0
        problems += expect_raises(
            ValueError, ["ranks disagree on the QK-clip threshold", "at apply()"], clip.apply
        )
    finally:
        clip.remove()
    dist.barrier()
    fail_on(problems)


@case("a_rank_that_saw_no_data_still_joins", (2, 4))
def _idle_rank(ctx: Context) -> None:
    """Only rank 0 runs a forward; the others' records are empty: the all-reduce still
    brings rank 0's maxima to everyone, and every rank scales its shard alike."""
    model = tiny_model("llama")
    reference = copy.deepcopy(model)
    apply_layout(model, "fsdp")
    clip, ref_clip = QKClip(model, 6.0), QKClip(reference, 6.0, process_group=own_group())
    try:
        # FSDP2's forward all-gathers on every rank: all run it, but only rank 0 records.
        clip.recording = ctx.rank == 0
        model(micro_batch(0, 0))
        reference(micro_batch(0, 0))
        stats, ref_stats = clip.apply(), ref_clip.apply()
        problems = [] if stats.layers == ref_stats.layers else ["stats differ from one process"]
        problems += _compare(model, reference, "idle ranks")
    finally:
        clip.remove()
        ref_clip.remove()
    fail_on(problems)


@case("rows_scale_on_every_placement", (4,))
def _placements(ctx: Context) -> None:
    """``scale_rows_`` on DTensors of every placement a trainer makes (uneven sizes
    included) equals scaling the full tensor and cutting it; ``Partial`` is refused."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    from shardmuon.qk_clip.shards import check_scalable, scale_rows_

    mesh1 = init_device_mesh("cpu", (4,))
    mesh2 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    gen = torch.Generator().manual_seed(5)
    problems = []
    layouts = [
        (mesh1, [Shard(0)]), (mesh1, [Shard(1)]), (mesh1, [Replicate()]),
        (mesh2, [Shard(0), Shard(0)]), (mesh2, [Replicate(), Shard(0)]),
        (mesh2, [Shard(0), Shard(1)]), (mesh2, [_StridedShard(0, split_factor=2), Shard(0)]),
    ]  # fmt: skip
    for rows in (30, 13, 3):
        for dtype in (torch.float32, torch.bfloat16):
            full = torch.randn(rows, 7, generator=gen).to(dtype)
            factors = torch.rand(rows, generator=gen, dtype=torch.float64) + 0.5
            expected = (full.float() * factors.float()[:, None]).to(dtype)
            for mesh, placements in layouts:

                def on(local, mesh=mesh, placements=placements, full=full):
                    return DTensor.from_local(
                        local, mesh, placements, shape=full.shape, stride=full.stride(),
                        run_check=False,
                    )  # fmt: skip

                # FSDP2's layout of the full tensor (local_slice reads placements only).
                param = on(local_slice(full, on(torch.empty(0, 7, dtype=dtype))).clone())
                scale_rows_(param, factors)
                if not torch.equal(local_tensor(param), local_slice(expected, param)):
                    problems.append(f"rows {rows} {dtype} {placements}: shard scaled wrongly")
    partial = DTensor.from_local(torch.ones(4, 4), mesh1, [Partial()], run_check=False)
    problems += expect_raises(
        ValueError,
        ["model.q_proj.weight has placements (Partial(sum),)", "cannot scale its rows"],
        lambda: check_scalable("model.q_proj.weight", partial),
    )
    fail_on(problems)


@case("rows_on_a_mesh_out_of_order_refused_on_every_rank", (4,))
def _mesh_out_of_order(ctx: Context) -> None:
    """On a mesh listing its ranks out of order a row shard may hold other rows by mesh
    coordinate than by group rank; QK-clip would scale the wrong rows: every rank refuses.
    Columns, replicas and ascending meshes are scaled as before."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from shardmuon.qk_clip.shards import check_scalable

    problems = []
    for ranks, placement, refused in (
        ([3, 2, 1, 0], Shard(0), True),
        ([1, 0, 3, 2], Shard(0), True),
        ([3, 2, 1, 0], Shard(1), False),
        ([3, 2, 1, 0], Replicate(), False),
        ([0, 1, 2, 3], Shard(0), False),
    ):
        mesh = DeviceMesh("cpu", torch.tensor(ranks))
        local = {Shard(0): torch.ones(3, 8), Shard(1): torch.ones(12, 2)}.get(
            placement, torch.ones(12, 8)
        )
        param = DTensor.from_local(local, mesh, [placement], shape=(12, 8), stride=(8, 1))
        label = f"mesh {ranks} {placement}"
        if refused:
            problems += expect_raises(
                ValueError,
                ["q.weight has its rows sharded over a mesh", str(ranks), "ascending order"],
                lambda param=param: check_scalable("q.weight", param),
            )
        else:
            try:
                check_scalable("q.weight", param)
            except ValueError as err:
                problems.append(f"{label}: refused ({err})")
    fail_on(problems)


@case("groups_and_failures_that_would_corrupt_or_hang", (4,))
def _misuse(ctx: Context) -> None:
    """Escapes found by attacking: a group that leaves out ranks holding the model (each
    rank its own; HSDP's shard group alone) silently diverged the replicas; a bad setting on
    one rank left the others waiting in the build's all-reduce. Now every rank raises."""
    from torch.distributed.device_mesh import init_device_mesh

    problems = []
    model = tiny_model("llama")
    apply_layout(model, "hsdp", mesh_shape=(2, 2))
    problems += expect_raises(
        ValueError,
        [
            "model.layers.0.self_attn.q_proj.weight lies on ranks [0, 1, 2, 3], but process_group",
            "would clip with other maxima",
        ],
        lambda: QKClip(model, 6.0, process_group=own_group()),
    )
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    problems += expect_raises(
        ValueError,
        ["but process_group has"],
        lambda: QKClip(model, 6.0, process_group=mesh["shard"].get_group()),
    )
    bad = "6" if ctx.rank == 2 else 6.0  # a string threshold on one rank only
    expected = "threshold must be a number" if ctx.rank == 2 else "QKClip failed on another rank"
    error = TypeError if ctx.rank == 2 else ValueError
    problems += expect_raises(error, [expected], lambda: QKClip(model, bad).remove())
    other = tiny_model("qwen3") if ctx.rank == 1 else model  # one rank: another model
    problems += expect_raises(ValueError, ["disagree"], lambda: QKClip(other, 6.0).remove())
    # One rank still holds an older clip on the model: that rank says so, the others that it
    # failed elsewhere (no rank is left in a collective).
    from shardmuon.qk_clip import recording

    attention = model.model.layers[0].self_attn
    if ctx.rank == 3:
        recording._RECORDERS[attention] = "an older clip's recorder"
    expected = "already record for another QKClip" if ctx.rank == 3 else "failed on another rank"
    problems += expect_raises(ValueError, [expected], lambda: QKClip(model, 6.0).remove())
    recording._RECORDERS.pop(attention, None)
    QKClip(model, 6.0).remove()  # and afterwards all is well
    fail_on(problems)
