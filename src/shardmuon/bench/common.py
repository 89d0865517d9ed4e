"""Helpers the benchmarks (and the tests) share: seeds from names, relative differences, the
options every benchmark takes, and whether this CPU has native fp16 GEMMs."""

from __future__ import annotations

import math
import zlib
from collections.abc import Sequence

from torch import Tensor

from shardmuon.harness.cli_support import LAYERS_HELP, positive_int

__all__ = [
    "add_model_arguments",
    "add_output_arguments",
    "name_seed",
    "relative_difference",
]


def name_seed(*parts: object) -> int:
    """A 31-bit seed made of ``parts`` (names, steps, ranks): the same on every process."""
    return zlib.crc32(":".join(map(str, parts)).encode()) & 0x7FFFFFFF


def relative_difference(ours: Tensor | Sequence[Tensor], ref: Tensor | Sequence[Tensor]) -> float:
    """``||ours - ref||_F / ||ref||_F`` in float64, over all tensors of a list together.

    ``ours`` and ``ref`` are two tensors, or two equally long non-empty lists of tensors
    (the norms are then those of the concatenation).
    """
    if isinstance(ours, Tensor) and isinstance(ref, Tensor):
        ours, ref = [ours], [ref]
    if isinstance(ours, Tensor) or isinstance(ref, Tensor) or len(ours) != len(ref) or not ours:
        raise ValueError("need two tensors, or two equally long non-empty lists of tensors")
    diff = sum(float((a.double() - b.double()).square().sum()) for a, b in zip(ours, ref))
    norm = sum(float(b.double().square().sum()) for b in ref)
    return math.sqrt(diff / norm)


def add_model_arguments(parser, default: str) -> None:
    """``--model`` (a preset of :mod:`shardmuon.harness.models`, default ``default``) and ``--layers``."""
    from shardmuon.harness.models import MODEL_PRESETS

    parser.add_argument(
        "--model", choices=sorted(MODEL_PRESETS), default=default, help="model preset"
    )
    parser.add_argument(
        "--layers",
        type=positive_int,
        default=None,
        metavar="N",
        help=LAYERS_HELP + " (default: all of the preset's)",
    )


def add_output_arguments(parser, plot: str) -> None:
    """``--json PATH``, ``--plot PATH`` (a PNG ``plot``, e.g. "bar chart") and ``--no-progress``."""
    parser.add_argument(
        "--json", metavar="PATH", default=None, help="write all figures to this JSON file"
    )
    parser.add_argument("--plot", metavar="PATH", default=None, help=f"write a PNG {plot} here")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
