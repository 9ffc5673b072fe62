"""Paired before/after comparison of held-out results: the same problems graded twice."""

from __future__ import annotations

from math import atan, comb, cos, isinf, pi, sin, sqrt


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


def paired_counts(before: list[bool], after: list[bool]) -> tuple[int, int]:
    """(gained, lost): problems right only after, right only before (McNemar's discordant pairs)."""
    if len(before) != len(after):
        raise ValueError(f"paired results need the same problems: {len(before)} before, {len(after)} after")
    return (sum(1 for b, a in zip(before, after) if a and not b), sum(1 for b, a in zip(before, after) if b and not a))


def student_t_two_sided_p(t: float, df: int) -> float:
    """P(|T| >= |t|) for Student's t with an integer ``df`` >= 1, from the closed forms of its CDF
    (Abramowitz and Stegun 26.7.3-4): no SciPy for the few seeds a benchmark runs."""
    if df < 1:
        raise ValueError(f"degrees of freedom must be >= 1, got {df}")
    if isinf(t):
        return 0.0
    theta = atan(abs(t) / sqrt(df))
    s, c = sin(theta), cos(theta)
    if df % 2:  # odd: (2/pi) (theta + sin cos (1 + 2/3 cos^2 + (2*4)/(3*5) cos^4 + ...)) for df >= 3
        term, series = 1.0, 0.0
        for k in range(1, (df - 1) // 2 + 1):
            series += term
            term *= (2 * k) / (2 * k + 1) * c * c
        inside = 2 / pi * (theta + (s * c * series if df > 1 else 0.0))
    else:  # even: sin (1 + 1/2 cos^2 + (1*3)/(2*4) cos^4 + ...)
        term, series = 1.0, 0.0
        for k in range(1, df // 2 + 1):
            series += term
            term *= (2 * k - 1) / (2 * k) * c * c
        inside = s * series
    return min(1.0, max(0.0, 1.0 - inside))


def student_t_quantile(two_sided_p: float, df: int) -> float:
    """The t with ``P(|T| >= t) = two_sided_p`` (0.05: the half-width factor of a 95% interval)."""
    if not 0.0 < two_sided_p < 1.0:
        raise ValueError(f"two_sided_p must be in (0, 1), got {two_sided_p}")
    lo, hi = 0.0, 1.0
    while student_t_two_sided_p(hi, df) > two_sided_p:
        hi *= 2
    for _ in range(200):  # bisection: the p-value falls as t grows
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if student_t_two_sided_p(mid, df) > two_sided_p else (lo, mid)
    return (lo + hi) / 2


def paired_mean_difference(diffs: list[float], level: float = 0.95) -> dict[str, float]:
    """Mean of per-run differences (one per seed), their sample standard deviation, the ``level``
    t-interval of the mean and the two-sided one-sample t-test's p against no difference. One run
    gives the mean only (spread, interval and p are NaN); equal differences give sd 0 and p 0 or 1."""
    n = len(diffs)
    if n == 0:
        raise ValueError("paired_mean_difference needs at least one difference")
    mean = sum(diffs) / n
    nan = float("nan")
    if n == 1:
        return {"n": 1, "mean": mean, "sd": nan, "ci_low": nan, "ci_high": nan, "p": nan}
    sd = sqrt(sum((d - mean) ** 2 for d in diffs) / (n - 1))
    se = sd / sqrt(n)
    if se == 0:
        return {"n": n, "mean": mean, "sd": 0.0, "ci_low": mean, "ci_high": mean, "p": 1.0 if mean == 0 else 0.0}
    half = student_t_quantile(1 - level, n - 1) * se
    return {"n": n, "mean": mean, "sd": sd, "ci_low": mean - half, "ci_high": mean + half,
            "p": student_t_two_sided_p(mean / se, n - 1)}
