"""``shardmuon bench ns``: Newton–Schulz per call, folded (``baddbmm``) vs unfolded (dion's),
and the Gram iteration.

For each shape and coefficient preset: milliseconds per call of both, the speed-up, the
achieved TFLOP/s of the folded one, that rate as a fraction of a plain bf16 GEMM measured
in the same run, and the relative error of both against the float64 iteration. A second
table gives the Gram iteration (its default restart): time, time and FLOPs (exact counts,
restarts included) over the folded iteration's, error, and the divergence guard's verdict.
A figure whose timed repeats disagree by more than 2x (slowest over fastest) gets a warning
naming its shape, and its row ``"unstable": true`` in the JSON.
"""

from __future__ import annotations

import argparse
import math
import time
from typing import Any

import torch

from shardmuon.bench.common import add_output_arguments
from shardmuon.bench.ns_measure import (
    input_and_reference,
    kind_inputs,
    measure_engine,
    measure_shape,
    newton_schulz_flops,
)
from shardmuon.bench.report import (
    environment,
    fmt,
    new_progress,
    print_legend,
    print_table,
    set_threads,
    write_json,
    write_outputs,
)
from shardmuon.harness.cli_support import (
    HelpFormatter,
    add_hidden_alias,
    check_outputs,
    note,
    positive_int,
    seed_int,
)
from shardmuon.harness.jobs import estimate_line, start_job
from shardmuon.harness.machine import DTYPES, fp16_cpu_note
from shardmuon.ops.newton_schulz import (
    NS_PRESETS,
)

__all__ = [
    "add_parser",
]

# The MoE and attention shapes of a 30B-A3B model (the H200 reference timings are for
# these), and the same family scaled down for a CPU:
# matrix dims / 4 (the last one / 8) and smaller batches, keeping two with min dim >= 512.
GPU_SHAPES: tuple[tuple[int, ...], ...] = (
    (32, 768, 2048),
    (16, 2048, 768),
    (16, 1408, 4096),
    (8, 2048, 6144),
    (6144, 16384),
)
CPU_SHAPES: tuple[tuple[int, ...], ...] = (
    (8, 192, 512),
    (4, 512, 192),
    (4, 352, 1024),
    (2, 512, 1536),
    (768, 2048),
)


# Bytes a shape's element needs during one benchmarked call, about: the fp64 input and
# reference, the fp32 copies and the iteration's buffers.
BYTES_PER_ELEMENT = 48


def check_shapes_fit(shapes: list[tuple[int, ...]], device: torch.device) -> None:
    """Refuse, before allocating, a shape whose benchmark cannot fit the device's memory
    (ValueError naming the shape, what it needs and what there is)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        where = f"{free / 2**30:.1f} GiB free on {device}"
    else:
        from shardmuon.harness.processes import available_memory_bytes

        free = available_memory_bytes()
        where = f"{(free or 0) / 2**30:.1f} GiB available memory"
    if free is None:
        return
    for shape in shapes:
        need = math.prod(shape) * BYTES_PER_ELEMENT
        if need > free:
            raise ValueError(
                f"--shapes {'x'.join(map(str, shape))}: about {need / 2**30:.3g} GiB to benchmark "
                f"(~{BYTES_PER_ELEMENT} bytes per element), more than the {where}; give "
                "smaller shapes"
            )


def parse_shapes(text: str) -> list[tuple[int, ...]]:
    """Parse ``"8x256x512,1024x2048"`` into ``[(8, 256, 512), (1024, 2048)]``.

    Each shape is ``[batch x] rows x cols`` with positive ints; raises ``ValueError`` otherwise.
    """
    shapes = []
    for item in text.split(","):
        item = item.strip()
        try:
            dims = tuple(int(d) for d in item.lower().split("x"))
        except ValueError:
            dims = ()
        if len(dims) not in (2, 3) or any(d < 1 for d in dims):
            raise ValueError(
                f"bad shape {item!r} in --shapes {text!r}; accepted: ROWSxCOLS or "
                "BATCHxROWSxCOLS with positive ints, comma-separated (e.g. 8x256x512,1024x2048)"
            )
        shapes.append(dims)
    return shapes


def parse_presets(text: str) -> list[str]:
    """Parse ``"dion,deepseek-v4"``; raises ``ValueError`` for an unknown preset name."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in NS_PRESETS]
    if not names or unknown:
        raise ValueError(
            f"bad --coefficients {text!r}; accepted: a comma-separated subset of "
            f"{', '.join(NS_PRESETS)}"
        )
    return names


