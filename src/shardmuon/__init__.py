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
__version__ = "0.1.0"
