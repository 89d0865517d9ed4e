"""shardmuon: Muon for PyTorch that reads its distribution from DTensor placements."""

from shardmuon.layout import MuonBatch
from shardmuon.newton_schulz import (
    NS_PRESETS,
    newton_schulz,
    newton_schulz_reference,
    newton_schulz_unfolded,
    resolve_coefficients,
)
from shardmuon.optimizer import Muon
from shardmuon.plan import AdamWChunk, ChunkInfo
from shardmuon.telemetry import StepStats

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
__version__ = "0.1.0"
