"""A verifiers environment package (the layout ``vf-init`` scaffolds): sums asked in words, a calculator
tool served over MCP, and a reward for the right answer in ``\\boxed{}``. verifiers' loader finds it by
its id, the importable module's name (``examples.verifiers_env.nl_calculator`` from the repository root,
``nl_calculator`` once the folder is on the path or installed)."""

from .taskset import CalculatorTaskset

__all__ = ["CalculatorTaskset"]
