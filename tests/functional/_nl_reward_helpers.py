"""Reward functions for the guard tests, importable by path in the driver, Ray workers and a CLI
subprocess (pytest puts this directory on sys.path; the subprocess gets it on PYTHONPATH)."""


def always_zero(completions, **columns):
    return [0.0] * len(completions)


def half_constant(completions, ground_truth, **columns):
    """Prompts with an even answer: the same reward for every completion (a group with no spread).
    Odd answers: 1 for an even-length completion, 0 for an odd one (usually spread within a group)."""
    return [0.5 if int(t) % 2 == 0 else float(len(c) % 2 == 0) for c, t in zip(completions, ground_truth)]
