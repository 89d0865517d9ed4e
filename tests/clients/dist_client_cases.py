"""Real clients' layouts on gloo (issue #20, run by ``test_clients.py``): each case lays a
small MoE model out exactly as the client does and compares the distributed Muon with the
same Muon on plain tensors in one process, bitwise, element by element.

* prime-rl's / torchtitan's expert parallelism: the world mesh ``("dp_shard_mod_ep",
  "dp_shard_in_ep"[, "cp"])``, ``ep`` and ``dp_shard_cp`` flattened from it, expert stacks
  ``Shard(0)`` over ``ep`` (their ``ExpertParallel``) then ``fully_shard`` over
  ``dp_shard_mod_ep`` with torchtitan's placement rule, everything else ``fully_shard`` over
  ``dp_shard_cp`` (context parallel folded in: it shards activations, not weights).
* Pipeline stages: each stage's ranks hold other layers and build their own ``Muon``
  (warm-up included); stage 1 does not even start until stage 0 has finished its steps, so
  any collective of stage 0 that waited on stage 1 would time out.
* torchtitan's ``OptimizersContainer`` (the installed package) with a shardmuon factory:
  steps, its flat FQN-keyed checkpoint through DCP, a resume bitwise like a run that never
  stopped.

Where FSDP2's layout is not ``distribute_tensor``'s (``_StridedShard`` of uneven sizes), the
element mapping is read from a model holding ``arange`` values laid out the same way, never
from DTensor's reading of the placements.
"""

from __future__ import annotations

import math
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
from dist_checks import Context, fail_on, make_context, random_tensors
from dist_collective_pairing_cases import issued_collectives
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from shardmuon import Muon
from shardmuon.harness.parallel import experts_shard_placement
from shardmuon.planning.placements import local_tensor

__all__ = ["CASES", "cases_for", "make_context"]

CASES: dict[str, Callable[[Context], None]] = {}
WORLDS: dict[str, tuple[int, ...]] = {}
MUON_KWARGS = {"lr": 0.02, "weight_decay": 0.1, "nesterov": True}


def case(name: str, worlds: tuple[int, ...]):
    def register(fn):
        CASES[name], WORLDS[name] = fn, worlds
        return fn

    return register


def cases_for(world_size: int) -> list[str]:
    return [name for name in CASES if world_size in WORLDS[name]]


# ------------------------------------------------------------------ a small MoE model


class Experts(nn.Module):
    """Hugging Face's fused layout: ``gate_up [E, 2I, H]``, ``down [E, H, I]``."""

    def __init__(self, experts: int, hidden: int, inner: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.randn(experts, 2 * inner, hidden) * 0.1)
        self.down_proj = nn.Parameter(torch.randn(experts, hidden, inner) * 0.1)


