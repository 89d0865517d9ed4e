"""Time ``Muon.step`` at HEAD (this tree) against an earlier commit, interleaved in one run.

    python scripts/step_regression.py REV [--rounds 5] [--steps 6] [--worlds 1,2]

``REV`` is checked out into a temporary git worktree; each round runs one fresh process (or
a gloo world of 2) per tree, in the order REV, HEAD, HEAD, REV, ... so that drift of the
machine's speed falls on both alike. Every process uses one thread per rank and steps the
same 12 matrices (4 x 512x512, 2 x 1536x512, 3 x [8, 512, 256], 3 x [8, 256, 512]; sharded
``Shard(0)`` over the ranks at world 2), after two warm-up steps. Prints the median step
time of each tree, the ratio HEAD / REV per world size and, at world 1, each step over dion's
unfolded bf16 recipe on the same matrices timed in the same process (``--aol`` adds HEAD
with ``newton_schulz_preconditioner="aol"``); ``--json PATH`` keeps them.
Run it before every stop that touches the step; the figures go in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHAPES = [(512, 512)] * 4 + [(1536, 512)] * 2 + [(8, 512, 256)] * 3 + [(8, 256, 512)] * 3
MAX_WORLD = 2


def _unfolded_recipe_seconds(tensors, grads, repeats: int) -> float:
    """Median seconds of dion's unfolded bf16 recipe on the same matrices (same-shape
    matrices stacked, as the step batches them): the baseline the step is measured by."""
    import torch

    from shardmuon.ops.newton_schulz import newton_schulz_unfolded

    stacks: dict = {}
    for g in grads:
        stacks.setdefault(tuple(g.shape[-2:]), []).append(g.reshape(-1, *g.shape[-2:]))
    batches = [torch.cat(v).bfloat16() for v in stacks.values()]
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        for b in batches:
            newton_schulz_unfolded(b)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def _rank_main(
    rank: int, world: int, port: int, src: str, steps: int, out: str, options: str = "{}"
) -> None:
    sys.path.insert(0, src)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    import shardmuon
    from shardmuon import Muon

    assert shardmuon.__file__.startswith(src), (shardmuon.__file__, src)

    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(s, generator=g) * 0.02 for s in SHAPES]
    grads = [[torch.randn(s, generator=g) for s in SHAPES] for _ in range(2)]
    if world > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world)
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard, distribute_tensor

        mesh = init_device_mesh("cpu", (world,))

        def place(t):
            return distribute_tensor(t, mesh, [Shard(0)])
    else:

        def place(t):
            return t

    params = [torch.nn.Parameter(place(t)) for t in tensors]
    grads = [[place(t) for t in gs] for gs in grads]
    opt = Muon(params, lr=0.02, **json.loads(options))
    times = []
    for i in range(steps + 2):
        for p, gr in zip(params, grads[i % 2]):
            p.grad = gr
        if world > 1:
            dist.barrier()
        start = time.perf_counter()
        opt.step()
        elapsed = time.perf_counter() - start
        if i >= 2:
            times.append(elapsed)
    if world > 1:
        gathered = [None] * world
        dist.all_gather_object(gathered, times)
        times = [max(column) for column in zip(*gathered)]  # a step lasts as its slowest rank
        dist.destroy_process_group()
    if rank == 0:
        record = {"times": times}
        if world == 1 and json.loads(options) in ({}, {"newton_schulz_preconditioner": "aol"}):
            record["unfolded"] = _unfolded_recipe_seconds(tensors, grads[0], steps)
        Path(out).write_text(json.dumps(record))


def _run_once(src: Path, world: int, steps: int, options: dict | None = None) -> dict:
    """Median step seconds of one fresh process (world 1) or gloo world on ``src`` (and, at
    world 1, of the unfolded recipe on the same matrices)."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as handle:
        out = handle.name
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); import step_regression as s; "
        "s._spawn(int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), sys.argv[5], sys.argv[6])"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [
        sys.executable, "-c", code, str(ROOT / "scripts"), str(world), str(src), str(steps),
        out, json.dumps(options or {}),
    ]  # fmt: skip
    for attempt in range(2):
        try:
            subprocess.run(command, check=True, env=env, timeout=600)
            break
        except subprocess.CalledProcessError:
            # A gloo rank now and then aborts while its threads are torn down at exit
            # ("terminate called without an active exception"), after its figures were
            # written: one more try, then give up.
            if attempt == 1:
                raise
    record = json.loads(Path(out).read_text())
    os.unlink(out)
    return {"step": statistics.median(record["times"]), "unfolded": record.get("unfolded")}