def parse_dtypes(text: str) -> list[torch.dtype]:
    """Parse ``"bf16,fp16"``; raises ``ValueError`` naming what is accepted."""
    names = list(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))
    unknown = [n for n in names if n not in DTYPES]
    if not names or unknown:
        raise ValueError(
            f"bad --dtypes {text!r}; accepted: a comma-separated subset of {', '.join(DTYPES)}"
        )
    return [DTYPES[n] for n in names]


# What --help prints: plain words and an example. The module docstring keeps the full
# account, in the markup the API docs read.
_DESCRIPTION = """\
Newton-Schulz per call: shardmuon's folded iteration against the unfolded one, and the
Gram iteration, on each --shapes shape and --coefficients preset.

Prints milliseconds per call, the speed-up, the achieved TFLOP/s as a share of a plain
GEMM, and each result's error against a float64 iteration. A shape whose timed calls
disagree by more than 2x is named in a warning and marked unstable in --json.

Example:
  shardmuon bench ns --shapes 8x256x512,1024x2048 --repeats 5 --json ns.json
"""


def add_parser(subparsers) -> None:
    """Register ``ns`` on ``subparsers`` (an argparse sub-parsers action)."""
    p = subparsers.add_parser(
        "ns",
        help="Newton-Schulz per call: folded vs unfolded, TFLOP/s, error vs fp64",
        description=_DESCRIPTION,
        formatter_class=HelpFormatter,
        allow_abbrev=False,
    )
    p.add_argument(
        "--shapes",
        type=str,
        default=None,
        help="comma-separated [BATCHx]ROWSxCOLS (default: the 30B-A3B shapes on GPU, "
        "a scaled-down set on CPU)",
    )
    p.add_argument(
        "--coefficients",
        type=str,
        default="dion",
        help=f"comma-separated Newton-Schulz coefficient presets among {', '.join(NS_PRESETS)}",
    )
    add_hidden_alias(p, "--presets", "coefficients", type=str)
    p.add_argument(
        "--dtypes",
        type=str,
        default="bf16",
        help="comma-separated iteration dtypes of the standard-vs-Gram table, among "
        f"{', '.join(DTYPES)} (fp16 GEMMs are slow on CPUs without AVX512-FP16/AMX-FP16)",
    )
    p.add_argument(
        "--repeats", type=positive_int, default=5, help="timed calls per figure (median)"
    )
    p.add_argument("--seed", type=seed_int, default=0, help="seed of the random input matrices")
    p.add_argument(
        "--threads", type=positive_int, default=None, help="torch threads (default: torch's)"
    )
    p.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="where to run; auto: CUDA when available",
    )
    add_output_arguments(p, "bar chart")
    p.set_defaults(func=run)


def _device(name: str) -> torch.device:
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was given but CUDA is not available; use cpu or auto")
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name)


