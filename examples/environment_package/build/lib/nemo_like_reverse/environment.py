"""``reverse_text``: the model is asked to spell a word backwards; the answer is compared with the
sample's ``ground_truth`` (the reversed word).

Imports no torch at module level: nemo_like imports this module to check ``env.reverse_text`` when
it validates a config, before any actor starts.
"""

from __future__ import annotations

import logging
from typing import ClassVar

from pydantic import Field

from nemo_like.environments import (
    EnvConfig,
    EnvironmentInterface,
    EnvironmentReturn,
    last_assistant_text,
    normalize_step_inputs,
)
from nemo_like.environments.env_config import TRAINER_SIDE_KEYS, validate_env_config

logger = logging.getLogger(__name__)


class ReverseTextConfig(EnvConfig):
    """``env.reverse_text`` in a nemo_like config."""

    # Compare ignoring upper/lower case ("OLLEh" counts as "olleh").
    ignore_case: bool = False
    # Reward of an answer with the right letters in another order (an anagram of the ground truth).
    partial_reward: float = Field(default=0.0, ge=0.0, le=1.0)


def _grade(answer: str, truth: str, cfg: ReverseTextConfig) -> float:
    answer, truth = answer.strip(), truth.strip()
    if cfg.ignore_case:
        answer, truth = answer.lower(), truth.lower()
    if answer == truth:
        return 1.0
    return cfg.partial_reward if sorted(answer) == sorted(truth) else 0.0


class ReverseTextEnvironment(EnvironmentInterface):
    """Single-turn: every sample ends after the model's one answer."""

    config_model: ClassVar[type[EnvConfig]] = ReverseTextConfig

    def __init__(self, config: dict | None = None) -> None:
        self.cfg = validate_env_config("reverse_text", ReverseTextConfig,
                                       {k: v for k, v in (config or {}).items() if k not in TRAINER_SIDE_KEYS})
        self._error_shown = False

    def step(self, message_log_batch: list, metadata: list[dict]) -> EnvironmentReturn:
        import torch  # here, not at import: config validation imports this module

        batch, meta = normalize_step_inputs(message_log_batch, metadata)
        rewards, unscorable = [], 0
        for log, info in zip(batch, meta, strict=True):
            try:
                answer = last_assistant_text(log)
                truth = (info or {}).get("ground_truth")
                if not isinstance(answer, str) or not isinstance(truth, str):
                    raise ValueError(f"need an assistant answer and a str ground_truth, got {answer!r} and {truth!r}")
                rewards.append(_grade(answer, truth, self.cfg))
            except Exception as e:  # a bad sample scores 0; it must never stop the trainer
                rewards.append(0.0)
                unscorable += 1
                if not self._error_shown:
                    self._error_shown = True
                    logger.warning("reverse_text: a sample could not be graded (scored 0): %s", e)
        n = len(batch)
        return EnvironmentReturn(
            observations=[{"role": "environment", "content": ""} for _ in range(n)],
            metadata=list(meta),
            next_stop_strings=[None] * n,
            rewards=torch.tensor(rewards, dtype=torch.float32),
            terminateds=torch.ones(n, dtype=torch.bool),
            metrics={"num_unscorable": float(unscorable)},
        )
