"""``shardmuon bench ab``: how far shardmuon's bf16 update is from a float64 Muon update.

Same weights and grads in one process, a few steps. Per step, over all Muon matrices:
``||Δ - Δ_ref|| / ||Δ_ref||`` with ``Δ`` the parameter change made by ``shardmuon.Muon`` and
``Δ_ref`` the change made by a float64 Muon written here in plain torch (same
coefficients, momentum, Nesterov, weight decay, lr scaling and fused-weight partitions).
Beside it, the bf16 noise floor: the same shardmuon run with every grad × 1.001 against the
unscaled run. Muon's output does not depend on the grad scale except through rounding, so
this is the difference that rounding alone makes.
"""

from __future__ import annotations

import argparse
import math
from typing import Any

import torch
from torch import Tensor

from shardmuon.bench.common import (
    add_model_arguments,
    add_output_arguments,
    name_seed,
    relative_difference,
)
from shardmuon.bench.report import (
    fmt,
    new_progress,
    print_table,
    set_threads,
    write_outputs,
)
from shardmuon.harness.cli_support import (
    HelpFormatter,
    add_hidden_alias,
    check_outputs,
    positive_float,
    positive_int,
    seed_int,
)
from shardmuon.harness.models import attention_dims, build_model
from shardmuon.ops.newton_schulz import NS_PRESETS, newton_schulz_reference

__all__ = [
    "add_parser",
]

# (coefficient preset, newton_schulz_impl) per table row.
ROWS: tuple[tuple[str, str], ...] = (
    ("dion", "folded"),
    ("deepseek-v4", "folded"),
    ("dion", "unfolded"),
    ("dion", "gram"),
)
MU = 0.95
WEIGHT_DECAY = 0.1
UPDATE_RMS = 0.2
GRAD_SCALE = 1.001


def _rms_norm_scale(rows: int, cols: int) -> float:
    return UPDATE_RMS * math.sqrt(max(rows, cols))


def reference_muon_step(
    X: Tensor,
    M: Tensor,
    G: Tensor,
    *,
    lr: float,
    preset: str,
    partition: tuple[int, ...] | None = None,
) -> None:
    """One float64 Muon step in place on ``X`` (weights) and ``M`` (momentum), both float64.

    Nesterov momentum ``mu=0.95``; each row block of ``partition`` (or the whole matrix;
    3-D = a batch of matrices) is orthogonalized on its own and scaled by
    ``0.2 * sqrt(max(rows, cols))``; decoupled weight decay 0.1.
    """
    G = G.to(torch.float64)
    M.mul_(MU).add_(G)
    U = M * MU + G
    blocks = U.split(list(partition), dim=-2) if partition else [U]
    orthogonal = torch.cat(
        [
            newton_schulz_reference(b, preset) * _rms_norm_scale(b.size(-2), b.size(-1))
            for b in blocks
        ],
        dim=-2,
    )
    X.mul_(1 - lr * WEIGHT_DECAY).sub_(lr * orthogonal)


def _grads(names: list[str], shapes: list[torch.Size], step: int, seed: int) -> list[Tensor]:
    out = []
    for name, shape in zip(names, shapes):
        gen = torch.Generator().manual_seed(name_seed(seed, step, name))
        out.append(torch.randn(shape, generator=gen))
    return out


class _Setup:
    """The model's initial weights and its routing: what every run starts from."""

    def __init__(self, model_name: str, layers: int | None, lr: float, seed: int) -> None:
        from shardmuon.routing import build_param_groups

        self.model = build_model(model_name, num_layers=layers, seed=seed)
        self.lr = lr
        self.named = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        self.names = [n for n, _ in self.named]
        self.shapes = [p.shape for _, p in self.named]
        self.initial = [p.detach().clone() for _, p in self.named]
        routed = build_param_groups(
            self.named, lr=lr, weight_decay=WEIGHT_DECAY, **attention_dims(model_name)
        )
        self.groups = routed.groups
        by_id = {id(p): i for i, (_, p) in enumerate(self.named)}
        self.muon_index = [
            by_id[id(p)] for g in routed.groups if g["algorithm"] == "muon" for p in g["params"]
        ]
        self.partitions = {by_id[id(p)]: tuple(v) for p, v in routed.partitions.items()}
        self.partitions_by_param = routed.partitions

    def reset(self) -> None:
        with torch.no_grad():
            for (_, p), w in zip(self.named, self.initial):
                p.copy_(w)
                p.grad = None


