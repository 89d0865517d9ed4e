"""shardmuon beside torchtitan's DistMuon: the same model, grads and update recipe, on a CPU.

DistMuon runs on CUDA only: its constructor refuses other devices and its transfers run on
CUDA streams, so its distributed step cannot run on gloo. What can be compared on a CPU is
the update: each world (``--worlds 1,2,4``) lays out torchtitan's Qwen3-MoE (its builders and
names; 2 layers, dim 256, fused qkv, 8 experts of 256x256) with FSDP2 over one mesh axis
``dp_shard`` and steps its Muon parameters (attention, router gate, expert stacks) with
shardmuon's ``Muon``, while rank 0 applies DistMuon's own update functions
(``_prepare_muon_input``, ``_compute_muon_direction``, ``_apply_muon_update``) to the whole
tensors, an expert stack as one batch as DistMuon's ``Shard(0)`` layout computes it. Both use
DistMuon's recipe: momentum 0.95 with Nesterov, five Newton-Schulz steps (3.4445, -4.7750,
2.0315) in bf16, lr scaled by sqrt(max(1, rows/cols)) (DistMuon's ``original``, shardmuon's
``keller_muon``), decoupled weight decay.

Printed per world: each one's ``fp64 error`` (||update - fp64 update|| / ||fp64 update|| over
every Muon parameter after ``--steps`` steps, the fp64 update being the recipe one matrix at a
time on one process), the two against each other, and the median step (after a warm-up step;
shardmuon's between barriers on every rank, DistMuon's math on one process, no
communication). DistMuon keeps its momentum as ``lerp`` (a buffer 1 - momentum times
dion's); the directions are equal up to that scale, which the normalisation removes.

With ``--device cuda`` (NCCL, one GPU a rank) DistMuon's own distributed step runs beside
shardmuon's on the same model and grads, and both are timed.

    python scripts/compare_distmuon.py --worlds 1,2,4 --steps 6 --json comparison.json
    python scripts/compare_distmuon.py --device cuda --worlds 1 --dim 1024 --experts 32
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5
LR, WEIGHT_DECAY, MOMENTUM = 0.02, 0.1, 0.95
MESH_AXIS = "dp_shard"


def qwen3_moe_config(dim: int = 256, experts: int = 8, head_dim: int = 64):
    """torchtitan's Qwen3-MoE config (its builders and names): 2 layers of width ``dim``,
    fused qkv with ``dim // head_dim`` heads (half as many for k and v), ``experts`` experts of
    ``dim x dim``, top-2 routing, a 1024-token vocabulary."""
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear
    from torchtitan.models.qwen3 import (
        _EMBEDDING_INIT,
        _LINEAR_INIT,
        _build_qwen3_moe_layers,
        _qwen3_norm,
        model_registry,
    )

    spec = model_registry("debugmodel_moe")
    heads = dim // head_dim
    return type(spec.model)(
        vocab_size=1024,
        dim=dim,
        norm=_qwen3_norm(dim),
        tok_embeddings=Embedding.Config(
            num_embeddings=1024, embedding_dim=dim, param_init=_EMBEDDING_INIT
        ),
        lm_head=Linear.Config(in_features=dim, out_features=1024, param_init=_LINEAR_INIT),
        layers=_build_qwen3_moe_layers(
            n_layers=2, dim=dim, n_heads=heads, n_kv_heads=max(1, heads // 2),
            head_dim=head_dim, moe_hidden_dim=dim, num_experts=experts, top_k=2,
            attn_backend="flex", moe_comm_backend="standard",
            rope=CosSinRoPE.Config(dim=head_dim, max_seq_len=256, theta=1e6),
        ),
    )  # fmt: skip


def build_model(dim: int = 256, experts: int = 8):
    """:func:`qwen3_moe_config`'s model on the meta device."""
    with torch.device("meta"):
        return qwen3_moe_config(dim, experts).build()


MUON_PARAMETER = re.compile(
    r"attention\.(qkv_linear\.wqkv|wo)\.weight$|router\.gate\.weight$|_E[DF][DF]$"
)


def full_values(shape: tuple[int, ...], seed: int, scale: float = 1.0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=generator) * scale


def fp64_reference(weights: dict, grads: list[dict]) -> dict:
    """The recipe in fp64, one matrix at a time: dion's momentum with Nesterov, the five
    steps after a Frobenius normalisation, the tall case transposed, decoupled decay."""
    params = {n: w.double().clone() for n, w in weights.items()}
    momenta = {n: torch.zeros_like(w) for n, w in params.items()}
    a, b, c = COEFFICIENTS
    for step_grads in grads:
        for name, p in params.items():
            g = step_grads[name].double()
            momenta[name].mul_(MOMENTUM).add_(g)
            direction = g + MOMENTUM * momenta[name]
            matrices = direction.reshape(-1, *direction.shape[-2:])
            out = []
            for x in matrices:
                tall = x.shape[0] > x.shape[1]
                x = x.T if tall else x
                x = x / x.norm().clamp_min(1e-7)
                for _ in range(NS_STEPS):
                    gram = x @ x.T
                    x = a * x + (b * gram + c * gram @ gram) @ x
                out.append(x.T if tall else x)
            rows, cols = direction.shape[-2:]
            scale = math.sqrt(max(1.0, rows / cols))
            p.mul_(1 - LR * WEIGHT_DECAY).add_(torch.stack(out).reshape(p.shape), alpha=-LR * scale)
    return params