class Block(nn.Module):
    def __init__(self, hidden: int, experts: int, inner: int) -> None:
        super().__init__()
        self.attn = nn.Linear(hidden, hidden)
        self.router = nn.Linear(hidden, experts, bias=False)
        self.experts = Experts(experts, hidden, inner)
        self.norm = nn.LayerNorm(hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [T, H]``: attention stand-in, then every expert weighted by the router."""
        h = self.norm(x)
        x = x + self.attn(h)
        probs = self.router(h).softmax(-1)  # [T, E]
        gate, up = torch.einsum("th,eih->eti", h, self.experts.gate_up_proj).chunk(2, -1)
        out = torch.einsum("eti,ehi->eth", nn.functional.silu(gate) * up, self.experts.down_proj)
        return x + torch.einsum("eth,te->th", out, probs)


class MoE(nn.Module):
    """Blocks with other expert counts (so that torchtitan's rule shards the expert dim in
    one and the rows in another) and uneven hidden sizes."""

    def __init__(self, experts: tuple[int, ...], hidden: int = 10, inner: int = 7) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(Block(hidden, e, inner) for e in experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def muon_groups(named: dict[str, torch.Tensor]) -> list[dict]:
    """Matrices and stacks to Muon, the rest to AdamW (names sorted: the same everywhere)."""
    names = sorted(named)
    return [
        {"params": [named[n] for n in names if named[n].ndim >= 2], "algorithm": "muon"},
        {"params": [named[n] for n in names if named[n].ndim < 2], "algorithm": "adamw"},
    ]


def index_of(build: Callable[[], nn.Module], lay_out: Callable[[nn.Module], None]) -> dict:
    """Name -> the global flat index of every local element, as the layout really holds
    them: a model of ``arange`` values (exact in float64) laid out the same way."""
    model = build().double()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.arange(p.numel(), dtype=torch.float64).view(p.shape))
    lay_out(model)
    return {n: local_tensor(p).detach().long() for n, p in model.named_parameters()}


def compare_laid_out(
    build: Callable[[], nn.Module],
    lay_out: Callable[[nn.Module], None],
    label: str,
    steps: int = 3,
    expected: dict[str, tuple] | None = None,
    **muon_kwargs,
) -> list[str]:
    """``build()`` laid out by ``lay_out`` vs ``build()`` on one process: random grads set
    on the shards, ``steps`` Muon steps, params and state compared element by element.
    ``expected``: name fragment -> placements the layout must give (checks the setup)."""
    kwargs = {**MUON_KWARGS, "newton_schulz_impl": "per-matrix", **muon_kwargs}
    reference, sharded = build(), build()
    lay_out(sharded)
    index = index_of(build, lay_out)
    ref_named, named = dict(reference.named_parameters()), dict(sharded.named_parameters())
    names = sorted(ref_named)
    problems = []
    for fragment, placements in (expected or {}).items():
        for n in names:
            got = tuple(getattr(named[n], "placements", ()))
            if fragment in n and got != placements:
                problems.append(f"{label}: setup: {n} has {got}, expected {placements}")
    for n in names:
        want = ref_named[n].detach().flatten()[index[n]]
        if not torch.equal(local_tensor(named[n]).detach(), want):
            problems.append(f"{label}: setup: {n}'s shard is not where the arange model says")

    def shard_of(n: str, full: torch.Tensor) -> torch.Tensor:
        p, local = named[n], full.detach().flatten()[index[n]].clone()
        if not isinstance(p, DTensor):
            return local
        return DTensor.from_local(
            local, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
        )

    ref, opt = Muon(muon_groups(ref_named), **kwargs), Muon(muon_groups(named), **kwargs)
    for step in range(steps):
        grads = random_tensors([tuple(ref_named[n].shape) for n in names], 70 + step)
        for n, g in zip(names, grads):
            ref_named[n].grad, named[n].grad = g.clone(), shard_of(n, g)
        ref.step()
        opt.step()
    if opt.overlap is not None:
        opt.synchronize()
    for n in names:
        p, r = named[n], ref_named[n]
        pairs = [("param", p, r), *((k, opt.state[p][k], ref.state[r][k]) for k in ref.state[r])]
        for what, got, want in pairs:
            if what != "step":
                got, want = local_tensor(got).detach(), want.detach().flatten()[index[n]]
            if got.shape != want.shape or not torch.equal(got, want):
                problems.append(f"{label}: {what} of {n} {getattr(p, 'placements', '')} differs")
    return problems


# ------------------------------------------------------------------ prime-rl's EP meshes


def prime_rl_meshes(world: int, ep: int, cp: int) -> dict[str, object]:
    """prime-rl's (torchtitan's) world mesh for ``dp_shard = world / cp`` and expert
    parallel ``ep`` borrowed from ``dp_shard x cp``: dims ``dp_shard_mod_ep``,
    ``dp_shard_in_ep`` and ``cp`` (those of size 1 left out, as they do), ``ep`` and
    ``dp_shard_cp`` flattened from them."""
    dp_shard = world // cp
    sizes = {"dp_shard_mod_ep": dp_shard * cp // ep, "dp_shard_in_ep": ep // cp, "cp": cp}
    kept = {name: size for name, size in sizes.items() if size > 1}
    mesh = init_device_mesh("cpu", tuple(kept.values()), mesh_dim_names=tuple(kept))
    in_ep = tuple(name for name in ("dp_shard_in_ep", "cp") if name in kept)
    return {
        "world": mesh,
        "dp_shard_mod_ep": mesh["dp_shard_mod_ep"],
        "ep": mesh[in_ep]._flatten("ep"),
        "dp_shard_cp": mesh[tuple(kept)]._flatten("dp_shard_cp"),
    }


def prime_rl_layout(meshes: dict[str, object]) -> Callable[[nn.Module], None]:
    """torchtitan's ``apply_moe_ep_tp`` + ``apply_fsdp`` for our ``MoE``, without TP."""
    from torch.distributed.fsdp import fully_shard

    ep_mesh, dp_mesh = meshes["ep"], meshes["dp_shard_mod_ep"]

    def lay_out(model: nn.Module) -> None:
        for block in model.layers:
            experts = block.experts
            for name, param in list(experts.named_parameters()):
                dt = distribute_tensor(param.detach(), ep_mesh, [Shard(0)], src_data_rank=None)
                experts.register_parameter(name, nn.Parameter(dt))
            placement = experts_shard_placement(
                experts.gate_up_proj.size(0), dp_mesh.size(), ep_mesh.size()
            )
            fully_shard(experts, mesh=dp_mesh, shard_placement_fn=lambda _p, pl=placement: pl)
            fully_shard(block, mesh=meshes["dp_shard_cp"])
        fully_shard(model, mesh=meshes["dp_shard_cp"])

    return lay_out


