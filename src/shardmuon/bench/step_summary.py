"""The parent side of ``shardmuon bench step``: every rank's figures into table rows, printed.

See ``docs/benchmarks.md`` for the definition of each column.
"""

from __future__ import annotations

import statistics
from typing import Any

from shardmuon.bench.report import fmt, print_table, spread
from shardmuon.harness.cli_support import note

__all__ = ["draw", "print_results", "summarize"]


def _max_over_ranks(passes: list[list[dict]]) -> list[list[float]]:
    """Per pass, per step: the slowest rank's step time."""
    return [[max(times) for times in zip(*(r["step_times_s"] for r in ranks))] for ranks in passes]


def _newton_schulz(passes: list[list[dict]]) -> dict[str, Any]:
    """Step ÷ own Newton–Schulz: per rank, its median step ÷ its median NS replay; max.

    Ranks that made no Newton–Schulz call are left out. The spread is that of the per-step
    ratios (each step's slowest ratio over ranks), over the timed steps of every pass.
    """
    world = len(passes[0])
    ns = [
        statistics.median(t for ranks in passes for t in ranks[r]["ns_times_s"])
        for r in range(world)
    ]
    busy = [r for r in range(world) if passes[0][r]["ns_calls"]]
    ratios = [
        statistics.median(t for ranks in passes for t in ranks[r]["step_times_s"][1:]) / ns[r]
        for r in busy
    ]
    per_step = (
        [
            max(times[r] / ns[r] for r in busy)
            for ranks in passes
            for times in list(zip(*(rank["step_times_s"] for rank in ranks)))[1:]
        ]
        if busy
        else []
    )
    return {
        "owned_ns_s": max(ns[r] for r in busy) if busy else 0.0,
        "step_over_ns": max(ratios) if ratios else None,
        "step_over_ns_per_step": per_step,
        "step_over_ns_spread": spread(per_step) if per_step else None,
        "ns_calls": [len(r["ns_calls"]) for r in passes[0]],
    }


def _held(passes: list[list[dict]]) -> dict[str, float]:
    """``+overlap`` rows: the median (steps 2..) of the slowest rank's time in ``step()``."""
    if "held_times_s" not in passes[0][0]:
        return {}
    held = [[max(t) for t in zip(*(r["held_times_s"] for r in ranks))] for ranks in passes]
    return {"held_s": statistics.median(t for steps in held for t in steps[1:])}


def summarize(impl: str, passes: list[list[dict]]) -> dict[str, Any]:
    """One table row from every pass of ``impl`` (a list, per pass, of every rank's figures).

    Step time: per step the max over ranks, then the median over steps 2.. of all passes
    pooled; the first step is the first pass's step 1.
    """
    per_step = _max_over_ranks(passes)
    ranks = passes[0]
    row: dict[str, Any] = {
        "impl": impl,
        "passes": len(passes),
        "step_s": statistics.median(t for steps in per_step for t in steps[1:]),
        "first_step_s": per_step[0][0],
        "step_times_s": per_step,
        **_held(passes),
        "peak_bytes": max(r["peak_bytes"] for ranks_ in passes for r in ranks_),
        "transient_bytes": max(r["transient_bytes"] for ranks_ in passes for r in ranks_),
    }
    if "bytes_sent" in ranks[0]:
        sent = sum(r["bytes_sent"] for r in ranks)
        minimum = sum(r["bytes_minimum"] for r in ranks)
        padded = sum(r["padded_scheme_bytes"] for r in ranks)
        replica_sent = sum(r["replica_bytes_sent"] for r in ranks)
        row.update(
            a2a_gb_per_rank=max(r["bytes_sent"] for r in ranks) / 1e9,
            a2a_over_minimum=(sent / minimum) if minimum else (1.0 if sent == 0 else None),
            # With split replicas the all-to-alls shrink but broadcasts appear: not comparable.
            padded_over_minimum=(padded / minimum) if minimum and not replica_sent else None,
            replica_gb_per_rank=max(r["replica_bytes_sent"] for r in ranks) / 1e9,
            workspace_peak_bytes=max(r["workspace_peak_bytes"] for r in ranks),
            host_device_gb_per_rank=max(
                r["offload_bytes_loaded"] + r["offload_bytes_stored"] for r in ranks
            )
            / 1e9,
            offload_workspace_peak_bytes=max(r["offload_workspace_peak_bytes"] for r in ranks),
            bytes_sent=[r["bytes_sent"] for r in ranks],
            bytes_received=[r["bytes_received"] for r in ranks],
            bytes_minimum=[r["bytes_minimum"] for r in ranks],
            num_batches=[r["num_batches"] for r in ranks],
            matrices_orthogonalized=[r["matrices_orthogonalized"] for r in ranks],
            **_newton_schulz(passes),
            **_floor(passes, row["step_s"]),
        )
    return row


