"""Benchmarks behind ``shardmuon bench``: ``step`` (optimizer step), ``ns`` (Newton–Schulz),
``ab`` (update accuracy against a float64 Muon), ``plan`` (the plan at any scale, run nowhere),
``lm`` (Muon vs AdamW and the engines on byte-level LM pretraining). See
``docs/benchmarks.md``."""

from __future__ import annotations

__all__ = ["SUBCOMMANDS", "add_parser"]

SUBCOMMANDS = ("step", "ns", "ab", "plan", "lm")


def add_parser(subparsers) -> None:
    """Register ``bench`` and its sub-commands on ``subparsers`` (argparse sub-parsers)."""
    from shardmuon.bench import ab, lm, ns, plan, step
    from shardmuon.harness.cli_support import HelpFormatter

    bench = subparsers.add_parser(
        "bench",
        help="benchmarks: step (default), ns, ab, plan, lm",
        description="Benchmarks. With only options (or nothing), runs `step`.",
        formatter_class=HelpFormatter,
        allow_abbrev=False,
    )
    sub = bench.add_subparsers(dest="bench_command", metavar="{step,ns,ab,plan,lm}")
    step.add_parser(sub)
    ns.add_parser(sub)
    ab.add_parser(sub)
    plan.add_parser(sub)
    lm.add_parser(sub)
