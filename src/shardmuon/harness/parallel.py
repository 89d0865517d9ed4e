"""Lay a model out over processes with FSDP2 / DTensor, for benchmarks and training.

Layouts (``world_size`` = number of processes):

- ``none``: plain tensors, every rank holds everything (like DDP).
- ``fsdp``: ``fully_shard`` on each decoder layer, then on the root, over a 1-D mesh
  ``("dp_shard",)``. 2-D weights get ``Shard(0)``; 3-D expert stacks ``Shard(0)`` on the
  expert dim.
- ``hsdp``: the same on a 2-D mesh ``("dp_replicate", "dp_shard")``: placements
  ``(Replicate(), Shard(0))``.
- ``ep``: expert parallel as torchtitan and prime-rl build it (``--mesh EPxDP``): a mesh
  ``("dp_shard_mod_ep", "ep")`` of shape ``(DP, EP)`` (the ranks of an EP group adjacent),
  expert stacks split on the expert dim over ``ep`` (``distribute_tensor(Shard(0))``, as
  torchtitan's ``ExpertParallel``), then each ``experts`` module ``fully_shard`` over
  ``dp_shard_mod_ep`` with torchtitan's placement rule: the expert dim again
  (``(_StridedShard(0, sf=EP), Shard(0))``: every rank holds whole experts) while
  ``DP x EP`` does not exceed the expert count, else the rows (``(Shard(1), Shard(0))``).
  Every other param is FSDP2 over all ranks (the flattened mesh ``dp_shard``). Gives params
  and grads their layout, which is all the optimizer benchmark needs (no forward: that
  needs the token all-to-all of a real EP model).
- ``fsdp-tp``: torchtitan's 2-D layout on a mesh ``("dp", "tp")``: tensor parallel over
  ``tp`` (``parallelize_module``: ``ColwiseParallel`` for ``q/k/v_proj`` and the MLPs'
  ``gate_proj``/``up_proj``, ``RowwiseParallel`` for ``o_proj``/``down_proj``; the token
  embedding row-wise over the vocabulary and ``lm_head`` column-wise, both with replicated
  outputs), then ``fully_shard`` per decoder layer and on the root over ``dp``. Colwise
  weights get ``(_StridedShard(0, sf=tp), Shard(0))``, rowwise ones ``(Shard(0),
  Shard(1))``. Expert stacks are not tensor parallel (see :func:`tensor_parallel_plan`):
  each ``experts`` module is its own FSDP2 unit over all ``dp x tp`` ranks (the flattened
  mesh ``dp_tp``), ``Shard(0)`` on the expert dim, so no two ranks hold or orthogonalize
  the same expert; every ``tp`` rank runs the experts on the same replicated activations,
  and averaging their (equal) grads over ``tp`` as well as ``dp`` gives FSDP-over-``dp``'s
  grad. Routers and norms are FSDP over ``dp`` alone (replicated over ``tp``). Attention runs on each rank's
  local heads, so the head counts must be multiples of ``tp``. Trains exactly like one
  process (within float tolerance); batches are split over ``dp`` only.

:func:`plan_layout` checks a layout against a world size without touching
``torch.distributed``, so a command line can reject it before starting processes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

__all__ = [
    "LAYOUTS",
    "LayoutPlan",
    "apply_layout",
    "decoder_layers",
    "expert_modules",
    "experts_shard_placement",
    "parse_mesh_shape",
    "plan_layout",
    "tensor_parallel_plan",
]

LAYOUTS: tuple[str, ...] = ("none", "fsdp", "hsdp", "ep", "fsdp-tp")
EXPERT_MESH_NAME = "ep"
# The ep layout's mesh, torchtitan's names: FSDP outside, EP inside (adjacent ranks).
EP_MESH_DIM_NAMES = ("dp_shard_mod_ep", "ep")

_MESH_DIM_NAMES: dict[str, tuple[str, ...]] = {
    "none": (),
    "fsdp": ("dp_shard",),
    "hsdp": ("dp_replicate", "dp_shard"),
    "ep": ("ep", "dp"),
    "fsdp-tp": ("dp", "tp"),
}


@dataclass(frozen=True)
class LayoutPlan:
    """A checked layout: its name, the world size and the mesh shape it will use."""

    layout: str
    world_size: int
    mesh_shape: tuple[int, ...]

    @property
    def mesh_dim_names(self) -> tuple[str, ...]:
        """Names of the mesh dims, e.g. ``("dp_replicate", "dp_shard")`` for ``hsdp``."""
        return _MESH_DIM_NAMES[self.layout]


@dataclass
class AppliedLayout:
    """What :func:`apply_layout` did: the plan, the meshes it built (by name) and the model."""

    plan: LayoutPlan
    model: nn.Module
    meshes: dict[str, object] = field(default_factory=dict)

    @property
    def expert_mesh_name(self) -> str | None:
        """The mesh name experts live on (``"ep"`` for the ``ep`` layout), else ``None``."""
        return EXPERT_MESH_NAME if self.plan.layout == "ep" else None


def _default_mesh_shape(layout: str, world_size: int) -> tuple[int, ...]:
    if layout == "none":
        return ()
    if layout == "fsdp":
        return (world_size,)
    if layout == "fsdp-tp":
        # Tensor parallel over pairs of ranks when possible (4 -> 2x2), the rest FSDP.
        return (world_size // 2, 2) if world_size % 2 == 0 else (world_size, 1)
    if layout == "hsdp":
        # Two replicas when possible: the smallest layout that has both a replicate and a
        # shard dim; with 2 processes this is (2, 1), i.e. pure replication.
        return (2, world_size // 2) if world_size % 2 == 0 else (1, world_size)
    # ep: split the experts over all ranks unless there are 4+ (then keep an FSDP dim of 2
    # so that expert stacks carry two shard placements, as on a real EP x FSDP run).
    if world_size >= 4 and world_size % 2 == 0:
        return (world_size // 2, 2)
    return (world_size, 1)


def plan_layout(
    layout: str, world_size: int, mesh_shape: tuple[int, ...] | None = None
) -> LayoutPlan:
    """Check ``layout`` for ``world_size`` processes; fill in the default mesh shape.

    ``mesh_shape`` is ``(world_size,)`` for ``fsdp``, ``(replicate, shard)`` for ``hsdp``,
    ``(ep, dp)`` for ``ep`` (the mesh itself is laid out ``(dp, ep)``, see the module
    docstring) and ``(dp, tp)`` for ``fsdp-tp``; its product must equal
    ``world_size``. Raises
    ``ValueError`` naming what was given and what is accepted.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; accepted: {', '.join(LAYOUTS)}")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world size must be an int >= 1, got {world_size!r}")
    if mesh_shape is None:
        mesh_shape = _default_mesh_shape(layout, world_size)
    mesh_shape = tuple(mesh_shape)
    if any(isinstance(d, bool) or not isinstance(d, int) or d < 1 for d in mesh_shape):
        raise ValueError(f"mesh shape must hold ints >= 1, got {mesh_shape!r}")
    wanted = len(_MESH_DIM_NAMES[layout])
    if layout == "none":
        if mesh_shape:
            raise ValueError(f"layout 'none' takes no mesh shape, got {mesh_shape!r}")
    elif len(mesh_shape) != wanted:
        names = " x ".join(_MESH_DIM_NAMES[layout])
        raise ValueError(
            f"layout {layout!r} needs a {wanted}-D mesh shape ({names}), got {mesh_shape!r}"
        )
    elif _product(mesh_shape) != world_size:
        raise ValueError(
            f"mesh shape {'x'.join(map(str, mesh_shape))} for layout {layout!r} has "
            f"{_product(mesh_shape)} ranks but the world size is {world_size}; the product "
            "of the mesh shape must equal the number of processes"
        )
    return LayoutPlan(layout, world_size, mesh_shape)