def _floor(passes: list[list[dict]], step_s: float) -> dict[str, Any]:
    """The floor of the busiest rank (its largest, first pass) and the step over it."""
    floors = [r["floor"] for r in passes[0] if "floor" in r]
    if not floors:
        return {}
    worst = max(floors, key=lambda f: f["seconds"])
    return {
        "floor": worst,
        "step_over_floor": step_s / worst["seconds"] if worst["seconds"] > 0 else None,
    }


def _spread_lines(rows: list[dict]) -> list[str]:
    lines = []
    for r in rows:
        s = r.get("step_over_ns_spread")
        if s:
            lines.append(
                f"  {r['impl']}: IQR {s['q1']:.2f}-{s['q3']:.2f}, range {s['min']:.2f}-{s['max']:.2f}"
            )
    return lines


def print_results(rows: list[dict], cfg, out: dict, skipped: dict[str, str]) -> None:
    """The time table, the memory-and-traffic table, and the notes (skipped impls)."""
    # Two narrow tables rather than one wide one, so that both fit 80 columns with the
    # longest impl name.
    mesh = "x".join(map(str, out["mesh_shape"])) or "-"
    steps = f"steps 2..{cfg.steps}" + (
        " of both passes (ABBA order)" if cfg.order == "abba" else ""
    )
    engine = ", ".join(
        f"{k.removeprefix('newton_schulz_')} {v}" for k, v in cfg.ns_options().items()
    )
    caption = (
        f"Median over {steps}, max over ranks; Newton-Schulz coefficients {cfg.coefficients}"
        + (f" ({engine} in every shardmuon impl)" if engine else "")
        + "."
    )
    spread_lines = _spread_lines(rows)
    if spread_lines:
        caption += "\nstep ÷ NS at each timed step (max over ranks):\n" + "\n".join(spread_lines)
    print_table(
        f"optimizer step: {cfg.model}"
        + (f" ({cfg.layers} layers)" if cfg.layers else "")
        + f", layout {cfg.layout} (mesh {mesh}), {out['world_size']} x {out['device']}, "
        f"{out['threads']} threads/rank",
        ["impl", "step\nms", "held\nms", "first\nstep ms", "own NS\nms", "step\n÷ NS"],
        [
            [
                r["impl"],
                fmt(1e3 * r["step_s"], ".2f"),
                fmt(1e3 * r["held_s"] if "held_s" in r else None, ".2f"),
                fmt(1e3 * r["first_step_s"], ".1f"),
                fmt(1e3 * r["owned_ns_s"] if "owned_ns_s" in r else None, ".2f"),
                fmt(r.get("step_over_ns"), ".2f"),
            ]
            for r in rows
        ],
        caption=caption,
        legend=[
            ("step ms", "wall time of opt.step() (+overlap: and of the synchronize after it)"),
            ("held ms", "+overlap: the time opt.step() held the caller ('-': not overlapped)"),
            ("first step ms", "step 1 (lazy state, first collectives, compilation)"),
            ("own NS ms", "the rank's Newton-Schulz calls of a step, replayed alone"),
            ("step ÷ NS", "per rank, step over own NS; max over ranks (1.00: all NS)"),
        ],
    )
    gib = 2**30
    memory_source = "CUDA allocator stats" if out["device"].startswith("cuda") else "CPU profiler"
    print_table(
        "memory and all-to-all traffic per step",
        [
            "impl",
            "peak\nGiB",
            "transient\nGiB",
            "all-to-all\nGB/rank",
            "a2a\n÷ min",
            "padded\n÷ min",
        ],
        [
            [
                r["impl"],
                fmt(r["peak_bytes"] / gib, ".4f"),
                fmt(r["transient_bytes"] / gib, ".4f"),
                fmt(r.get("a2a_gb_per_rank"), ".4f"),
                fmt(r.get("a2a_over_minimum"), ".2f"),
                fmt(r.get("padded_over_minimum"), ".2f"),
            ]
            for r in rows
        ],
        caption=f"Memory from {memory_source}, max over ranks; traffic: shardmuon's impls only.",
        legend=[
            ("peak GiB", "most memory live during a step"),
            ("transient GiB", "the part of the peak that the step itself allocated"),
            ("all-to-all GB/rank", "bytes a rank sends to the others, max over ranks"),
            ("a2a ÷ min", "bytes sent over the least the layout needs (1.00: no waste)"),
            ("padded ÷ min", "dion's padded scheme over that least, computed from the layout"),
        ],
    )
    floored = [r for r in rows if r.get("floor")]
    if floored:
        print_table(
            "the step beside its floor (what this device's GEMMs and memory allow)",
            ["impl", "step\nms", "floor\nms", "NS at\nGEMM ms", "state\nGB", "step\n÷ floor"],
            [
                [
                    r["impl"],
                    fmt(1e3 * r["step_s"], ".2f"),
                    fmt(1e3 * r["floor"]["seconds"], ".2f"),
                    fmt(1e3 * r["floor"]["ns_seconds"], ".2f"),
                    fmt(r["floor"]["state_bytes"] / 1e9, ".3f"),
                    fmt(r.get("step_over_floor"), ".2f"),
                ]
                for r in floored
            ],
            caption=(
                "The busiest rank's floor, from rates measured in this run: bf16 X X^T at "
                "the calls' shapes "
                f"{min(r['floor']['gemm_tflops_min'] for r in floored):.3g}-"
                f"{max(r['floor']['gemm_tflops_max'] for r in floored):.3g} TFLOP/s, "
                f"a copy {floored[0]['floor']['bandwidth_gbs']:.0f} GB/s."
            ),
            legend=[
                ("floor ms", "NS FLOPs at the measured GEMM rates + state bytes at the bandwidth"),
                ("NS at GEMM ms", "the rank's Newton-Schulz FLOPs at the measured GEMM rates"),
                ("state GB", "the step's unavoidable memory traffic (docs/benchmarks.md)"),
                ("step ÷ floor", "1.00: the step does nothing but its GEMMs and one pass"),
            ],
        )
    offloaded = [r for r in rows if r.get("host_device_gb_per_rank")]
    if offloaded:
        print_table(
            "optimizer-state offload (offload='state')",
            ["impl", "host↔device\nGB/rank", "state on device\nGiB (peak)", "workspace\nGiB"],
            [
                [
                    r["impl"],
                    fmt(r["host_device_gb_per_rank"], ".4f"),
                    fmt(r["offload_workspace_peak_bytes"] / gib, ".4f"),
                    fmt(r["workspace_peak_bytes"] / gib, ".4f"),
                ]
                for r in offloaded
            ],
            caption="Max over ranks, last step.",
            legend=[
                ("host↔device GB/rank", "optimizer state loaded plus stored in a step"),
                ("state on device GiB", "most state bytes on the device at once (the chunks)"),
                ("workspace GiB", "the step's estimated transient buffers (workspace_bytes)"),
            ],
        )
    note("Every column is explained in docs/benchmarks.md.")
    for impl, reason in skipped.items():
        note(f"skipped {impl}: {reason}")


def draw(ax, rows: list[dict]) -> None:
    """Bars of step time per impl, with each shardmuon impl's own Newton–Schulz time."""
    names = [r["impl"] for r in rows]
    ax.bar(names, [1e3 * r["step_s"] for r in rows], label="step")
    ns = [1e3 * r["owned_ns_s"] if "owned_ns_s" in r else float("nan") for r in rows]
    ax.plot(names, ns, "k_", markersize=30, mew=2, label="own Newton-Schulz")
    ax.set_ylabel("ms (median, max over ranks)")
    ax.tick_params(axis="x", labelsize=8)
    ax.legend()
