"""Two-dimensional shards (issue #13): matrices sharded on both matrix dims, or on one matrix
dim twice (``_StridedShard`` included), at world 4 (a 2x2 ``("dp", "tp")`` mesh) and world 8
(a 2x2x2 ``("replicate", "dp", "tp")`` mesh and a 4x2 ``("dp", "tp")`` one). Run by
``test_tp.py``; the cases are in ``dist_tp_layout_cases`` (raw DTensors),
``dist_tp_model_cases`` (a torchtitan-style model), ``dist_tp_checkpoint_cases`` and
``dist_tp_group_cases`` (process groups), their shared checks in ``dist_tp_checks``.

Every case compares the distributed Muon with the same Muon on plain tensors in one process
(params and momentum bitwise, several steps), counts the bytes handed to
``all_to_all_single`` against the minimum implied by the local shapes every rank really
holds and the batches' owners (each piece not on its owner goes there and back once, in
bf16), records every collective of the step (only all-to-alls, plus the agreement check's
all-reduces on the first step), and compares each batch's ``layout.pieces`` with the global
rows and columns DTensor really gives each rank. Each case logs a line
``TRAFFIC case=... sent=... minimum=... ratio=...`` (world totals over all steps) in rank 0's
log, which ``test_tp.py`` collects.
"""

from __future__ import annotations

import dist_tp_checkpoint_cases
import dist_tp_group_cases
import dist_tp_layout_cases
import dist_tp_model_cases
from dist_checks import Case
from dist_tp_checks import make_context

__all__ = ["CASES", "TRAFFIC_CASES", "cases_for", "make_context"]

# The order a world runs them in: a later case may rely on what an earlier one did not do
# (``stages_without_tp_take_no_part`` needs rank sets that no earlier case flattened).
MODULES = (dist_tp_layout_cases, dist_tp_model_cases, dist_tp_checkpoint_cases, dist_tp_group_cases)

CASES: dict[str, Case] = {}
# Cases that log a TRAFFIC line (test_tp.py checks each one did).
TRAFFIC_CASES: set[str] = set()
for _module in MODULES:
    for _name in _module.CASES:
        if _name in CASES:
            raise ValueError(f"case {_name!r} registered twice")
    CASES.update(_module.CASES)
    TRAFFIC_CASES |= _module.TRAFFIC_CASES


def cases_for(world_size: int) -> list[str]:
    return [name for name, c in CASES.items() if world_size in c.worlds]
