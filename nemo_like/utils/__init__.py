"""Logging, checkpointing and timing utilities shared by the training loops."""

from nemo_like.utils.checkpoint import CheckpointingConfig, CheckpointManager
from nemo_like.utils.logger import Logger, LoggerConfig, WandbConfig, read_metrics_jsonl
from nemo_like.utils.timer import Timer

__all__ = [
    "CheckpointManager",
    "CheckpointingConfig",
    "Logger",
    "LoggerConfig",
    "Timer",
    "WandbConfig",
    "read_metrics_jsonl",
]
