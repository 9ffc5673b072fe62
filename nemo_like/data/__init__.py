"""Data: contracts, datasets, chat templates, row processors and batching.

Exports resolve lazily: importing ``nemo_like.data.interfaces`` (as environments and workers do) must not
pull in HF ``datasets`` or create import cycles with ``nemo_like.distributed``.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "CHATML_TEMPLATE": "chat_templates",
    "batched_message_log_to_flat_message": "collate",
    "rl_collate_fn": "collate",
    "ArithmeticConfig": "datasets",
    "DataError": "datasets",
    "DatasetConfig": "datasets",
    "FewShotExample": "datasets",
    "ReasoningGymConfig": "reasoning_gym_tasks",
    "generate_reasoning_gym_dataset": "reasoning_gym_tasks",
    "arithmetic_split_of": "datasets",
    "generate_arithmetic_dataset": "datasets",
    "load_dataset_from_config": "datasets",
    "write_jsonl": "datasets",
    "DatumSpec": "interfaces",
    "LLMMessageLogType": "interfaces",
    "TaskDataSpec": "interfaces",
    "AllTaskProcessedDataset": "processors",
    "make_datum_spec": "processors",
    "math_data_processor": "processors",
    "prompt_chat": "processors",
    "render_chat": "processors",
    "tokenize_text": "processors",
    "truncate_message_log": "processors",
    "sft_data_processor": "processors",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'nemo_like.data' has no attribute '{name}'")
    value = getattr(importlib.import_module(f"nemo_like.data.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
