"""Step transient memory per rank on a tiny Qwen3-MoE-like model, measured with the CPU profiler.

The tiny Qwen3-MoE-like model (hidden 512, 4 layers: layer 0 dense, layers 1-3
with 8 experts as [8, 512, 512] / [8, 512, 256] stacks and an [8, 512] router; embed and
lm_head [1024, 512] on AdamW), every weight a DTensor ``Shard(0)`` on a 1-D mesh (FSDP2's
placement), Nesterov, weight decay 0.1, one thread per rank (gloo). One Newton-Schulz
iteration instead of five: memory does not depend on the count, and bf16 GEMMs without
AMX would make five take minutes. Prints the transient of the second step, max over ranks.

    python scripts/step_memory.py --nproc 2 [--src PATH/TO/OTHER/CHECKOUT/src] [--dion]

``--overhead`` times instead what the step costs beyond Newton-Schulz: Newton-Schulz is
replaced by a bf16 cast (the same data movement in and out, no GEMMs) and the median of 20
steps is printed (max over ranks), so that two checkouts' momentum, packing, exchange and
update code can be compared on a machine where bf16 GEMMs would drown the difference.

``--check-grads always`` runs shardmuon with the agreement check on every step (default:
``first``): with ``--overhead``, the difference is what catching a grad that disappears on
some ranks after step 1 costs per step.

``--dion`` measures dion's Muon instead (the ``dion`` package must be importable; it is not a
dependency): ``distributed_mesh`` = the 1-D mesh, ``adjust_lr="rms_norm"``, and its
Newton-Schulz function replaced the same way (one quintic iteration, or a bf16 cast).
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor


def shapes() -> dict[str, tuple[int, ...]]:
    out: dict[str, tuple[int, ...]] = {"embed": (1024, 512), "lm_head": (1024, 512)}
    for layer in range(4):
        out |= {f"{layer}.q": (512, 512), f"{layer}.k": (256, 512), f"{layer}.v": (256, 512)}
        out |= {f"{layer}.o": (512, 512), f"{layer}.ln1": (512,), f"{layer}.ln2": (512,)}
        if layer == 0:
            out |= {"0.gate": (1024, 512), "0.up": (1024, 512), "0.down": (512, 1024)}
        else:
            out |= {f"{layer}.gate_up": (8, 512, 512), f"{layer}.down": (8, 512, 256)}
            out |= {f"{layer}.router": (8, 512)}
    return out


def one_iteration(G: torch.Tensor, epsilon: float = 1e-7) -> torch.Tensor:
    """One unfolded bf16 quintic iteration (dion's recipe, first step only), for memory runs."""
    X = G.to(torch.bfloat16)
    tall = G.size(-2) > G.size(-1)
    X = X.mT if tall else X
    X = X / (X.norm(dim=(-2, -1), keepdim=True) + epsilon)
    a, b, c = 3.4445, -4.7750, 2.0315
    A = X @ X.mT
    X = a * X + (b * A + c * (A @ A)) @ X
    return X.mT if tall else X


def _dion_optimizer(groups: list[dict], mesh, overhead: bool):
    import dion.muon
    from dion import Muon as DionMuon

    dion.muon.zeropower_via_newtonschulz5 = (
        (lambda G, epsilon=1e-7: G.to(torch.bfloat16)) if overhead else one_iteration
    )
    return DionMuon(
        groups, distributed_mesh=mesh, lr=0.01, nesterov=True, weight_decay=0.1,
        adjust_lr="rms_norm",
    )  # fmt: skip


def _replace_newton_schulz_with_a_cast(optimizer_module) -> None:
    """Newton–Schulz becomes a bf16 cast (what is left is the step's own overhead), in this
    tree (the engine table) or an older one (its ``NS_IMPLEMENTATIONS``)."""
    old_table = getattr(optimizer_module, "NS_IMPLEMENTATIONS", None)
    if old_table is not None:
        old_table["folded"] = lambda G, coefficients=None, eps=1e-8: G.to(torch.bfloat16)
        return
    import dataclasses

    from shardmuon.ops.engines import ENGINES
    from shardmuon.ops.normalize import Normalized

    def cast(G, coefficients, eps, **_):
        return Normalized(G.to(torch.bfloat16), torch.zeros(G.size(0), dtype=torch.bool))

    ENGINES["folded"] = dataclasses.replace(ENGINES["folded"], run=cast)


def worker(
    rank: int, world: int, port: int, src: str | None, options: tuple[bool, bool, bool, str]
):
    offload, overhead, use_dion, check_grads = options
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    if src:
        sys.path.insert(0, src)
    import shardmuon.optimizer
    from shardmuon import Muon
    from shardmuon.bench.memory import measure_cpu_step

    if overhead:
        _replace_newton_schulz_with_a_cast(shardmuon.optimizer)

    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(0)
    params = {
        name: torch.nn.Parameter(
            distribute_tensor(torch.randn(shape, generator=g) * 0.02, mesh, [Shard(0)])
        )
        for name, shape in shapes().items()
    }
    adamw = {"embed", "lm_head"}
    muon = [p for n, p in params.items() if p.ndim >= 2 and n not in adamw]
    other = [p for n, p in params.items() if not (p.ndim >= 2 and n not in adamw)]
    kwargs = {"offload": "state"} if offload else {}
    groups = [dict(params=muon), dict(params=other, algorithm="adamw")]
    if use_dion:
        opt = _dion_optimizer(groups, mesh, overhead)
    else:
        opt = Muon(
            groups,
            lr=0.01,
            nesterov=True,
            weight_decay=0.1,
            newton_schulz_coefficients=[(3.4445, -4.7750, 2.0315)],
            check_grads=check_grads,
            **kwargs,
        )
    for p in params.values():
        p.grad = distribute_tensor(torch.randn(p.shape, generator=g), mesh, [Shard(0)])
    opt.step()
    if overhead:
        times = []
        for _ in range(23):
            dist.barrier()
            start = time.perf_counter()
            opt.step()
            times.append(time.perf_counter() - start)
        median = torch.tensor([statistics.median(times[3:])])
        dist.all_reduce(median, op=dist.ReduceOp.MAX)
        if rank == 0:
            label = "dion" if use_dion else f"shardmuon (check_grads={check_grads!r})"
            print(f"{label} world {world}: step without Newton-Schulz {median.item() * 1e3:.1f} ms")
        dist.destroy_process_group()
        return
    transient = torch.tensor([measure_cpu_step(opt.step, 0).transient_bytes])
    dist.all_reduce(transient, op=dist.ReduceOp.MAX)
    if rank == 0:
        label = "dion" if use_dion else "shardmuon"
        print(
            f"{label} world {world}: step transient {transient.item() / 1e6:.2f} MB (max over ranks)"
        )
    dist.destroy_process_group()


def main() -> None:
    from shardmuon.harness.cli_support import positive_int
    from shardmuon.harness.processes import check_process_count

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=positive_int, default=2)
    parser.add_argument("--src", default=None, help="import shardmuon from this src folder")
    parser.add_argument("--offload", action="store_true", help="Muon(offload='state')")
    parser.add_argument("--overhead", action="store_true", help="time the step without NS")
    parser.add_argument("--dion", action="store_true", help="dion's Muon (if installed)")
    parser.add_argument(
        "--check-grads", choices=("first", "always"), default="first", help="Muon(check_grads=)"
    )
    args = parser.parse_args()
    try:
        check_process_count(args.nproc)
    except ValueError as err:
        parser.error(str(err))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    options = (args.offload, args.overhead, args.dion, args.check_grads)
    mp.spawn(worker, args=(args.nproc, port, args.src, options), nprocs=args.nproc)


if __name__ == "__main__":
    main()
