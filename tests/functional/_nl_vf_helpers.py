"""A verifiers environment built from verifiers' own classes (``import verifiers.v1 as vf``), as a
user's module would be: a single-turn question taskset scored by two weighted reward functions and a
metric, with knobs that make some tasks lack the answer their reward reads or make a reward raise.
``load_environment(**args)`` is the ``pkg.module:load_environment`` form; the module is also a taskset
package verifiers' loader finds by id (``_nl_vf_helpers``). The multi-turn tool environment of the
tests is the example package ``examples/verifiers_env/nl_calculator``.
"""

from __future__ import annotations

import verifiers.v1 as vf

# ---- single turn: a question, the reply scored by two weighted rewards and a metric ---------------------


class QuestionData(vf.TaskData):
    # The reference the rewards read; None on the tasks that lack it (a dataset missing a column).
    answer: str | None = None


class QuestionTask(vf.Task[QuestionData, vf.State, vf.TaskConfig]):
    @vf.reward(weight=1.0)
    async def exact(self, task: QuestionData, trace: vf.Trace) -> float:
        if task.answer is None:
            raise KeyError("answer")  # the reward needs the column this task lacks
        if task.answer == "raise":
            raise RuntimeError("this reward fails on purpose")
        if task.answer == "nan":
            return float("nan")  # verifiers passes it through; the episode must not train on it
        return float(trace.last_reply == task.answer)

    @vf.reward(weight=0.5)
    async def short(self, trace: vf.Trace) -> float:
        return float(len(trace.last_reply) <= 8)

    @vf.metric
    async def reply_chars(self, trace: vf.Trace) -> float:
        return float(len(trace.last_reply))


class QuestionConfig(vf.TasksetConfig):
    num_tasks: int = 40
    # Every k-th task lacks its answer (0: none does); every r-th has a reward that raises (0: none).
    missing_every: int = 0
    raise_every: int = 0
    nan_rewards: bool = False  # every task's exact reward is NaN


class QuestionTaskset(vf.Taskset[QuestionTask, QuestionConfig]):
    def load(self):
        c = self.config
        for i in range(c.num_tasks):
            answer: str | None = str(i % 10)
            if c.missing_every and i % c.missing_every == c.missing_every - 1:
                answer = None
            elif c.raise_every and i % c.raise_every == c.raise_every - 1:
                answer = "raise"
            if c.nan_rewards:
                answer = "nan"
            yield QuestionTask(QuestionData(prompt=f"{i % 10}=", answer=answer, name=f"q{i}"), c.task)


# verifiers' loader finds a taskset by its module (the id), which exports exactly one Taskset.
__all__ = ["QuestionTaskset", "load_environment"]


def load_environment(harness: str = "null", **taskset_args) -> vf.Env:
    """The ``pkg.module:load_environment`` form: an environment built in code, its agent playing this
    module's taskset with ``harness`` on the local machine."""
    config = vf.SingleAgentEnvConfig.model_validate({
        "taskset": {"id": __name__, **taskset_args},
        "agent": {"harness": {"id": harness}, "runtime": {"type": "subprocess"}},
    })
    return vf.SingleAgentEnv(config)


def broken_factory(**_):
    raise RuntimeError("this factory fails on purpose")
