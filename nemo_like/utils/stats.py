"""Paired before/after comparison of held-out results: the same problems graded twice."""

from __future__ import annotations

from math import comb


def mcnemar_exact_p(gained: int, lost: int) -> float:
    """Two-sided exact McNemar p-value: under "no change", each problem that flipped was equally
    likely to flip either way, so ``gained`` is Binomial(gained + lost, 1/2)."""
    if gained < 0 or lost < 0:
        raise ValueError(f"counts must be >= 0, got gained={gained}, lost={lost}")
    n = gained + lost
    if n == 0:
        return 1.0
    tail = sum(comb(n, i) for i in range(min(gained, lost) + 1)) / 2**n
    return min(1.0, 2 * tail)


def paired_change(before: list[bool], after: list[bool]) -> str:
    """``"37 gained, 8 lost, McNemar p < 0.001"`` for one set of problems graded before and after."""
    if len(before) != len(after):
        raise ValueError(f"paired results need the same problems: {len(before)} before, {len(after)} after")
    gained = sum(1 for b, a in zip(before, after) if a and not b)
    lost = sum(1 for b, a in zip(before, after) if b and not a)
    p = mcnemar_exact_p(gained, lost)
    return f"{gained} gained, {lost} lost, McNemar p {'< 0.001' if p < 0.001 else f'= {p:.3f}'}"
