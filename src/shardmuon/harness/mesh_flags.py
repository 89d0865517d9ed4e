"""``--mesh`` as the commands take it: checked against ``--layout`` and the world size in
the command's own terms, and the note that says which mesh a 2-D layout chose."""

from __future__ import annotations

from collections.abc import Sequence

from shardmuon.harness.parallel import LayoutPlan, plan_layout

__all__ = [
    "check_mesh",
    "default_mesh_note",
]


# --mesh's form per layout, as the commands' help spells it.
MESH_FORMS = {"fsdp": "N", "hsdp": "REPLICATExSHARD", "ep": "EPxDP", "fsdp-tp": "DPxTP"}


def check_mesh(
    layout: str, world_size: int, mesh_shape: tuple[int, ...] | None, world: str
) -> LayoutPlan:
    """:func:`shardmuon.harness.parallel.plan_layout`, with ``--mesh`` errors in a command's terms.

    ``world`` says where ``world_size`` comes from, as the command spells it
    (``"--nproc 3"``, ``"--world-size 8"``): a mesh whose dims do not multiply to it is
    refused naming it, not "the number of processes" (``bench plan`` starts none). Raises
    ``ValueError`` naming the ``--mesh`` given and the form accepted, with an example.
    """
    if mesh_shape is None:
        return plan_layout(layout, world_size)
    given = "x".join(map(str, mesh_shape))
    if layout == "none":
        raise ValueError(f"--layout none takes no --mesh (got {given})")
    form = MESH_FORMS[layout]
    example = "x".join(map(str, plan_layout(layout, world_size).mesh_shape))
    accepted = f"{layout}: {form}, e.g. {example}"
    dims = form.count("x") + 1
    if len(mesh_shape) != dims:
        raise ValueError(f"--mesh {given} for --layout {layout}: give {dims} dims ({accepted})")
    if any(d < 1 for d in mesh_shape):
        raise ValueError(f"--mesh {given}: every dim must be >= 1 ({accepted})")
    ranks = 1
    for d in mesh_shape:
        ranks *= d
    if ranks != world_size:
        raise ValueError(
            f"--mesh {given} has {ranks} ranks, but {world}: the mesh dims must multiply to "
            f"{world_size} ({accepted})"
        )
    return plan_layout(layout, world_size, mesh_shape)


def describe_mesh(plan: LayoutPlan) -> str:
    """What ``plan``'s mesh does, in words: ``"2 replicas of 4 shards"`` for hsdp 2x4."""

    def count(n: int, what: str) -> str:
        return f"{n} {what}{'' if n == 1 else 's'}"

    shape = plan.mesh_shape
    if plan.layout == "hsdp":
        return f"{count(shape[0], 'replica')} of {count(shape[1], 'shard')}"
    if plan.layout == "ep":
        return f"experts split over {shape[0]} (EP), FSDP over {shape[1]}"
    if plan.layout == "fsdp-tp":
        return f"FSDP over {shape[0]}, tensor parallel over {shape[1]}"
    if plan.layout == "fsdp":
        return f"FSDP over {count(shape[0], 'rank')}"
    return "no mesh"


def default_mesh_note(plans: Sequence[LayoutPlan], worlds: Sequence[str]) -> str | None:
    """The note that says which mesh a 2-D layout chose, ``--mesh`` having been left out.

    ``worlds[i]`` names where ``plans[i]``'s world size came from (``"--nproc 4"``,
    ``"8 ranks"``). ``None`` for a layout whose mesh leaves no choice (``none``, ``fsdp``).
    """
    layout = plans[0].layout
    if layout not in ("hsdp", "ep", "fsdp-tp"):
        return None
    meshes = ", ".join(
        f"{'x'.join(map(str, plan.mesh_shape))} for {world} ({describe_mesh(plan)})"
        for plan, world in zip(plans, worlds)
    )
    other = "another" if len(plans) == 1 else "others"
    return f"--layout {layout}: mesh {meshes}; --mesh {MESH_FORMS[layout]} chooses {other}"