def run(args: argparse.Namespace) -> int:
    """Run the benchmark from parsed arguments; returns the exit code."""
    # The numbers were checked by their argparse types.
    check_outputs({"--json": args.json, "--plot": args.plot})
    set_threads(args.threads)
    device = _device(args.device)
    if args.shapes is None:
        shapes = list(GPU_SHAPES if device.type == "cuda" else CPU_SHAPES)
    else:
        shapes = parse_shapes(args.shapes)
        check_shapes_fit(shapes, device)
    presets = parse_presets(args.coefficients)
    dtypes = parse_dtypes(args.dtypes)
    if device.type == "cpu" and torch.float16 in dtypes:
        fp16 = fp16_cpu_note("--dtypes with fp16")
        if fp16:
            note(f"bench ns: {fp16}")

    rows: list[dict[str, Any]] = []
    engines: list[dict[str, Any]] = []
    job = start_job("shardmuon bench ns")
    units = len(shapes) * len(presets)
    job.done = lambda: f"{len(rows)} of {units} shapes" if rows else ""
    job.partial = lambda: _write_partial(args, rows, engines, units)
    # The work of a shape grows with its FLOPs: the first one timed gives the others'.
    flops = {
        (preset, shape): newton_schulz_flops(shape, len(NS_PRESETS[preset]))
        for preset in presets
        for shape in shapes
    }
    began = time.perf_counter()
    with new_progress(not args.no_progress) as progress:
        task = (
            progress.add_task("Newton-Schulz", total=len(shapes) * len(presets) * (1 + len(dtypes)))
            if progress
            else None
        )
        for preset in presets:
            for shape in shapes:
                reference = input_and_reference(shape, preset, device, args.seed)
                rows.append(
                    measure_shape(shape, preset, device, args.repeats, args.seed, reference)
                )
                _warn_if_unstable(rows[-1])
                if progress:
                    progress.advance(task)
                kinds = kind_inputs(shape, preset, device, args.seed)
                for dtype in dtypes:
                    engines.append(
                        measure_engine(shape, preset, dtype, device, args.repeats, args.seed, kinds)
                    )
                    _warn_if_unstable(engines[-1])
                    if progress:
                        progress.advance(task)
                if len(rows) == 1:
                    seconds = (time.perf_counter() - began) * sum(flops.values())
                    line = estimate_line(
                        "bench ns",
                        seconds / flops[preset, shape],
                        f"{'x'.join(map(str, shape))} measured, the others scaled by their FLOPs",
                    )
                    if line:
                        note(line)

    # One table per preset keeps the table narrow enough for 80 columns.
    for preset in presets:
        print_table(
            f"Newton-Schulz per call, {preset} coefficients "
            f"({device.type}, {torch.get_num_threads()} threads)",
            [
                "shape",
                "folded\nms",
                "unfolded\nms",
                "speed-\nup",
                "TFLOP/s",
                "of\nGEMM",
                "err\nfolded",
                "err\nunfolded",
            ],
            [
                [
                    "x".join(map(str, r["shape"])),
                    fmt(r["folded_ms"], ".2f"),
                    fmt(r["unfolded_ms"], ".2f"),
                    fmt(r["speedup"], ".2f", "x"),
                    fmt(r["folded_tflops"], ".3f"),
                    fmt(100 * r["fraction_of_gemm"], ".0f", "%"),
                    fmt(100 * r["rel_error_folded"], ".2f", "%"),
                    fmt(100 * r["rel_error_unfolded"], ".2f", "%"),
                ]
                for r in rows
                if r["preset"] == preset
            ],
        )
    for preset in presets:
        print_table(
            f"Standard vs Gram Newton-Schulz per call, {preset} coefficients ({device.type})",
            [
                "shape",
                "",
                "std\nms",
                "gram\nms",
                "time\n÷ std",
                "FLOPs\n÷ std",
            ],
            [
                [
                    "x".join(map(str, r["shape"])),
                    r["dtype"],
                    fmt(r["standard_ms"], ".1f"),
                    fmt(r["gram_ms"], ".1f"),
                    fmt(r["gram_time_ratio"], ".2f"),
                    fmt(r["gram_flops_ratio"], ".3f"),
                ]
                for r in engines
                if r["preset"] == preset
            ],
        )
        print_table(
            f"Error against fp64 by input kind, {preset} coefficients ({device.type})",
            ["shape", "", "input", "err\nstd", "err\ngram", "gram\n÷ std", "re-\ndone"],
            [
                [
                    "x".join(map(str, r["shape"])),
                    r["dtype"],
                    e["kind"],
                    fmt(e["standard"], ".2e"),
                    fmt(e["gram"], ".2e"),
                    fmt(e["gram"] / e["standard"] if e["standard"] else math.nan, ".2f"),
                    f"{e['guard_fallbacks']}/{e['guard_checked']}",
                ]
                for r in engines
                if r["preset"] == preset
                for e in r["errors"]
            ],
        )
    print_legend(
        [
            ("folded / unfolded ms", "one call of shardmuon's Newton-Schulz / dion's recipe"),
            (
                "std / gram",
                "newton_schulz_impl='folded' / 'gram' (its default restarts) in that dtype; "
                "time and exact FLOPs (restarts counted) of Gram over the standard's",
            ),
            (
                "input",
                "gaussian, logspaced (singular values 1e-4..1), lowrank (rank m/8 + 1e-3 noise)",
            ),
            ("redone", "Gram's matrices the divergence guard would recompute, of those checked"),
            ("speed-up", "unfolded time over folded time"),
            ("TFLOP/s", "folded: batch x iterations x (4 m^2 n + 2 m^3) FLOPs per call"),
            (
                "of GEMM",
                "that rate over the fastest plain X X^T GEMM measured on the same shape (bf16 or "
                "fp32, either layout): above 100% only in a disturbed run (see 'unstable')",
            ),
            ("err", "||NS - NS_fp64|| / ||NS_fp64||, against the float64 iteration"),
        ],
    )
    where = _device_label(device)
    write_outputs(
        args,
        "ns",
        {"results": rows, "engines": engines},
        lambda ax: _draw(ax, rows, where),
        "Newton-Schulz per call",
    )
    return 0


