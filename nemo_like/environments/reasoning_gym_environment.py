"""Grading with reasoning-gym's own scorers: the ``reasoning_gym`` environment.

Rows come from :mod:`nemo_like.data.reasoning_gym_tasks` (``generator: {kind: reasoning_gym, ...}``)
and carry what regenerates their entry. The answer is taken from the last assistant message in the
format the prompt states (``answer_format``: the last ``\\boxed{...}``, or the last
``<answer>...</answer>``) and scored by the generator's ``score_answer(answer, entry)``: a float in
[0, 1] used as the reward as it is (some generators give partial credit). An answer that cannot be
extracted scores 0; a scorer that raises, hangs or runs out of memory scores 0 and is counted
(``num_failures``, ``num_timeouts``): scoring runs in grader subprocesses with a time limit.

This module imports neither torch nor reasoning_gym at import time (grader processes import it; they
import reasoning_gym once, at start-up, through ``warm_imports``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar, Literal

from pydantic import Field

from nemo_like.data.reasoning_gym_tasks import score_reasoning_gym_answer
from nemo_like.environments.env_config import TRAINER_SIDE_KEYS, EnvConfig, validate_env_config
from nemo_like.environments.grader_pool import GraderPool
from nemo_like.environments.interfaces import (
    EnvironmentInterface,
    EnvironmentReturn,
    last_assistant_text,
    normalize_step_inputs,
)
from nemo_like.environments.math_environment import MAX_ANSWER_CHARS, extract_final_answer

if TYPE_CHECKING:
    from nemo_like.data.interfaces import LLMMessageLogType

__all__ = ["ReasoningGymEnvConfig", "ReasoningGymEnvironment", "extract_answer", "score_reasoning_gym"]

_SCORER = f"{__name__}.score_reasoning_gym"
_ROW_KEYS = ("rg_dataset", "rg_options", "rg_index")


class ReasoningGymEnvConfig(EnvConfig):
    """``env.reasoning_gym``: checked before Ray starts."""

    # Where the answer is: the last \boxed{...} ("boxed"), or the last <answer_tag>...</answer_tag> ("tag").
    answer_format: Literal["boxed", "tag"] = "boxed"
    # answer_format "tag" only: the tag's name (letters, digits, _ and -): "answer" reads <answer>...</answer>.
    answer_tag: str = Field(default="answer", pattern=r"^[A-Za-z_][A-Za-z0-9_-]*$")
    # False: a score below 1 becomes 0. Some generators give partial credit (basic_arithmetic scores an
    # answer that contains the right one by their length ratio: "120" for "12" gets 0.67), which a
    # policy can learn to exploit by writing more.
    partial_credit: bool = True
    timeout_s: float = Field(default=5.0, gt=0)  # per scored answer
    num_workers: int = Field(default=1, ge=1)  # grader processes
    memory_limit_mb: int = Field(default=4096, ge=0)  # address space per grader (0: none)


def extract_answer(response: str, answer_format: str = "boxed", tag: str = "answer") -> str | None:
    """The final answer in ``response`` or None. The last box or opening tag decides, even when it
    is never closed (an earlier one is no fallback: that would reward writing several candidates).
    ``boxed`` reads as the math environment does (a GSM8K-style ``#### answer`` line also counts)."""
    if answer_format == "boxed":
        answer = extract_final_answer(response)
    else:
        start = response.rfind(f"<{tag}>")
        end = response.find(f"</{tag}>", start) if start >= 0 else -1
        answer = response[start + len(tag) + 2 : end] if end >= 0 else None
    if answer is None:
        return None
    answer = answer.strip()
    return answer if answer and len(answer) <= MAX_ANSWER_CHARS else None


def score_reasoning_gym(answer: str, dataset: str, options_json: str, index: int) -> float:
    """The generator's own score of ``answer`` on the entry ``dataset[index]``, clipped to [0, 1]
    (runs in a grader process)."""
    return min(1.0, max(0.0, float(score_reasoning_gym_answer(dataset, options_json, int(index), answer))))


def _format_instruction(cfg: ReasoningGymEnvConfig) -> str:
    return "\\boxed" if cfg.answer_format == "boxed" else f"<{cfg.answer_tag}>"


class ReasoningGymEnvironment(EnvironmentInterface):
    """Scores the last assistant message of each sample with its reasoning-gym generator's scorer.
    Single turn: every sample terminates. Never raises from :meth:`step`."""

    config_model: ClassVar[type[EnvConfig]] = ReasoningGymEnvConfig

    @classmethod
    def check_dataset(cls, ds_cfg: Any, options: EnvConfig) -> None:
        """A task graded here must come from the reasoning-gym generator and its prompt must state
        the answer format the grader reads (else every answer scores 0 and nothing is learnt)."""
        assert isinstance(options, ReasoningGymEnvConfig)
        if getattr(ds_cfg.generator, "kind", None) != "reasoning_gym":
            raise ValueError("is graded by the reasoning_gym environment, which needs rows from "
                             "generator: {kind: reasoning_gym, dataset: ..., ...}")
        marker = _format_instruction(options)
        said = " ".join(p for p in (ds_cfg.system_prompt, ds_cfg.prompt) if p)
        if marker not in said:
            example = ("Put your final answer in \\\\boxed{{}}." if options.answer_format == "boxed"
                       else f"Give your final answer as <{options.answer_tag}>...</{options.answer_tag}>.")
            raise ValueError(f"prompt: neither prompt nor system_prompt states the answer format that "
                             f"env.reasoning_gym.answer_format={options.answer_format} reads ({marker!r}); add "
                             f"it, e.g. prompt: \"{{}} {example}\"")

    def __init__(self, config: dict | None = None) -> None:
        self.cfg = validate_env_config("reasoning_gym", ReasoningGymEnvConfig, config)
        c = self.cfg.model_dump(exclude=set(TRAINER_SIDE_KEYS))
        self._pool = GraderPool(_SCORER, c["num_workers"], float(c["timeout_s"]), memory_limit_mb=c["memory_limit_mb"],
                                warm_imports=("nemo_like.data.reasoning_gym_tasks:import_reasoning_gym",))

    def step(self, message_log_batch: list[LLMMessageLogType], metadata: list[dict]) -> EnvironmentReturn:
        batch, meta = normalize_step_inputs(message_log_batch, metadata)
        n = len(batch)
        rewards = [0.0] * n
        failures = timeouts = unextracted = 0
        try:
            jobs, rows = [], []
            for i in range(n):
                try:
                    response = last_assistant_text(batch[i])
                    m = meta[i]
                    key = tuple(m[k] for k in _ROW_KEYS)
                    if response is None or not isinstance(key[0], str) or not isinstance(key[1], str):
                        raise TypeError("no assistant message or no reasoning-gym row keys")
                except Exception:
                    failures += 1
                    continue
                answer = extract_answer(response, self.cfg.answer_format, self.cfg.answer_tag)
                if answer is None:
                    unextracted += 1
                    continue
                jobs.append((answer, *key))
                rows.append(i)
            for i, (score, status) in zip(rows, self._pool.run_or_fail(jobs)):
                rewards[i] = score if self.cfg.partial_credit or score >= 1.0 else 0.0
                timeouts += status == "timeout"
                failures += status == "error"
        except Exception:  # last line of defence: step must never raise into the trainer
            rewards, failures = [0.0] * n, n

        import torch  # lazily: grader processes import this module and must not load torch

        reward_t = torch.tensor(rewards, dtype=torch.float32)
        return EnvironmentReturn(
            observations=[{"role": "environment", "content": f"Environment: score {r:g}"} for r in rewards],
            metadata=meta,
            next_stop_strings=[None] * n,
            rewards=reward_t,
            terminateds=torch.ones(n, dtype=torch.bool),
            metrics={"num_failures": float(failures), "num_timeouts": float(timeouts),
                     "no_answer_rate": unextracted / n if n else 0.0,
                     "accuracy": float((reward_t == 1.0).float().mean()) if n else 0.0},
        )

    def shutdown(self) -> None:
        self._pool.shutdown()