def parse_mesh_shape(text: str | None, accepted: str) -> tuple[int, ...] | None:
    """A ``--mesh`` value such as ``2x2`` as ``(2, 2)`` (``None`` stays ``None``); a bad one
    raises ``ValueError`` naming it and ``accepted`` (the caller's form, e.g. ``DPxTP``)."""
    if text is None:
        return None
    try:
        return tuple(int(d) for d in text.lower().split("x"))
    except ValueError:
        raise ValueError(f"bad --mesh {text!r}; accepted: {accepted}") from None


def _product(shape: tuple[int, ...]) -> int:
    out = 1
    for d in shape:
        out *= d
    return out


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The decoder blocks of a Hugging Face causal LM (the ``layers`` ``ModuleList``)."""
    for name, module in model.named_modules():
        if name.endswith("layers") and isinstance(module, nn.ModuleList):
            return list(module)
    return []


def _world_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _device_type() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def apply_layout(
    model: nn.Module,
    layout: str,
    *,
    world_size: int | None = None,
    mesh_shape: tuple[int, ...] | None = None,
    device_type: str | None = None,
) -> AppliedLayout:
    """Lay ``model`` out in place as ``layout`` (see the module docstring); returns what was built.

    Needs an initialised process group for any layout but ``none``; ``world_size``
    defaults to its size. Every rank must hold the same full weights beforehand (build
    the model with the same seed), since each rank keeps its own slice.
    """
    if world_size is None:
        world_size = _world_size()
    plan = plan_layout(layout, world_size, mesh_shape)
    if layout == "none":
        return AppliedLayout(plan, model)

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if not dist.is_initialized():
        raise ValueError(
            f"layout {layout!r} needs torch.distributed to be initialised; use layout 'none' "
            "for a single process"
        )
    if dist.get_world_size() != world_size:
        raise ValueError(
            f"world_size={world_size} given but the process group has {dist.get_world_size()} ranks"
        )
    device_type = device_type or _device_type()
    if layout in ("fsdp", "hsdp"):
        mesh = init_device_mesh(device_type, plan.mesh_shape, mesh_dim_names=plan.mesh_dim_names)
        _fully_shard(model, mesh)
        return AppliedLayout(plan, model, {"dp": mesh})
    if layout == "fsdp-tp":
        mesh = init_device_mesh(device_type, plan.mesh_shape, mesh_dim_names=plan.mesh_dim_names)
        _tensor_parallel(model, mesh["tp"])
        # Experts are not split over tp (see tensor_parallel_plan) but over every rank, on
        # the expert dim: no tp rank repeats another's experts, in memory or in Muon.
        experts_mesh = mesh._flatten("dp_tp")
        for experts in expert_modules(model):
            _fully_shard_unit(experts, experts_mesh)
        _fully_shard(model, mesh["dp"])
        meshes = {"dp": mesh["dp"], "tp": mesh["tp"], "dp_tp": mesh, "experts": experts_mesh}
        return AppliedLayout(plan, model, meshes)
    ep, dp = plan.mesh_shape
    mesh = init_device_mesh(device_type, (dp, ep), mesh_dim_names=EP_MESH_DIM_NAMES)
    dense_mesh = mesh._flatten("dp_shard")
    _expert_parallel(model, mesh)
    _fully_shard(model, dense_mesh)
    return AppliedLayout(plan, model, {EXPERT_MESH_NAME: mesh, "dp": dense_mesh})


def _fully_shard(model: nn.Module, mesh) -> None:
    for layer in decoder_layers(model):
        _fully_shard_unit(layer, mesh)
    _fully_shard_unit(model, mesh)


def _fully_shard_unit(module: nn.Module, mesh) -> None:
    from torch.distributed.fsdp import fully_shard

    fully_shard(module, mesh=mesh)


def expert_modules(model: nn.Module) -> list[nn.Module]:
    """The MoE ``experts`` modules (those holding 3-D ``[E, out, in]`` stacks)."""
    return [
        module
        for name, module in model.named_modules()
        if name.endswith("experts") and any(p.dim() == 3 for p in module.parameters())
    ]


# Linear layers by the last part of their name: column-wise (output features split, output
# sharded on its last dim) or row-wise (input features split, output all-reduced).
_COLWISE = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
_ROWWISE = ("o_proj", "down_proj")
# Per-head norms (Qwen3's q_norm/k_norm over head_dim): they see only the local heads.
_HEAD_NORMS = ("q_norm", "k_norm")


def tensor_parallel_plan(model: nn.Module) -> dict[str, object]:
    """The ``parallelize_module`` plan of ``fsdp-tp``: module name -> ``ParallelStyle``.

    torchtitan's plan without sequence parallel: ``q/k/v_proj`` and every MLP's
    ``gate_proj``/``up_proj`` (the dense MLPs and shared experts; plain ``nn.Linear``)
    ``ColwiseParallel`` and ``o_proj``/``down_proj`` ``RowwiseParallel``, so each rank
    computes its own heads and its own slice of the MLP's hidden features and one
    all-reduce per block restores the replicated residual stream. ``embed_tokens`` is
    ``RowwiseParallel`` over the vocabulary and ``lm_head`` ``ColwiseParallel``, both with
    replicated outputs (the loss sees whole logits). Qwen3's per-head ``q_norm``/``k_norm``
    get torchtitan's ``SequenceParallel(sequence_dim=2)``: a replicated weight applied to
    the local heads, whose grad is summed over the ``tp`` ranks.

    Left out: MoE expert stacks (Hugging Face fuses gate and up into one ``[E, 2I, H]``
    tensor whose halves are chunked in the forward: a contiguous split of dim 1 would give
    one rank all of gate and the other all of up), routers (``[E, H]``, tiny, their logits
    feed a top-k that must see all experts) and norms. They stay plain tensors, and every
    ``tp`` rank computes them on the same replicated activations with the same weights, so
    their grads are the same on every ``tp`` rank; FSDP shards and reduces them (experts
    over all ``dp x tp`` ranks, the rest over ``dp``: see :func:`apply_layout`).
    """
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
    )

    plan: dict[str, object] = {}
    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if isinstance(module, nn.Embedding) and leaf == "embed_tokens":
            plan[name] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
        elif isinstance(module, nn.Linear) and leaf == "lm_head":
            plan[name] = ColwiseParallel(output_layouts=Replicate())
        elif isinstance(module, nn.Linear) and leaf in _COLWISE:
            plan[name] = ColwiseParallel()
        elif isinstance(module, nn.Linear) and leaf in _ROWWISE:
            plan[name] = RowwiseParallel()
        elif leaf in _HEAD_NORMS and getattr(module, "weight", None) is not None:
            # Normalises each local head: input [batch, seq, heads, head_dim] sharded on
            # the heads, weight replicated; its grad is summed over the tp ranks' heads.
            plan[name] = SequenceParallel(sequence_dim=2, use_local_output=True)
    return plan


def _check_heads(model: nn.Module, tp: int) -> None:
    config = getattr(model, "config", None)
    for key in ("num_attention_heads", "num_key_value_heads"):
        heads = getattr(config, key, None)
        if heads is not None and heads % tp:
            raise ValueError(
                f"layout 'fsdp-tp' splits attention heads over tp={tp} ranks but the model has "
                f"{key}={heads}; choose a tp (the second --mesh dim) that divides it"
            )


def _tensor_parallel(model: nn.Module, tp_mesh) -> None:
    from torch.distributed.tensor.parallel import parallelize_module

    _check_heads(model, tp_mesh.size())
    parallelize_module(model, tp_mesh, tensor_parallel_plan(model))


def experts_shard_placement(num_experts: int, dp: int, ep: int):
    """torchtitan's FSDP placement of expert stacks already split over ``ep``: the expert
    dim again while there are experts for every rank, else the rows of each expert."""
    from torch.distributed.tensor import Shard

    return Shard(1) if dp * ep > num_experts else Shard(0)


def _expert_parallel(model: nn.Module, mesh) -> None:
    """EP over ``mesh["ep"]`` (the expert dim), then FSDP2 over ``mesh["dp_shard_mod_ep"]``."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor

    dp_mesh, ep_mesh = mesh["dp_shard_mod_ep"], mesh["ep"]
    for experts in expert_modules(model):
        stacks = [p for p in experts.parameters(recurse=False) if p.dim() == 3]
        for name, param in list(experts.named_parameters(recurse=False)):
            if param.dim() != 3:
                continue
            # src_data_rank=None: every rank already holds the same full tensor, so each
            # takes its own slice without a scatter.
            dt = distribute_tensor(param.detach(), ep_mesh, [Shard(0)], src_data_rank=None)
            experts.register_parameter(name, nn.Parameter(dt, requires_grad=param.requires_grad))
        placement = experts_shard_placement(stacks[0].size(0), dp_mesh.size(), ep_mesh.size())
        fully_shard(experts, mesh=dp_mesh, shard_placement_fn=lambda _param, p=placement: p)