def _write_partial(
    args: argparse.Namespace, rows: list[dict], engines: list[dict], units: int
) -> str | None:
    """The shapes measured so far to ``--json``, marked ``"interrupted"``."""
    if not (args.json and rows):
        return None
    environ = environment(argv=getattr(args, "argv", None))
    payload = {"benchmark": "ns", "interrupted": True, "environment": environ,
               "results": rows, "engines": engines}  # fmt: skip
    write_json(args.json, payload)
    return f"{args.json} ({len(rows)} of {units} shapes)"


def _ms(value: float) -> str:
    """``9.0 ms``, ``87 ms``, ``0.12 ms``: two significant digits, enough to see a spread."""
    if value >= 10:
        return f"{value:.0f} ms"
    return f"{value:.1f} ms" if value >= 1 else f"{value:.2g} ms"


def unstable_warning(row: dict[str, Any]) -> str | None:
    """The warning for a row whose timed repeats disagreed by more than
    :data:`~shardmuon.bench.ns_measure.UNSTABLE_RATIO` (``None`` when they agreed): the
    shape, the call with the widest spread, and its fastest and slowest repeat."""
    calls = row.get("unstable_calls_ms") or {}
    if not calls:
        return None

    def ratio(item: tuple[str, list[float]]) -> float:
        fastest, slowest = item[1]
        return slowest / fastest if fastest > 0 else math.inf

    name, (fastest, slowest) = max(calls.items(), key=ratio)
    what = ", ".join(x for x in (name, row.get("dtype"), row["preset"]) if x)
    return (
        f"bench ns: warning: timings of {tuple(row['shape'])} ({what}) varied {_ms(fastest)} - "
        f"{_ms(slowest)}: the machine was likely busy; rerun or raise --repeats"
    )


def _warn_if_unstable(row: dict[str, Any]) -> None:
    line = unstable_warning(row)
    if line:
        note(line)


def _device_label(device: torch.device) -> str:
    """``"cuda: NVIDIA H200"`` or ``"cpu, 8 threads"``: what the times were measured on."""
    if device.type == "cuda":
        return f"cuda: {torch.cuda.get_device_name(device)}"
    threads = torch.get_num_threads()
    return f"cpu, {threads} thread{'' if threads == 1 else 's'}"


def _draw(ax, rows: list[dict[str, Any]], device: str) -> None:
    labels = [f"{'x'.join(map(str, r['shape']))}\n{r['preset']}" for r in rows]
    xs = range(len(rows))
    width = 0.4
    ax.bar([x - width / 2 for x in xs], [r["unfolded_ms"] for r in rows], width, label="unfolded")
    ax.bar([x + width / 2 for x in xs], [r["folded_ms"] for r in rows], width, label="folded")
    # save_plot turns and shrinks these labels if they would overlap.
    ax.set_xticks(list(xs), labels, fontsize=7)
    ax.set_ylabel(f"ms per call ({device})")
    ax.set_yscale("log")
    ax.legend()
