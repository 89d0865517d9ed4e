"""What the CLIs need to know about this machine and its dtypes: the Newton–Schulz dtype
names the flags take, and whether the CPU runs fp16 GEMMs natively (a warning before a run
that would be 50-100x slower than it looks)."""

from __future__ import annotations

from collections.abc import Iterable

import torch

__all__ = ["DTYPES", "DTYPE_NAMES", "cpu_flags", "fp16_cpu_note", "native_fp16_gemms"]

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
