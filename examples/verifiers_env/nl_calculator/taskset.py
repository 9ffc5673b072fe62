"""Tasks, rewards and the taskset. The knobs under ``CalculatorConfig`` are the taskset's arguments
(``args:`` of a nemo_like ``generator: {kind: verifiers}``, ``--env.taskset.*`` for ``vf-eval``)."""

import random

import verifiers.v1 as vf

from .tools import CalculatorToolset

SYSTEM_PROMPT = "Use the add tool, then give the result as \\boxed{n}."


class CalculatorData(vf.TaskData):
    answer: str


class CalculatorTask(vf.Task[CalculatorData, vf.State, vf.TaskConfig]):
    @vf.reward(weight=1.0)
    async def correct(self, task: CalculatorData, trace: vf.Trace) -> float:
        """The answer in \\boxed{}, or the whole reply when it has none."""
        return float(vf.extract_boxed_answer(trace.last_reply.strip()).strip() == task.answer)

    @vf.metric
    async def tool_calls(self, trace: vf.Trace) -> float:
        messages = trace.branches[-1].messages if trace.branches else []
        return float(sum(1 for m in messages if m.role == "tool"))


class CalculatorConfig(vf.TasksetConfig):
    tools: vf.SharedToolsetConfig = vf.SharedToolsetConfig()
    """Where the calculator server runs (one for all of a batch's rollouts)."""
    num_tasks: int = 200
    """How many sums."""
    max_value: int = 9
    """Largest operand."""
    system_prompt_in_task: bool = False
    """Put SYSTEM_PROMPT on each task (a small model gains nothing from reading it)."""


class CalculatorTaskset(vf.Taskset[CalculatorTask, CalculatorConfig]):
    @classmethod
    def toolsets(cls, config: CalculatorConfig) -> list[vf.Toolset]:
        # Stateless, so one server serves every rollout: started once per batch, not once per episode.
        return [CalculatorToolset(config.tools)]

    def load(self):
        c = self.config
        rng = random.Random(0)
        for i in range(c.num_tasks):
            a, b = rng.randint(0, c.max_value), rng.randint(0, c.max_value)
            yield CalculatorTask(
                CalculatorData(
                    prompt=f"{a}+{b}?",
                    system_prompt=SYSTEM_PROMPT if c.system_prompt_in_task else None,
                    answer=str(a + b),
                    name=f"sum-{i}",
                ),
                c.task,
            )
