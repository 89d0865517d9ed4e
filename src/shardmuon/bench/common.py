"""Helpers the benchmarks (and the tests) share: seeds from names, relative differences, the
options every benchmark takes, and whether this CPU has native fp16 GEMMs."""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterable, Sequence

import torch
from torch import Tensor

from shardmuon.harness.cli_support import LAYERS_HELP, positive_int

__all__ = [
    "DTYPES",
    "DTYPE_NAMES",
    "add_model_arguments",
    "add_output_arguments",
    "cpu_flags",
    "fp16_cpu_note",
    "name_seed",
    "native_fp16_gemms",
    "relative_difference",
]

# Newton-Schulz iteration dtypes by the short names the benchmarks' flags take.
DTYPES: dict[str, torch.dtype] = {
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp32": torch.float32,
}
DTYPE_NAMES: dict[torch.dtype, str] = {dtype: name for name, dtype in DTYPES.items()}


# CPU features under which torch's fp16 GEMMs run natively: x86's AVX512-FP16 and AMX-FP16,
# Arm's half-precision SIMD. Without them torch converts every fp16 block to fp32 and back;
# a 256x256 fp16 matmul took 50x a bf16 one on an AVX512-BF16 EPYC, and 4 bench steps with
# fp16 Newton-Schulz 4.5 minutes.
FP16_GEMM_FLAGS = ("avx512_fp16", "amx_fp16", "asimdhp")


def cpu_flags(cpuinfo: str | None = None) -> frozenset[str] | None:
    """The CPU's feature flags (x86 ``flags``, Arm ``Features`` of ``/proc/cpuinfo``).

    ``cpuinfo``: that file's text, read when not given. ``None`` where there is none
    (not Linux): unknown, not "no features".
    """
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo") as f:
                cpuinfo = f.read()
        except OSError:
            return None
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return None


def native_fp16_gemms(flags: Iterable[str] | None) -> bool | None:
    """Whether a CPU with these ``flags`` runs fp16 GEMMs natively; ``None`` when unknown."""
    if flags is None:
        return None
    return any(flag in FP16_GEMM_FLAGS for flag in flags)


def fp16_cpu_note(what: str, flags: Iterable[str] | None = None) -> str | None:
    """The warning to print before ``what`` (``"--ns-dtype fp16"``) runs fp16 GEMMs on this
    CPU, or ``None`` when it has native fp16 GEMMs or its flags are unknown.

    ``flags``: the CPU's (:func:`cpu_flags` when not given).
    """
    flags = cpu_flags() if flags is None else frozenset(flags)
    if native_fp16_gemms(flags) is not False:
        return None
    return (
        f"note: {what} on a CPU without native fp16 GEMMs (none of {', '.join(FP16_GEMM_FLAGS)} "
        "in /proc/cpuinfo): torch emulates them in fp32, about 50-100x slower than bf16; "
        "expect minutes where bf16 takes seconds (bf16 or a GPU avoids it)"
    )


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
