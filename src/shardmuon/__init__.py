"""shardmuon: Muon for PyTorch that reads its distribution from DTensor placements."""

from shardmuon.ops.newton_schulz import (
    NS_PRESETS,
    newton_schulz,
    newton_schulz_reference,
    newton_schulz_unfolded,
    resolve_coefficients,
)
from shardmuon.optimizer import Muon
from shardmuon.planning.batches import MuonBatch
from shardmuon.planning.plan import AdamWChunk, ChunkInfo
from shardmuon.runtime.telemetry import StepStats

__all__ = [
    "NS_PRESETS",
    "AdamWChunk",
    "ChunkInfo",
    "Muon",
    "MuonBatch",
    "StepStats",
    "newton_schulz",
    "newton_schulz_reference",
    "newton_schulz_unfolded",
    "resolve_coefficients",
]


def _version() -> str:
    """The installed distribution's version; in a source tree that is not installed
    (``PYTHONPATH=src``), the version in its ``pyproject.toml``. One value: pyproject's."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("shardmuon")
    except PackageNotFoundError:
        pass
    import re
    from pathlib import Path

    try:
        text = (Path(__file__).resolve().parents[2] / "pyproject.toml").read_text()
    except OSError:
        return "0+unknown"
    if not re.search(r'^name\s*=\s*"shardmuon"', text, re.MULTILINE):
        return "0+unknown"  # another project's pyproject.toml
    match = re.search(r'^version\s*=\s*"([^"]+)"', text, re.MULTILINE)
    return match.group(1) if match else "0+unknown"


__version__ = _version()
