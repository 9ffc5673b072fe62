"""An environment with a typed config of its own: full reward for the exact answer in ``\\boxed{}``,
a smaller one for a boxed answer that is wrong, nothing otherwise.

    --import my_extensions.exact_answer_env data.train.env_name=exact_answer data.train.processor=math \\
        ++env.exact_answer.format_reward=0.2
"""

from __future__ import annotations

import re

import torch
from pydantic import Field

from my_extensions._trace import trace
from nemo_like.environments import (
    EnvConfig,
    EnvironmentInterface,
    EnvironmentReturn,
    last_assistant_text,
    normalize_step_inputs,
    register_env,
)

BOXED = re.compile(r"\\boxed\{([^{}]*)\}")


class ExactAnswerConfig(EnvConfig):
    correct_reward: float = 1.0
    format_reward: float = Field(0.1, ge=0)  # boxed, but not the answer


@register_env("exact_answer")
class ExactAnswerEnvironment(EnvironmentInterface):
    config_model = ExactAnswerConfig

    def __init__(self, config: dict | None = None) -> None:
        self.cfg = ExactAnswerConfig.model_validate({k: v for k, v in (config or {}).items() if k != "step_timeout_s"})
        trace("environment", f"format_reward={self.cfg.format_reward}")

    def step(self, message_log_batch, metadata) -> EnvironmentReturn:
        batch, meta = normalize_step_inputs(message_log_batch, metadata)
        rewards = []
        for log, info in zip(batch, meta):
            try:
                answers = BOXED.findall(last_assistant_text(log) or "")
            except TypeError:  # a malformed log scores 0
                answers = []
            truth = str((info or {}).get("ground_truth", "")).strip()
            rewards.append(0.0 if not answers else self.cfg.correct_reward if answers[-1].strip() == truth
                           else self.cfg.format_reward)
        n = len(batch)
        return EnvironmentReturn(observations=[{"role": "environment", "content": ""}] * n, metadata=meta,
                                 next_stop_strings=[None] * n, rewards=torch.tensor(rewards, dtype=torch.float32),
                                 terminateds=torch.ones(n, dtype=torch.bool))