def _shardmuon(params: list, names: list[str]):
    from shardmuon import Muon

    return Muon(
        [{"params": params, "algorithm": "muon", "param_names": names}],
        lr=LR, mu=MOMENTUM, nesterov=True, weight_decay=WEIGHT_DECAY, adjust_lr="keller_muon",
        newton_schulz_coefficients=[COEFFICIENTS] * NS_STEPS,
    )  # fmt: skip


def distmuon_math(weights: dict, grads: list[dict]) -> tuple[dict, float]:
    """DistMuon's own update functions (``_prepare_muon_input``, ``_zeropower_via_newtonschulz``,
    ``_apply_muon_update``) on whole tensors in one process, an expert stack as one batch as
    its ``Shard(0)`` compute layout gives it; the finals and the median step in ms."""
    from torchtitan.distributed.flex_shard import dist_muon

    params = {n: w.clone() for n, w in weights.items()}
    momenta = {n: torch.zeros_like(w) for n, w in params.items()}
    times = []
    for step_grads in grads:
        start = time.perf_counter()
        for name, p in params.items():
            prepared = dist_muon._prepare_muon_input(
                step_grads[name], momenta[name], momentum=MOMENTUM, nesterov=True,
                out=torch.empty_like(p),
            )  # fmt: skip
            direction = dist_muon._compute_muon_direction(
                prepared, ns_coefficients=COEFFICIENTS, ns_steps=NS_STEPS, eps=1e-7,
                out=torch.empty_like(p),
            )  # fmt: skip
            dist_muon._apply_muon_update(
                p, direction, lr=LR, weight_decay=WEIGHT_DECAY, adjust_lr_fn="original",
                compute_matrix_shape=p.shape[-2:],
            )  # fmt: skip
        times.append(time.perf_counter() - start)
    return params, statistics.median(times[1:]) * 1e3


def _distmuon(params: list, names: list[str]):
    """torchtitan's DistMuon (CUDA only) over ``params``: each matrix ``Owned`` by one rank of
    ``dp_shard``, each expert stack computed where it is stored (``Shard(0)``), one bucket
    per layer, DistMuon's recipe."""
    from torch.distributed.tensor import Shard
    from torchtitan.distributed.flex_shard import build_dist_muon
    from torchtitan.distributed.flex_shard.optimizer_reshard import (
        BucketConfig,
        ComputeLayout,
        Owned,
    )

    layouts = {
        n: ComputeLayout(shardings_by_mesh_axis={MESH_AXIS: Shard(0) if p.ndim == 3 else Owned()})
        for n, p in zip(names, params)
    }
    layers = sorted({n.split(".")[1] for n in names})
    buckets = [
        BucketConfig(patterns=tuple(n for n in names if n.split(".")[1] == layer), name=f"layer{layer}")
        for layer in layers
    ]  # fmt: skip
    return build_dist_muon(
        [{"params": params, "param_names": names}],
        compute_sharding_by_fqn=layouts, bucket_configs=buckets, lr=LR,
        weight_decay=WEIGHT_DECAY, momentum=MOMENTUM, nesterov=True,
        ns_coefficients=COEFFICIENTS, ns_steps=NS_STEPS, adjust_lr_fn="original",
    )  # fmt: skip