@case("prime_rl_expert_parallel_meshes_bitwise", (4, 8))
def _prime_rl_ep(ctx: Context) -> None:
    from torch.distributed.tensor.placement_types import _StridedShard

    problems = []
    # world 4: dp_shard 4, ep 2; world 8: dp_shard 4 x cp 2, ep 4 (borrowing cp).
    ep, cp = (2, 1) if ctx.world_size == 4 else (4, 2)
    meshes = prime_rl_meshes(ctx.world_size, ep, cp)
    dp = meshes["dp_shard_mod_ep"].size()
    # Enough experts for every rank (the expert dim sharded twice) in one block, too few
    # (the rows over dp_shard_mod_ep) in the other; 2I = 14 rows split unevenly over 4.
    whole, rows = dp * ep, dp * ep // 2
    expected = {
        "0.experts": (_StridedShard(0, split_factor=ep), Shard(0)),
        "1.experts": (Shard(1), Shard(0)),
        "attn.weight": (Shard(0),),
    }

    def build() -> nn.Module:
        return MoE((whole, rows))

    lay_out = prime_rl_layout(meshes)
    problems += compare_laid_out(build, lay_out, "prime-rl EP", expected=expected)
    problems += compare_laid_out(
        build, lay_out, "prime-rl EP, 2 KiB budget", workspace_bytes=2048, split_replicas=True
    )
    # The overlapped step's forward order: an exchanged batch of the unevenly split expert
    # stack holds other matrices on each rank; every rank must still order it alike.
    problems += compare_laid_out(build, lay_out, "prime-rl EP, overlapped", overlap="forward")
    fail_on(problems)


# ------------------------------------------------------------------ pipeline stages


