"""Data contracts shared by processors, collation, environments and the training loops.

The names follow NeMo RL so that code and docs written for it read the same here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NotRequired, TypedDict

# One conversation: each message is {"role": str, "content": str, "token_ids": torch.LongTensor 1-D}
# (plus optional per-token tensors such as "generation_logprobs", and an optional "loss": False that
# excludes an assistant message from the training loss).
LLMMessageLogType = list[dict[str, Any]]


class DatumSpec(TypedDict):
    message_log: LLMMessageLogType
    length: int  # total tokens across message_log
    extra_env_info: dict[str, Any]  # e.g. {"ground_truth": "579"}: hidden from the model, given to the env
    loss_multiplier: float  # 0.0 when the prompt was too long (then truncated): the sample carries no loss
    idx: int
    task_name: str
    stop_strings: NotRequired[list[str] | None]


@dataclass
class TaskDataSpec:
    task_name: str
    prompt: str | None = None  # python format string with one "{}" for the problem; None = raw problem
    system_prompt: str | None = None
    # Worked examples shown as earlier chat turns, each {"problem": ..., "response": ...}: the user turn
    # is ``prompt`` applied to the example's problem, the assistant turn its response.
    few_shot: list[dict[str, str]] | None = None
