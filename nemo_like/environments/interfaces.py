"""The contract between the trainer and an environment (math grader, code sandbox, tool runner...).

Environments are plain classes implementing :class:`EnvironmentInterface`; the registry
(:mod:`nemo_like.environments.registry`) turns them into restartable Ray actors.

This module deliberately imports neither torch nor ray at runtime: the math grader's worker
processes import the environments package, and they must start in well under a second.
"""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple

if TYPE_CHECKING:  # annotations only; see the module docstring for why torch is not imported
    import torch

    from nemo_like.data.interfaces import LLMMessageLogType

__all__ = ["EnvironmentReturn", "EnvironmentInterface", "assistant_turns", "last_assistant_text",
           "normalize_step_inputs", "required_assistant_text"]


class EnvironmentReturn(NamedTuple):
    """What one ``EnvironmentInterface.step`` call returns for a batch of B samples."""

    observations: list[dict[str, str]]  # per sample: {"role": "environment", "content": "..."}
    metadata: list[dict | None]  # per sample, updated extra_env_info for the next turn
    next_stop_strings: list[list[str] | None]  # per sample stop strings for the next turn
    rewards: torch.Tensor  # [B] float32
    terminateds: torch.Tensor  # [B] bool
    # e.g. {"num_failures": 2.0, "num_timeouts": 1.0}. The default dict is shared between
    # instances (NamedTuple defaults are evaluated once), so never mutate it in place.
    metrics: dict[str, float] = {}


def normalize_step_inputs(message_log_batch: Any, metadata: Any) -> tuple[list, list]:
    """The batch as a list and metadata as a list of the same length (missing entries None), from
    whatever a caller passed: an environment must grade garbage as 0, not raise on it."""
    try:
        batch = list(message_log_batch)
    except Exception:
        batch = []
    try:
        meta = list(metadata) if metadata is not None else []
    except Exception:
        meta = []
    n = len(batch)
    return batch, (meta + [None] * n)[:n]


def assistant_turns(message_log: Any) -> tuple[str | None, int]:
    """(content of the last assistant message or None, how many assistant messages the log holds).
    Raises ``TypeError`` on a malformed log (not a list, a message that is not a dict, assistant
    content that is not a string): an environment grades such a sample 0 and counts it."""
    if not isinstance(message_log, (list, tuple)):
        raise TypeError(f"message log is a {type(message_log).__name__}, not a list")
    content: Any = None
    turns = 0
    for message in message_log:
        if not isinstance(message, dict):
            raise TypeError(f"message is a {type(message).__name__}, not a dict")
        if message.get("role") == "assistant":
            turns += 1
            content = message.get("content")
    if turns and not isinstance(content, str):
        raise TypeError(f"assistant content is a {type(content).__name__}, not a str")
    return content, turns


def required_assistant_text(message_log: Any) -> tuple[str, int]:
    """Like :func:`assistant_turns` for a grader that needs an answer: ``ValueError`` when the log holds
    no assistant message (``TypeError`` when malformed)."""
    content, turns = assistant_turns(message_log)
    if content is None:
        raise ValueError("no assistant message")
    return content, turns


def last_assistant_text(message_log: Any) -> str | None:
    """The content of the last assistant message of a log, None when it has none (the model's answer
    an environment grades). ``TypeError`` on a malformed log, as :func:`assistant_turns`."""
    return assistant_turns(message_log)[0]


class EnvironmentInterface(abc.ABC):
    """One task's environment: grades (and for multi-turn tasks answers) the model's messages."""

    # How many ``step`` calls its actor runs at once, on threads. 1 unless ``step`` is thread-safe: a
    # streaming rollout then sends a task's samples in several calls as their turns end, and a grader
    # that waits on I/O (a web API, a tool's latency) answers them side by side, not one after another.
    max_concurrent_steps: ClassVar[int] = 1

    @abc.abstractmethod
    def step(
        self, message_log_batch: list[LLMMessageLogType], metadata: list[dict]
    ) -> EnvironmentReturn:
        """Consume each sample's message log (plus its hidden ``extra_env_info`` in ``metadata``)
        and return observations, rewards and termination flags for the whole batch."""

    @classmethod  # noqa: B027 - optional hook
    def check_dataset(cls, ds_cfg: Any, options: Any) -> None:
        """Called before Ray starts for each dataset this environment grades, with the dataset's
        config and the environment's parsed ``config_model`` options (None without one). Raise
        ``ValueError`` naming what is wrong with the pairing (e.g. a prompt that does not ask for
        the answer format the grader reads); the message is prefixed with the dataset's task."""

    def global_post_process_and_metrics(self, batch: Any) -> tuple[Any, dict]:
        """Hook run once per step on the full batch (e.g. task-level metrics); identity by default."""
        return batch, {}

    def shutdown(self) -> None:  # noqa: B027 - optional hook: most environments hold nothing to release
        """Release resources (worker processes, sandboxes). Must be idempotent."""