def _shared_dir() -> Path:
    path = [tempfile.mkdtemp(prefix="shardmuon-pp-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(path, src=0)
    return Path(path[0])


@case("pipeline_stages_step_alone_bitwise", (4,))
def _pipeline(ctx: Context) -> None:
    """2 stages x 2 ranks (mesh ``("pp", "dp")``), FSDP2 over each stage's ``dp``: stage 0
    builds (with warm-up), checks and steps its Muon three times while stage 1 has not
    started; only then does stage 1 build and step its own (other layers and shapes). Every
    collective stays inside the stage, and each stage is bitwise one process."""
    from torch.distributed.fsdp import fully_shard

    marker = _shared_dir() / "stage0-done"
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    stage, dp_mesh = mesh.get_local_rank("pp"), mesh["dp"]
    stage_ranks = set(mesh.mesh[stage].tolist())
    build = (lambda: MoE((4,), hidden=10)) if stage == 0 else (lambda: MoE((2, 6), hidden=9))

    def lay_out(model: nn.Module) -> None:
        for block in model.layers:
            fully_shard(block, mesh=dp_mesh)
        fully_shard(model, mesh=dp_mesh)

    if stage == 1:
        deadline = time.monotonic() + 60
        while not marker.exists():  # the filesystem, not a collective
            if time.monotonic() > deadline:
                raise AssertionError("stage 0 did not finish: it waited on stage 1")
            time.sleep(0.05)
    with issued_collectives() as calls:
        problems = compare_laid_out(build, lay_out, f"stage {stage}", warmup=True)
    if stage == 0:
        dist.barrier(group=dp_mesh.get_group())
        if dp_mesh.get_local_rank() == 0:
            marker.touch()
    outside = sorted({c.group for c in calls if not set(c.group) <= stage_ranks})
    if outside:
        problems.append(f"stage {stage} issued collectives over {outside}")
    if not any(c.op == "all_to_all" for c in calls):
        problems.append(f"stage {stage}: no all-to-all ran (the case tests nothing)")
    dist.barrier()  # both stages done before the next case
    fail_on(problems)


# ------------------------------------------------------------------ torchtitan


def _torchtitan_container(model: nn.Module, **extra):
    """torchtitan's own ``OptimizersContainer`` given shardmuon as a factory: the three lines
    of docs/training.md (``extra``: optimizer-wide Muon keywords, through the container's
    ``optimizer_factory_kwargs_by_name``)."""
    from torchtitan.components.optimizer import OptimizersContainer, ParamGroupConfig

    class Optimizers(OptimizersContainer):
        @staticmethod
        def _resolve_optimizer_factory(name):
            return (
                Muon
                if name == "shardmuon"
                else OptimizersContainer._resolve_optimizer_factory(name)
            )

    adamw = {"algorithm": "adamw", "lr": 0.01, "weight_decay": 0.0}
    config = Optimizers.Config(
        param_groups=[
            ParamGroupConfig(pattern=r"(bias|norm)", optimizer_name="shardmuon", optimizer_kwargs=adamw),
            ParamGroupConfig(pattern=r".*", optimizer_name="shardmuon", optimizer_kwargs=dict(MUON_KWARGS)),
        ],
        optimizer_factory_kwargs_by_name={"shardmuon": extra},
    )  # fmt: skip
    return Optimizers(config, model_parts=[model])


def _fully_sharded_moe(ctx: Context, experts: tuple[int, ...] = (2,)) -> nn.Module:
    """The torchtitan cases' model: a small MoE, FSDP2 on each block, then on the root."""
    from torch.distributed.fsdp import fully_shard

    model = MoE(experts, hidden=8)
    for block in model.layers:
        fully_shard(block, mesh=ctx.mesh)
    fully_shard(model, mesh=ctx.mesh)
    return model


def _train(model: nn.Module, optimizers, steps: range) -> None:
    for step in steps:
        for name, p in sorted(model.named_parameters()):
            full = random_tensors([tuple(p.shape)], 90 + step + 1000 * len(name))[0]
            p.grad = distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None)
        optimizers.step()
        optimizers.zero_grad()


@case("torchtitan_container_steps_and_resumes_bitwise", (2,))
def _torchtitan(ctx: Context) -> None:
    """The installed torchtitan's container: one Muon per model part, its FQN-flattened
    state dict saved with DCP and loaded back through its ``load_state_dict`` (which takes
    the groups too): steps 4-5 of the resumed run bitwise those of an uninterrupted one."""
    import torch.distributed.checkpoint as dcp

    reference = _fully_sharded_moe(ctx)
    ref_opt = _torchtitan_container(reference)
    _train(reference, ref_opt, range(5))

    model = _fully_sharded_moe(ctx)
    optimizers = _torchtitan_container(model)
    problems = []
    if [type(o) for o in optimizers] != [Muon]:
        problems.append(f"the container built {[type(o).__name__ for o in optimizers]}")
    _train(model, optimizers, range(3))
    folder = str(_shared_dir())
    dcp.save({"model": model.state_dict(), "optim": optimizers.state_dict()}, checkpoint_id=folder)

    resumed = _fully_sharded_moe(ctx)
    resumed_opt = _torchtitan_container(resumed)
    state = {"model": resumed.state_dict(), "optim": resumed_opt.state_dict()}
    dcp.load(state, checkpoint_id=folder)
    resumed.load_state_dict(state["model"])
    resumed_opt.load_state_dict(state["optim"])
    _train(resumed, resumed_opt, range(3, 5))
    if [g["step"] for g in resumed_opt.optimizers[0].param_groups] != [5, 5]:
        problems.append("the resumed optimizer's step counters are not 5")
    for (n, p), q in zip(reference.named_parameters(), resumed.parameters()):
        if not torch.equal(local_tensor(p), local_tensor(q)):
            problems.append(f"{n} differs after the resume")
    fail_on(problems)
    if ctx.rank == 0:
        print(f"torchtitan {_version('torchtitan')} container: resumed bitwise", flush=True)


@case("torchtitan_container_overlapped_bitwise", (2,))
def _torchtitan_overlapped(ctx: Context) -> None:
    """torchtitan's container with ``overlap="forward"`` (issue #32): its ``step`` and
    ``zero_grad`` call each optimizer's, the new grads are written while a step may still
    run (it holds the ones it began with), its ``state_dict`` waits; five steps bitwise the
    sequential container's, the state dict taken mid-run too."""
    reference, model = _fully_sharded_moe(ctx), _fully_sharded_moe(ctx)
    ref_opt = _torchtitan_container(reference)
    optimizers = _torchtitan_container(model, overlap="forward")
    problems = []
    if [o.overlap for o in optimizers] != ["forward"]:
        problems.append(f"the container built overlap {[o.overlap for o in optimizers]}")
    _train(reference, ref_opt, range(3))
    _train(model, optimizers, range(3))
    saved, expected = optimizers.state_dict(), ref_opt.state_dict()
    if sorted(saved) != sorted(expected):
        problems.append("the overlapped container's state dict has other keys")
    for key, value in expected.items():
        if isinstance(value, torch.Tensor) and not torch.equal(
            local_tensor(value), local_tensor(saved[key])
        ):
            problems.append(f"state {key} differs mid-run")
    _train(reference, ref_opt, range(3, 5))
    _train(model, optimizers, range(3, 5))
    for opt in optimizers:
        opt.synchronize()
    for (n, p), q in zip(reference.named_parameters(), model.parameters()):
        if not torch.equal(local_tensor(p), local_tensor(q)):
            problems.append(f"{n} differs from the sequential container's")
    fail_on(problems)


# ------------------------------------------------------------------ prime-rl's loop


def _prime_rl_optimizer(model: nn.Module, mesh, **extra) -> Muon:
    """prime-rl's ``_create_muon_optimizer``: its groups (routers to Muon, experts with
    ``distributed_mesh_name``, ``adjust_lr="rms_norm"``) and dion's constructor keywords."""
    from shardmuon.routing import build_param_groups

    routed = build_param_groups(model.named_parameters(), lr=0.02, weight_decay=0.01)
    return Muon(
        routed.groups, lr=0.02, mu=0.95, betas=(0.9, 0.95), weight_decay=0.01, epsilon=1e-8,
        nesterov=True, adjust_lr="rms_norm", world_mesh=mesh, fsdp_mesh_dim=0, **extra,
    )  # fmt: skip


def _warmup_cosine(step: int) -> float:
    return min(1.0, (step + 1) / 2) * (0.55 + 0.45 * math.cos(math.pi * step / 8))


def _prime_rl_loop(ctx, model, opt, scheduler, steps: range, checkpoint_at=None):
    """prime-rl's trainer loop: two micro-batches accumulated, the grads clipped, step,
    scheduler, zero_grad, then the weights gathered for the inference server (a read of
    every parameter right after ``step()``); a DCP checkpoint of the model and
    ``optimizer.state_dict()`` after step ``checkpoint_at``. Returns the losses and the
    broadcast weights of every step."""
    import torch.distributed.checkpoint as dcp

    losses, broadcasts, folder = [], [], None
    for step in steps:
        for micro in range(2):
            x = random_tensors([(6, 8)], 500 + 10 * step + micro)[0]
            loss = model(x).square().mean() / 2
            loss.backward()
            losses.append(loss.detach().clone())
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        opt.step()
        scheduler.step()
        opt.zero_grad()
        broadcasts.append({k: v.full_tensor() for k, v in model.state_dict().items()})
        if step == checkpoint_at:
            folder = str(_shared_dir())
            saved = {"model": model.state_dict(), "optimizer": opt.state_dict()}
            dcp.save(saved, checkpoint_id=folder)
            torch.save(scheduler.state_dict(), f"{folder}/scheduler-{ctx.rank}.pt")
    return losses, broadcasts, folder


def _resumed_run_problems(expected, losses, broadcasts, reference_model, resumed_model):
    """Where a run interrupted by a checkpoint differs from the uninterrupted one
    (``expected``: its losses and broadcast weights): every loss, every broadcast weight,
    and the final weights."""
    problems = [f"loss {k} differs" for k, (a, b) in enumerate(zip(losses, expected[0])) if a != b]
    for step, (got, want) in enumerate(zip(broadcasts, expected[1])):
        problems += [f"step {step}: {k} differs" for k in want if not torch.equal(got[k], want[k])]
    for (n, p), q in zip(reference_model.named_parameters(), resumed_model.parameters()):
        if not torch.equal(local_tensor(p), local_tensor(q)):
            problems.append(f"{n} differs after the resume")
    return problems


@case("prime_rl_loop_overlapped_bitwise", (2, 4))
def _prime_rl_overlapped(ctx: Context) -> None:
    """prime-rl's call site and loop with ``overlap="forward"`` (issue #32), under random
    per-rank delays in the background: every loss and every broadcast weight equal the
    sequential run's; the checkpoint taken right after a step, loaded prime-rl's way (DCP
    *in place* into a fresh optimizer's ``state_dict()``), resumes bitwise."""
    import torch.distributed.checkpoint as dcp
    from dist_overlap_cases import RandomDelays
    from torch.optim.lr_scheduler import LambdaLR

    def build(**extra) -> tuple[nn.Module, Muon, LambdaLR]:
        model = _fully_sharded_moe(ctx, experts=(2, 3, 2))
        opt = _prime_rl_optimizer(model, ctx.mesh, **extra)
        return model, opt, LambdaLR(opt, _warmup_cosine)

    reference = build()
    expected = _prime_rl_loop(ctx, *reference, range(6))[:2]
    model, opt, scheduler = build(overlap="forward")
    opt.overlap_with(model)
    with RandomDelays(ctx.rank):
        losses, broadcasts, folder = _prime_rl_loop(ctx, model, opt, scheduler, range(3), 2)
        resumed_model, resumed, resumed_scheduler = build(overlap="forward")
        loaded = {"model": resumed_model.state_dict(), "optimizer": resumed.state_dict()}
        dcp.load(loaded, checkpoint_id=folder)
        resumed_model.load_state_dict(loaded["model"])
        resumed_scheduler.load_state_dict(torch.load(f"{folder}/scheduler-{ctx.rank}.pt"))
        for group, lr in zip(resumed.param_groups, resumed_scheduler.get_last_lr()):
            group["lr"] = lr
        resumed.overlap_with(resumed_model)
        more = _prime_rl_loop(ctx, resumed_model, resumed, resumed_scheduler, range(3, 6))
    resumed.synchronize()
    problems = _resumed_run_problems(
        expected, losses + more[0], broadcasts + more[1], reference[0], resumed_model
    )
    fail_on(problems)


@case("prime_rl_in_place_resume_restores_group_settings", (2,))
def _prime_rl_group_settings(ctx: Context) -> None:
    """prime-rl's checkpoint loaded its way (DCP *in place* into a fresh optimizer's
    ``state_dict()``, no ``load_state_dict``) with a warm-up schedule: the groups' lr (and
    every scheduled setting) come back from the checkpoint, so the first resumed step uses
    the saved lr, not the fresh optimizer's, with nothing set by hand; losses, broadcast
    weights and final weights bitwise the uninterrupted run's."""
    import torch.distributed.checkpoint as dcp
    from torch.optim.lr_scheduler import LambdaLR

    def build() -> tuple[nn.Module, Muon, LambdaLR]:
        model = _fully_sharded_moe(ctx, experts=(2, 3, 2))
        opt = _prime_rl_optimizer(model, ctx.mesh)
        return model, opt, LambdaLR(opt, _warmup_cosine)

    reference = build()
    expected = _prime_rl_loop(ctx, *reference, range(6))[:2]
    model, opt, scheduler = build()
    losses, broadcasts, folder = _prime_rl_loop(ctx, model, opt, scheduler, range(3), 2)
    resumed_model, resumed, resumed_scheduler = build()
    loaded = {"model": resumed_model.state_dict(), "optimizer": resumed.state_dict()}
    dcp.load(loaded, checkpoint_id=folder)
    resumed_model.load_state_dict(loaded["model"])
    resumed_scheduler.load_state_dict(torch.load(f"{folder}/scheduler-{ctx.rank}.pt"))
    more = _prime_rl_loop(ctx, resumed_model, resumed, resumed_scheduler, range(3, 6))
    problems = _resumed_run_problems(
        expected, losses + more[0], broadcasts + more[1], reference[0], resumed_model
    )
    lrs = [g["lr"] for g in resumed.param_groups]
    if lrs != [g["lr"] for g in reference[1].param_groups]:
        problems.append(f"lr after the resume {lrs}")
    fail_on(problems)


def _version(package: str) -> str:
    from importlib.metadata import version

    return version(package)


# ------------------------------------------------------------------ torchtitan's own models


def _tiny_qwen3_moe():
    """torchtitan's Qwen3-MoE at a CPU's size (``scripts/compare_distmuon.py``'s builder):
    2 layers, dim 64, fused qkv (4 heads of 16), 4 experts of 64x64, top-2 routing."""
    import importlib.util

    from torchtitan.models.qwen3 import model_registry

    script = Path(__file__).resolve().parents[2] / "scripts" / "compare_distmuon.py"
    loader = importlib.util.spec_from_file_location("compare_distmuon", script)
    module = importlib.util.module_from_spec(loader)
    loader.loader.exec_module(module)
    spec = model_registry("debugmodel_moe")
    spec.model = module.qwen3_moe_config(dim=64, experts=4, head_dim=16)
    return spec


def _tiny_llama3():
    """torchtitan's Llama-3 debug model (dim 256, fused qkv) cut to 2 layers."""
    from torchtitan.models.llama3 import model_registry

    spec = model_registry("debugmodel")
    spec.model.layers = spec.model.layers[:2]
    return spec


@case("torchtitan_recipe_fsdp_tp_ep_bitwise", (4,))
def _torchtitan_recipe(ctx: Context) -> None:
    """docs/integrations.md's torchtitan recipe on torchtitan's own models and parallelisms:
    ``with_muon`` on a registry config, the model parallelized by the model's own
    ``parallelize_fn`` (Llama-3: FSDP2 x TP 2x2, fused qkv ``_StridedShard``; Qwen3-MoE: FSDP2
    x TP x EP 2x2x2, expert stacks over ``("efsdp", "ep")``), the optimizers built by
    ``config.optimizer.build(model_parts=...)`` as torchtitan's trainer does, and two steps
    bitwise those of the same recipe on plain tensors in one process; the routing is
    ``build_param_groups(model)``'s."""
    import torchtitan.distributed.parallel_dims as parallel_dims_module
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims

    from shardmuon.integrations.torchtitan import MuonOptimizers, with_muon
    from shardmuon.routing import build_param_groups

    # torchtitan builds its meshes on "cuda" when no accelerator is found.
    parallel_dims_module.device_type = "cpu"
    problems = []
    for family, spec, ep in (("llama3", _tiny_llama3(), 1), ("qwen3_moe", _tiny_qwen3_moe(), 2)):
        parallelism = ParallelismConfig(
            data_parallel_shard_degree=2, tensor_parallel_degree=2, expert_parallel_degree=ep,
            spmd_backend="partial_dtensor",
        )  # fmt: skip
        config = SimpleNamespace(parallelism=parallelism, optimizer=None)
        with_muon(config, lr=0.02, weight_decay=0.1, adamw_lr=0.01, nesterov=True)
        if not isinstance(config.optimizer, MuonOptimizers.Config):
            problems.append(f"{family}: with_muon gave {type(config.optimizer).__name__}")
        spec.model.update_from_config(config=config)
        dims = ParallelDims.from_config(parallelism, ctx.world_size)
        dims.build_mesh()
        with torch.device("meta"):
            model = spec.model.build()
            plain = spec.model.build()
        model = spec.parallelize_fn(
            model, parallel_dims=dims, training=TrainingConfig(), parallelism=parallelism,
            compile_config=CompileConfig(), ac_config=None, dump_folder=tempfile.gettempdir(),
        )  # fmt: skip
        model.to_empty(device="cpu")
        plain.to_empty(device="cpu")
        with torch.no_grad():
            for (name, p), q in zip(model.named_parameters(), plain.parameters()):
                full = random_tensors([tuple(p.shape)], 7 + len(name))[0] * 0.05
                p.copy_(distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None))
                q.copy_(full)
        optimizers = config.optimizer.build(model_parts=[model])
        reference = config.optimizer.build(model_parts=[plain])
        names = {id(p): n for n, p in plain.named_parameters()}
        by_kind = {
            names[id(p)]: g["algorithm"]
            for g in build_param_groups(plain, lr=0.02, weight_decay=0.1).groups
            for p in g["params"]
        }
        by_pattern = {
            n: g["algorithm"]
            for g in reference.optimizers[0].param_groups
            for n in g["param_names"]
        }
        if by_pattern != by_kind:
            problems.append(
                f"{family}: the recipe's patterns route otherwise than the model's kinds"
            )
        if (
            not any(p.ndim == 3 for g in reference.optimizers[0].param_groups for p in g["params"])
            and ep > 1
        ):
            problems.append(f"{family}: no expert stack reached Muon")
        for step in range(2):
            for (name, p), q in zip(model.named_parameters(), plain.parameters()):
                full = random_tensors([tuple(p.shape)], 100 * step + len(name))[0]
                p.grad = distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None)
                q.grad = full.clone()
            optimizers.step()
            reference.step()
            optimizers.zero_grad()
            reference.zero_grad()
        for (name, p), q in zip(model.named_parameters(), plain.parameters()):
            if not torch.equal(p.full_tensor(), q):
                problems.append(f"{family}: {name} {p.placements} differs from one process")
    fail_on(problems)