def _spawn(world: int, src: str, steps: int, out: str, options: str = "{}") -> None:
    if world == 1:
        _rank_main(0, 1, 0, src, steps, out, options)
        return
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as probe:  # a free port (this script runs on either tree)
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    mp.spawn(_rank_main, args=(world, port, src, steps, out, options), nprocs=world, join=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("rev", help="the commit to compare against (e.g. HEAD~1)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=6, help="timed steps per process")
    parser.add_argument("--worlds", default="1,2", help="world sizes, at most 2 (e.g. 1,2)")
    parser.add_argument("--aol", action="store_true", help="also HEAD with AOL preconditioning")
    parser.add_argument(
        "--options",
        default="{}",
        help="Muon keyword arguments for both trees, as JSON, e.g. "
        '\'{"newton_schulz_dtype": "float32"}\' (where bf16 GEMMs are emulated: AVX2 CPUs); '
        "with options, no unfolded-recipe baseline (it is dion's bf16 recipe)",
    )
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()
    try:
        common = json.loads(args.options)
    except json.JSONDecodeError as err:
        parser.error(f"--options takes a JSON object, got {args.options!r} ({err})")
    if not isinstance(common, dict):
        parser.error(f"--options takes a JSON object, got {args.options!r}")
    worlds = [int(w) for w in args.worlds.split(",")]
    if not worlds or any(not 1 <= w <= MAX_WORLD for w in worlds):
        parser.error(f"--worlds takes sizes from 1 to {MAX_WORLD}, got {args.worlds!r}")
    if not (1 <= args.rounds <= 50 and 1 <= args.steps <= 100):
        parser.error("--rounds takes 1..50 and --steps 1..100")
    sha = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", args.rev],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    results: dict = {"rev": sha, "shapes": SHAPES, "worlds": {}}
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp) / "rev"
        subprocess.run(
            ["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), sha],
            check=True,
            capture_output=True,
        )
        try:
            trees = {"rev": (tree / "src", common), "head": (ROOT / "src", common)}
            if args.aol:
                aol = {**common, "newton_schulz_preconditioner": "aol"}
                trees["head+aol"] = (ROOT / "src", aol)
            for world in worlds:
                samples: dict[str, list[dict]] = {name: [] for name in trees}
                for r in range(args.rounds):
                    order = list(trees) if r % 2 == 0 else list(trees)[::-1]
                    for name in order:
                        src, options = trees[name]
                        samples[name].append(_run_once(src, world, args.steps, options))
                    print(
                        f"world {world} round {r + 1}/{args.rounds}: "
                        + ", ".join(f"{n} {samples[n][-1]['step'] * 1e3:.1f} ms" for n in trees),
                        file=sys.stderr,
                    )
                figures = {}
                for name in trees:
                    steps_s = [x["step"] for x in samples[name]]
                    ratios = [h["step"] / v["step"] for h, v in zip(samples[name], samples["rev"])]
                    figures[name] = {
                        "step_ms": statistics.median(steps_s) * 1e3,
                        "over_rev": statistics.median(steps_s)
                        / statistics.median(x["step"] for x in samples["rev"]),
                        "over_rev_range": [min(ratios), max(ratios)],
                    }
                    if world == 1 and all(x["unfolded"] for x in samples[name]):
                        per_round = [x["step"] / x["unfolded"] for x in samples[name]]
                        figures[name]["over_unfolded"] = statistics.median(per_round)
                        figures[name]["over_unfolded_range"] = [min(per_round), max(per_round)]
                results["worlds"][world] = figures
                for name, f in figures.items():
                    extra = (
                        f", step / unfolded recipe {f['over_unfolded']:.3f} "
                        f"({f['over_unfolded_range'][0]:.3f}-{f['over_unfolded_range'][1]:.3f})"
                        if "over_unfolded" in f
                        else ""
                    )
                    print(
                        f"world {world}: {name:9s} {f['step_ms']:7.1f} ms, / {sha} "
                        f"{f['over_rev']:.3f} (rounds {f['over_rev_range'][0]:.3f}-"
                        f"{f['over_rev_range'][1]:.3f}){extra}"
                    )
        finally:
            subprocess.run(
                ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)],
                check=False,
                capture_output=True,
            )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