def _shardmuon_deltas(
    setup: _Setup, preset: str, impl: str, steps: int, seed: int, grad_scale: float, advance
) -> list[list[Tensor]]:
    """Per step, the change of each Muon matrix made by ``shardmuon.Muon``."""
    from shardmuon import Muon

    setup.reset()
    opt = Muon(
        # Optimizer keeps and edits the group dicts (e.g. "step"): give each run fresh ones.
        [dict(g) for g in setup.groups],
        lr=setup.lr,
        mu=MU,
        nesterov=True,
        weight_decay=WEIGHT_DECAY,
        update_rms=UPDATE_RMS,
        matrix_partitions=setup.partitions_by_param,
        newton_schulz_coefficients=preset,
        newton_schulz_impl=impl,
    )
    params = [p for _, p in setup.named]
    deltas = []
    for step in range(steps):
        for p, g in zip(params, _grads(setup.names, setup.shapes, step, seed)):
            p.grad = g * grad_scale if grad_scale != 1.0 else g
        before = [params[i].detach().clone() for i in setup.muon_index]
        opt.step()
        deltas.append([params[i].detach() - b for i, b in zip(setup.muon_index, before)])
        advance()
    return deltas


def _reference_deltas(setup: _Setup, preset: str, steps: int, seed: int, advance):
    X = [setup.initial[i].to(torch.float64) for i in setup.muon_index]
    M = [torch.zeros_like(x) for x in X]
    deltas = []
    for step in range(steps):
        grads = _grads(setup.names, setup.shapes, step, seed)
        step_deltas = []
        for k, i in enumerate(setup.muon_index):
            before = X[k].clone()
            reference_muon_step(
                X[k], M[k], grads[i], lr=setup.lr, preset=preset, partition=setup.partitions.get(i)
            )
            step_deltas.append(X[k] - before)
        deltas.append(step_deltas)
        advance()
    return deltas


# What --help prints: plain words and an example. The module docstring keeps the full
# account, in the markup the API docs read.
_DESCRIPTION = """\
How far shardmuon's bf16 update is from a float64 Muon update written in plain torch,
over a few steps on the same weights and gradients, beside the bf16 noise floor (the
same run with every gradient scaled by 1.001): the difference rounding alone makes.

Prints a table with a row per step and a column per coefficient preset and engine:
the relative difference of the updates, and the noise floor under it.

Example:
  shardmuon bench ab --model tiny-moe --steps 3 --plot ab.png
"""


def add_parser(subparsers) -> None:
    """Register ``ab`` on ``subparsers`` (an argparse sub-parsers action)."""
    p = subparsers.add_parser(
        "ab",
        help="update A/B: shardmuon vs a float64 Muon, beside the bf16 noise floor",
        description=_DESCRIPTION,
        formatter_class=HelpFormatter,
        allow_abbrev=False,
    )
    add_model_arguments(p, "tiny-moe")
    p.add_argument("--steps", type=positive_int, default=3, help="optimizer steps compared")
    p.add_argument(
        "--coefficients",
        type=str,
        default=None,
        help="comma-separated Newton-Schulz coefficient presets for the folded rows, among "
        f"{', '.join(NS_PRESETS)} (default: dion,deepseek-v4; dion's unfolded recipe "
        "and Gram rows are always added)",
    )
    add_hidden_alias(p, "--presets", "coefficients", type=str)
    p.add_argument("--lr", type=positive_float, default=0.02, help="learning rate")
    p.add_argument("--seed", type=seed_int, default=0, help="seed of the model and the grads")
    p.add_argument(
        "--threads", type=positive_int, default=None, help="torch threads (default: torch's)"
    )
    add_output_arguments(p, "line plot")
    p.set_defaults(func=run)


def _rows(presets: str | None) -> list[tuple[str, str]]:
    if presets is None:
        return list(ROWS)
    names = [n.strip() for n in presets.split(",") if n.strip()]
    unknown = [n for n in names if n not in NS_PRESETS]
    if not names or unknown:
        raise ValueError(
            f"bad --coefficients {presets!r}; accepted: a comma-separated subset of "
            f"{', '.join(NS_PRESETS)}"
        )
    return [(n, "folded") for n in dict.fromkeys(names)] + [("dion", "unfolded"), ("dion", "gram")]


