"""``shardmuon train``: reverse-text SFT of a tiny Qwen3 / Qwen3-MoE with FSDP2 + DCP checkpoints."""

from shardmuon.train.checkpoint import CheckpointError, CorruptCheckpointError
from shardmuon.train.config import TrainConfig, TrainResult, range_means
from shardmuon.train.data import CharTokenizer, ReverseTextTask
from shardmuon.train.run import run_training

__all__ = [
    "CharTokenizer",
    "CheckpointError",
    "CorruptCheckpointError",
    "ReverseTextTask",
    "TrainConfig",
    "TrainResult",
    "range_means",
    "run_training",
]
