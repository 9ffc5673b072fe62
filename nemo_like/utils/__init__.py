"""Logging, checkpointing and timing utilities shared by the training loops.

The names below are imported on first use (PEP 562): grader worker processes import
``nemo_like.utils.registry`` through the environment registry and must not pay for torch, which
the checkpointing modules import.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from nemo_like.utils.checkpoint import CheckpointingConfig, CheckpointManager
    from nemo_like.utils.jsonl_files import read_metrics_jsonl
    from nemo_like.utils.logger import Logger, LoggerConfig, WandbConfig
    from nemo_like.utils.timer import Timer

_LAZY = {
    "CheckpointManager": "nemo_like.utils.checkpoint",
    "CheckpointingConfig": "nemo_like.utils.checkpoint",
    "Logger": "nemo_like.utils.logger",
    "LoggerConfig": "nemo_like.utils.logger",
    "WandbConfig": "nemo_like.utils.logger",
    "read_metrics_jsonl": "nemo_like.utils.jsonl_files",
    "Timer": "nemo_like.utils.timer",
}

__all__ = [
    "CheckpointManager",
    "CheckpointingConfig",
    "Logger",
    "LoggerConfig",
    "Timer",
    "WandbConfig",
    "read_metrics_jsonl",
]


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value  # later lookups skip this function
    return value