def run(args: argparse.Namespace) -> int:
    """Run the A/B from parsed arguments; returns the exit code."""
    # The numbers were checked by their argparse types.
    check_outputs({"--json": args.json, "--plot": args.plot})
    rows_spec = _rows(args.coefficients)
    set_threads(args.threads)
    setup = _Setup(args.model, args.layers, args.lr, args.seed)
    references: dict[str, list[list[Tensor]]] = {}
    results: list[dict[str, Any]] = []
    n_refs = len({p for p, _ in rows_spec})
    with new_progress(not args.no_progress) as progress:
        total = args.steps * (n_refs + 2 * len(rows_spec))
        task = progress.add_task("A/B steps", total=total) if progress else None

        def advance() -> None:
            if progress:
                progress.advance(task)

        for preset, impl in rows_spec:
            if preset not in references:
                references[preset] = _reference_deltas(
                    setup, preset, args.steps, args.seed, advance
                )
            base = _shardmuon_deltas(setup, preset, impl, args.steps, args.seed, 1.0, advance)
            scaled = _shardmuon_deltas(
                setup, preset, impl, args.steps, args.seed, GRAD_SCALE, advance
            )
            results.append(
                {
                    "preset": preset,
                    "newton_schulz_impl": impl,
                    "vs_fp64": [
                        relative_difference(d, r) for d, r in zip(base, references[preset])
                    ],
                    "noise_floor": [relative_difference(s, d) for s, d in zip(scaled, base)],
                }
            )
    n_matrices = len(setup.muon_index)
    # Steps down, variants across: the table stays narrow however many steps are run.
    print_table(
        f"update A/B vs float64 Muon: {args.model}, {n_matrices} Muon params, {args.steps} steps",
        ["step", *(_column_name(r) for r in results)],
        [
            *(
                [str(s), *(fmt(100 * r["vs_fp64"][s], ".3f", "%") for r in results)]
                for s in range(args.steps)
            ),
            ["noise floor", *(fmt(100 * max(r["noise_floor"]), ".3f", "%") for r in results)],
        ],
        legend=[
            ("step N", "||Δ - Δ_fp64|| / ||Δ_fp64|| over all Muon matrices at step N"),
            ("noise floor", f"the same run with grads x {GRAD_SCALE} against it, max over steps"),
            ("columns", "Newton-Schulz coefficients and implementation of shardmuon's run"),
        ],
    )
    config = {
        "model": args.model,
        "layers": args.layers,
        "steps": args.steps,
        "lr": args.lr,
        "seed": args.seed,
        "mu": MU,
        "weight_decay": WEIGHT_DECAY,
        "update_rms": UPDATE_RMS,
        "grad_scale": GRAD_SCALE,
        "muon_params": n_matrices,
    }
    write_outputs(
        args,
        "ab",
        {"config": config, "results": results},
        lambda ax: _draw(ax, results),
        "update vs float64 Muon",
    )
    return 0


def _column_name(result: dict[str, Any]) -> str:
    # Break at the hyphen too, so that "deepseek-v4" or "polar-express" is no wider than
    # "unfolded".
    preset = result["preset"].replace("-", "-\n")
    return f"{preset}\n{result['newton_schulz_impl']}"


def _draw(ax, results: list[dict[str, Any]]) -> None:
    from matplotlib.ticker import MaxNLocator

    for r in results:
        label = f"{r['preset']} {r['newton_schulz_impl']}"
        steps = list(range(len(r["vs_fp64"])))  # numbered as in the table
        (line,) = ax.plot(steps, [100 * e for e in r["vs_fp64"]], marker="o", label=label)
        ax.plot(
            steps,
            [100 * e for e in r["noise_floor"]],
            linestyle="--",
            color=line.get_color(),
            label=f"{label}: noise floor",
        )
    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel("relative difference (%)")
    # Beside the axes: with two lines per variant, no corner inside is free of them.
    ax.figure.legend(loc="outside right upper", fontsize=7)
