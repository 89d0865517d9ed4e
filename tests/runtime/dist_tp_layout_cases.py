"""Two-dimensional shards on raw DTensors (issue #13): each layout of ``LAYOUTS`` (both
matrix dims sharded, one dim twice, ``_StridedShard``, uneven and empty pieces, stacks,
experts, partitions, mixed 1-D and 2-D, bf16, offload, unnamed meshes, HSDP x TP at world 8)
against one process, with the minimum traffic; HSDP x TP with ``split_replicas``; and
``step_chunk``. Part of ``dist_tp_cases``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from dist_checks import S0, S1, S2, Context, R, Spec, compare_with_single, fail_on
from dist_tp_checks import SS0, SS1, WORLD4, WORLD8, TPContext, check_layout, tp_registry
from torch.distributed.tensor.placement_types import _StridedShard

CASES, TRAFFIC_CASES, case = tp_registry()


# name -> (specs, Muon kwargs, worlds)
LAYOUTS: dict[str, tuple[list[Spec], dict, tuple[int, ...]]] = {
    # Five of a shape on a group of 4: a full batch and a short one.
    "s0_s1": (
        [Spec((12, 8), (S0, S1), "2d")] * 5 + [Spec((8, 12), (S0, S1), "2d")],
        {},
        WORLD4,
    ),
    "s1_s0": (
        [Spec((12, 8), (S1, S0), "2d")] * 5 + [Spec((8, 12), (S1, S0), "2d")],
        {"nesterov": False},
        WORLD4,
    ),
    "s0_s0": (
        [Spec((12, 8), (S0, S0), "2d")] * 5 + [Spec((8, 12), (S0, S0), "2d")],
        {"adjust_lr": "spectral_norm"},
        WORLD4,
    ),
    "s1_s1": ([Spec((8, 12), (S1, S1), "2d")] * 3, {}, WORLD4),
    "strided_s0": (
        [Spec((12, 8), (SS0, S0), "2d")] * 5 + [Spec((8, 12), (SS0, S0), "2d")],
        {},
        WORLD4,
    ),
    "strided_s1": ([Spec((8, 12), (SS1, S1), "2d")] * 3, {}, WORLD4),
    # Uneven and empty pieces: 9x7, 5x3, 3x2 (3 rows twice over 2x2: 1, 1, 1, 0 rows).
    "uneven": (
        [
            Spec(shape, placements, "2d")
            for shape in ((9, 7), (5, 3), (3, 2))
            for placements in ((S0, S1), (S1, S0), (S0, S0), (SS0, S0), (S1, S1))
        ],
        {},
        WORLD4,
    ),
    # Stacks with both matrix dims sharded (no batch-dim shard): exchanged matrix by matrix.
    "stacks_two_matrix_dims": (
        [
            Spec((2, 8, 12), (S1, S2), "2d"),
            Spec((3, 9, 7), (S2, S1), "2d"),
            Spec((2, 10, 6), (S1, S1), "2d"),
            Spec((2, 10, 6), (_StridedShard(1, split_factor=2), S1), "2d"),
        ],
        {},
        WORLD4,
    ),
    # Expert parallel on the batch dim (mesh dim 0) plus TP on rows or columns (mesh dim 1);
    # 3 experts on 2 ranks: 2 and 1.
    "experts_ep_tp": (
        [
            Spec((4, 12, 8), (S0, S1), "2d"),
            Spec((3, 10, 6), (S0, S1), "2d"),
            Spec((4, 6, 10), (S0, S2), "2d"),
            Spec((3, 9, 7), (S0, S2), "2d"),
        ],
        {},
        WORLD4,
    ),
    # Partitions (fused row blocks) across the strided and doubly-sharded row sets: each rank's
    # rows cross block boundaries and take each block's own lr scale.
    "partitions": (
        [
            Spec((12, 8), (SS0, S0), "2d", partitions=(4, 8)),
            Spec((12, 8), (S0, S1), "2d", partitions=(5, 7)),
            Spec((12, 8), (S0, S0), "2d", partitions=(3, 9)),
            Spec((12, 8), (S1, S0), "2d", partitions=(6, 6)),
            Spec((2, 14, 6), (S1, S2), "2d", partitions=(7, 7)),
            Spec((12, 8), (S0, S1), "2d"),  # same shape, no partitions: another batch
        ],
        {},
        WORLD4,
    ),
    # One matrix shape under many layouts, 1-D and 2-D, in one optimizer: those over all four
    # ranks share the group's ranks but not its pieces, so must not share a batch.
    "mixed_1d_2d": (
        [
            Spec((12, 8), (S0, S1), "2d"),
            Spec((12, 8), (S0,), "1d"),
            Spec((12, 8), (S1, S0), "2d"),
            Spec((12, 8), (SS0, S0), "2d"),
            Spec((12, 8), (S0, S0), "2d"),
            Spec((12, 8), (R, S0), "2d"),
            Spec((12, 8), (S1, R), "2d"),
            Spec((12, 8), (S1,), "1d"),
            Spec((12, 8)),
            Spec((12, 8), (S0, S1), "2d"),
            Spec((12,), (S0, R), "2d", algorithm="adamw"),
            Spec((12, 8), (S0, S1), "2d", algorithm="adamw"),
        ],
        {},
        WORLD4,
    ),
    # bf16 weights and grads, uneven local lengths on both axes.
    "bf16_weights": (
        [
            Spec((9, 7), (S0, S1), "2d"),
            Spec((9, 7), (S1, S0), "2d"),
            Spec((14, 5), (SS0, S0), "2d"),
            Spec((5, 13), (S1, S1), "2d"),
        ],
        {"dtype": torch.bfloat16},
        WORLD4,
    ),
    # State offload (host state, loaded chunk by chunk) and a small workspace budget (one
    # batch in flight at a time) change nothing on 2-D layouts.
    "offload_small_workspace": (
        [
            Spec((12, 8), (S0, S1), "2d"),
            Spec((12, 8), (S0, S1), "2d"),
            Spec((9, 7), (SS0, S0), "2d"),
            Spec((8, 12), (S1, S0), "2d"),
            Spec((10,), (S0, R), "2d", algorithm="adamw"),
        ],
        {"offload": "state", "offload_prefetch": 1, "workspace_bytes": 1},
        WORLD4,
    ),
    "unnamed_mesh": (
        [Spec((12, 8), (S0, S1), "2d_unnamed"), Spec((9, 7), (SS0, S0), "2d_unnamed")],
        {},
        WORLD4,
    ),
    # ---- world 8
    # HSDP x TP: replicas of a dp x tp shard group.
    "hsdp_tp": (
        [
            Spec((12, 8), (R, S0, S1), "3d"),
            Spec((12, 8), (R, S0, S1), "3d"),
            Spec((12, 8), (R, S0, S1), "3d"),
            Spec((9, 7), (R, SS0, S0), "3d"),
            Spec((8, 12), (R, S1, S0), "3d"),
            Spec((3, 2), (R, S0, S1), "3d"),
            Spec((10,), (R, S0, R), "3d", algorithm="adamw"),
        ],
        {},
        WORLD8,
    ),
    # Experts on mesh dim 0, rows on dp, columns on tp (both matrix dims plus the expert dim);
    # rows twice; a strided row shard; 3 experts on 2 ranks.
    "experts_3d": (
        [
            Spec((4, 12, 8), (S0, S1, S2), "3d"),
            Spec((3, 9, 7), (S0, S1, S2), "3d"),
            Spec((4, 12, 8), (S0, S1, S1), "3d"),
            Spec((2, 12, 8), (S0, SS1, S1), "3d"),
        ],
        {},
        WORLD8,
    ),
    # Three matrix-dim shards: one group of all 8 ranks.
    "three_shards": (
        [
            Spec((12, 10), (S0, S1, S0), "3d"),
            Spec((16, 8), (S0, S0, S0), "3d"),
            Spec((9, 7), (S1, S0, S1), "3d"),
            Spec((12, 10), (_StridedShard(0, split_factor=4), S0, S0), "3d"),
        ],
        {},
        WORLD8,
    ),
    # 4-way dp over 2-way tp, uneven. (Not 9 rows under (SS0, S0): there FSDP2's layout and
    # distribute_tensor's differ; FSDP2's is tested in tp_torchtitan_dp4_tp2.)
    "dp4_tp2": (
        [
            Spec((9, 7), (S0, S1), "2d"),
            Spec((10, 7), (SS0, S0), "2d"),
            Spec((14, 6), (SS0, S0), "2d"),
            Spec((5, 11), (S1, S0), "2d"),
        ],
        {},
        WORLD8,
    ),
}


def _register(name: str, specs: list[Spec], kwargs: dict, worlds: tuple[int, ...]) -> None:
    @case(f"tp_{name}", worlds)
    def run(ctx: Context) -> None:
        check_layout(ctx, f"tp_{name}", specs, **kwargs)


for _name, (_specs, _kwargs, _worlds) in LAYOUTS.items():
    _register(_name, _specs, _kwargs, _worlds)


@case("tp_hsdp_tp_split_replicas", WORLD8, traffic=False)
def _hsdp_tp_split(ctx: TPContext) -> None:
    """HSDP x TP with ``split_replicas``: each batch orthogonalized by one replica (each matrix
    once in the world), results broadcast over the replicate dim; bitwise one process."""
    specs = LAYOUTS["hsdp_tp"][0]
    opt, problems = compare_with_single(ctx, specs, check_traffic=False, split_replicas=True)
    stats = opt.last_step_stats
    gathered: list = [None] * ctx.world_size
    dist.all_gather_object(gathered, (stats.matrices_orthogonalized, stats.replica_bytes_received))
    muon = [s for s in specs if s.algorithm == "muon"]
    if sum(g[0] for g in gathered) != len(muon):
        problems.append(
            f"orthogonalized {[g[0] for g in gathered]} per rank, expected {len(muon)} in all"
        )
    if sum(g[1] for g in gathered) == 0:
        problems.append("no replica bytes received: the replicas did not share the work")
    fail_on(problems)


@case("tp_chunked", WORLD4)
def _chunked(ctx: Context) -> None:
    """``chunks()``/``step_chunk``: the same bits and bytes as ``step()``."""
    specs = LAYOUTS["mixed_1d_2d"][0] + LAYOUTS["partitions"][0][:2]
    check_layout(ctx, "tp_chunked", specs, chunked=True)
