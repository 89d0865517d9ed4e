"""Chunks of a plan as a trainer sees them: what each holds, whether it communicates, and
the batch ``Muon.orthogonalize_chunk`` builds for directions the caller brings."""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

from shardmuon.planning.batches import MuonBatch, Segment, batch_key
from shardmuon.planning.placements import local_tensor
from shardmuon.planning.plan import AdamWChunk, ChunkInfo, Plan, SinkhornChunk, setting_float

__all__ = ["Chunk", "batch_for_directions", "chunk_info", "communicates"]

Chunk = MuonBatch | SinkhornChunk | AdamWChunk


def communicates(chunk: Chunk) -> bool:
    """Whether stepping ``chunk`` runs a collective (an all-to-all, a replica broadcast, a
    Sinkhorn chunk's all-reduces)."""
    if isinstance(chunk, SinkhornChunk):
        return chunk.communicates
    return isinstance(chunk, MuonBatch) and (chunk.layout.exchanged or chunk.replica is not None)


def chunk_info(plan: Plan, param_groups: list[dict], state: dict, chunk: Chunk) -> ChunkInfo:
    """What ``chunk`` holds: parameters, matrix shapes, this rank's state bytes."""
    if isinstance(chunk, AdamWChunk):
        params = tuple(chunk.params_of(param_groups))
        nbytes = sum(
            local_tensor(state[p][key]).nbytes for p in params for key in ("momentum", "variance")
        )
        return ChunkInfo("adamw", params, (), None, nbytes, False)
    if isinstance(chunk, SinkhornChunk):
        if all(chunk is not c for c in plan.sinkhorn):
            raise ValueError("chunk_info got a chunk that is not in this optimizer's chunks()")
        param = param_groups[chunk.group_index]["params"][chunk.param_index]
        layout = chunk.layout
        nbytes = local_tensor(state[param]["momentum"]).nbytes
        local = (layout.local_rows, layout.local_cols)
        shapes = ((layout.rows, layout.cols),)
        return ChunkInfo("sinkhorn", (param,), shapes, local, nbytes, chunk.communicates)
    if not isinstance(chunk, MuonBatch) or all(chunk is not b for b in plan.batches):
        raise ValueError("chunk_info got a chunk that is not in this optimizer's chunks()")
    layout = chunk.layout
    params = tuple(dict.fromkeys(plan.params[s.param_index] for s in chunk.segments))
    per_matrix = layout.local_rows * layout.local_cols
    nbytes = sum(
        s.count * per_matrix * state[plan.params[s.param_index]]["momentum"].itemsize
        for s in chunk.segments
    )
    shapes = ((layout.rows, layout.cols),) * chunk.num_matrices
    local = (layout.local_rows, layout.local_cols)
    return ChunkInfo("muon", params, shapes, local, nbytes, communicates(chunk))


def batch_for_directions(
    plan: Plan,
    param_groups: list[dict],
    params: Sequence[Tensor],
    directions: Sequence[Tensor],
    first_owner: int,
) -> tuple[MuonBatch, list[int]]:
    """The batch of ``Muon.orthogonalize_chunk``, and the plan indices of ``params``.

    Refuses (``ValueError``, naming what is wrong) parameters that are not this plan's
    Muon parameters, directions not shaped like their parameter's local shard, parameters
    of more than one layout, and more matrices than an exchanged layout's group has ranks.
    The owners are ranks ``first_owner, first_owner + 1, ...`` (mod the group size).
    """
    if len(params) != len(directions) or not params:
        raise ValueError(
            f"orthogonalize_chunk needs one direction per parameter, got {len(params)} "
            f"parameters and {len(directions)} directions"
        )
    index_of = {id(p): i for i, p in enumerate(plan.params)}
    indices = []
    for p in params:
        if id(p) not in index_of:
            raise ValueError(
                f"orthogonalize_chunk: a parameter of shape {tuple(p.shape)} is not a Muon "
                "parameter of this optimizer"
            )
        indices.append(index_of[id(p)])
    for k, (p, u) in enumerate(zip(params, directions)):
        want = tuple(local_tensor(p).shape)
        got = tuple(local_tensor(u).shape) if isinstance(u, Tensor) else None
        if got != want:
            raise ValueError(
                f"orthogonalize_chunk: U[{k}] has local shape {got}; it must be shaped "
                f"like its parameter's local shard, {want} (global shape {tuple(p.shape)})"
            )

    def eps_of(i: int) -> float:
        return setting_float(param_groups[plan.group_of[i]]["epsilon"])

    keys = {
        batch_key(plan.layouts[i], plan.params[i].dtype, plan.partitions[i], eps_of(i))
        for i in indices
    }
    if len(keys) != 1:
        raise ValueError(
            "orthogonalize_chunk needs parameters of one layout (global shape, placements, "
            "dtype, partitions)"
        )
    layout = plan.layouts[indices[0]]
    segments = [Segment(i, 0, plan.layouts[i].num_matrices) for i in indices]
    count = sum(s.count for s in segments)
    owners: tuple[int, ...] = ()
    if layout.exchanged:
        k = layout.group.size
        if count > k:
            raise ValueError(
                f"orthogonalize_chunk got {count} matrices for a shard group of {k} ranks; "
                f"pass at most {k}"
            )
        owners = tuple(sorted((first_owner + j) % k for j in range(count)))
    batch = MuonBatch(
        -1,
        layout=layout,
        segments=segments,
        owners=owners,
        partitions=plan.partitions[indices[0]],
        eps=eps_of(indices[0]),
    )
    return batch, indices