def _run(build, mesh, device: str, initial: dict, grads: list[dict], size: tuple[int, int]):
    """A fresh FSDP2 model on ``device``, the Muon parameters set to ``initial``, stepped by
    ``build``'s optimizer with ``grads``: the finals (whole, on the CPU) and the median step."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import distribute_tensor

    model = build_model(*size)
    for layer in model.layers.values():
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device=device)
    named = [(n, p) for n, p in model.named_parameters() if MUON_PARAMETER.search(n)]

    def placed(full: torch.Tensor, p) -> torch.Tensor:
        return distribute_tensor(full.to(device), mesh, p.placements, src_data_rank=None)

    with torch.no_grad():
        for n, p in named:
            p.copy_(placed(initial[n], p))
    optimizer = build([p for _, p in named], [n for n, _ in named])
    times = []
    for s in range(len(grads)):
        for n, p in named:
            p.grad = placed(grads[s][n], p)
        if device == "cuda":
            torch.cuda.synchronize()
        dist.barrier()
        start = time.perf_counter()
        optimizer.step()
        if device == "cuda":
            torch.cuda.synchronize()
        dist.barrier()
        times.append(time.perf_counter() - start)
        optimizer.zero_grad()
    finals = {n: p.detach().full_tensor().cpu() for n, p in named}
    return {"finals": finals, "step_ms": statistics.median(times[1:]) * 1e3}


def _worker(
    rank: int, world: int, port: int, steps: int, out: str, device: str, size: tuple[int, int]
) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    if device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if device == "cuda" else "gloo", rank=rank, world_size=world)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device, (world,), mesh_dim_names=(MESH_AXIS,))
    with torch.device("meta"):
        shapes = {
            n: tuple(p.shape)
            for n, p in build_model(*size).named_parameters()
            if MUON_PARAMETER.search(n)
        }
    initial = {n: full_values(shape, 1 + i, 0.02) for i, (n, shape) in enumerate(shapes.items())}
    grads = [
        {n: full_values(shape, 1000 * (s + 1) + i) for i, (n, shape) in enumerate(shapes.items())}
        for s in range(steps)
    ]
    plural = "s" if world > 1 else ""
    results = {}
    if device == "cuda":  # DistMuon's own distributed step
        results[f"DistMuon, {world} GPU{plural}"] = _run(
            _distmuon, mesh, device, initial, grads, size
        )
    label = f"shardmuon, {world} {'GPU' if device == 'cuda' else 'rank'}{plural}"
    results[label] = _run(_shardmuon, mesh, device, initial, grads, size)
    if rank == 0:
        reference = fp64_reference(initial, grads)
        if device == "cpu":  # DistMuon cannot step on a CPU: its update functions instead
            threads = torch.get_num_threads()
            torch.set_num_threads(os.cpu_count() or 1)  # the other ranks wait at the barrier
            finals, step_ms = distmuon_math(initial, grads)
            torch.set_num_threads(threads)
            results = {
                "DistMuon's math, 1 process": {"finals": finals, "step_ms": step_ms},
                **results,
            }

        def error(finals: dict, against: dict) -> float:
            num = sum(float((finals[n].double() - against[n]).norm() ** 2) for n in finals)
            den = sum(float((against[n] - initial[n].double()).norm() ** 2) for n in finals)
            return math.sqrt(num / den)

        labels = list(results)
        report = {
            "world": world,
            "steps": steps,
            "muon_parameters": len(initial),
            "matrices": sum(math.prod(t.shape[:-2]) for t in initial.values()),
            "results": {
                label: {
                    "step_ms": round(results[label]["step_ms"], 2),
                    "fp64_error": error(results[label]["finals"], reference),
                }
                for label in labels
            },
            "between": error(
                results[labels[0]]["finals"],
                {n: t.double() for n, t in results[labels[1]]["finals"].items()},
            ),
        }
        Path(out).write_text(json.dumps(report))
    dist.barrier()
    dist.destroy_process_group()


def run_world(
    world: int, steps: int, timeout_s: float, device: str = "cpu", size: tuple[int, int] = (256, 8)
) -> dict:
    """One gloo world of ``world`` processes; its report (rank 0's)."""
    from shardmuon.harness.processes import check_process_count, free_port

    check_process_count(world, "--worlds")
    with tempfile.TemporaryDirectory() as folder:
        out = str(Path(folder) / "report.json")
        context = mp.start_processes(
            _worker, args=(world, free_port(), steps, out, device, size), nprocs=world, join=False,
            start_method="spawn",
        )  # fmt: skip
        deadline = time.monotonic() + timeout_s
        while not context.join(timeout=max(1.0, deadline - time.monotonic())):
            if time.monotonic() > deadline:
                for process in context.processes:
                    process.kill()
                raise TimeoutError(f"world {world} did not finish in {timeout_s:.0f} s")
        return json.loads(Path(out).read_text())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worlds", default="1,2,4", help="world sizes, comma-separated (1,2,4)")
    parser.add_argument("--steps", type=int, default=6, help="steps per optimizer (>= 2; 6)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per world (300)")
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cpu (gloo: DistMuon's math only) or cuda (NCCL, one GPU a rank: "
        "DistMuon's own step too); cpu",
    )
    parser.add_argument("--dim", type=int, default=256, help="model width, a multiple of 128 (256)")
    parser.add_argument("--experts", type=int, default=8, help="experts per layer (8)")
    parser.add_argument("--json", help="write the reports here as well")
    args = parser.parse_args(argv)
    worlds = [int(w) for w in args.worlds.split(",")]
    if args.device == "cuda" and max(worlds) > torch.cuda.device_count():
        parser.error(
            f"--worlds {args.worlds}: {torch.cuda.device_count()} GPU(s) here, one per rank"
        )
    if args.dim % 128 or args.dim < 128 or args.experts < 1:
        parser.error(
            f"--dim {args.dim} --experts {args.experts}: accepted: dim a multiple of 128, experts >= 1"
        )
    if args.steps < 2 or any(w < 1 for w in worlds):
        parser.error(
            f"--steps {args.steps} --worlds {args.worlds}: accepted: steps >= 2, worlds >= 1"
        )
    reports = []
    for world in worlds:
        report = run_world(world, args.steps, args.timeout, args.device, (args.dim, args.experts))
        reports.append(report)
        print(f"world {world}: {report['muon_parameters']} Muon parameters "
              f"({report['matrices']} matrices), {args.steps} steps")  # fmt: skip
        for label, r in report["results"].items():
            print(f"  {label:<28} step {r['step_ms']:8.1f} ms   fp64 error {r['fp64_error']:.4f}")
        print(f"  between the two: {report['between']:.4f}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(reports, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
