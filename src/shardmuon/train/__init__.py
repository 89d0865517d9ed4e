"""``shardmuon train``: a tiny Hugging Face model with FSDP2 + DCP checkpoints, on
reverse-text SFT or byte-level LM pretraining."""

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
