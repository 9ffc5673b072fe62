"""Throughput and worst-case latency of the math reward rule, on ordinary and hostile answers.

    uv run benchmarks/bench_math_verify.py
"""

from __future__ import annotations

import time

from nemo_like.environments.math_environment import verify_math_answer

CASES = {
    "plain integer": ("\\boxed{128}", "128"),
    "fraction vs decimal": ("\\boxed{\\frac{1}{2}}", "0.5"),
    "thousands separator": ("#### 1,000", "1000"),
    "no final answer": ("the answer is 128", "128"),
    "sympy: radicals": ("\\boxed{2\\sqrt{2}}", "\\sqrt{8}"),
    "hostile: tower 9^9^9": ("\\boxed{9^{9^{9}}}", "1"),
    "hostile: 5,000 terms": ("\\boxed{" + "+".join(["1"] * 5000) + "}", "5000"),
    "hostile: 1 MB of braces": ("\\boxed{" + "{" * 1_000_000, "1"),
}


def main() -> None:
    print(f"| {'case':<26} | {'score':>5} | {'calls':>6} | {'mean ms':>9} | {'max ms':>9} |")
    print(f"|{'-' * 28}|{'-' * 7}|{'-' * 8}|{'-' * 11}|{'-' * 11}|")
    for name, (response, truth) in CASES.items():
        n = 3 if "sympy" in name or "hostile" in name else 2000
        times = []
        for _ in range(n):
            t = time.perf_counter()
            score = verify_math_answer(response, truth)
            times.append(time.perf_counter() - t)
        print(f"| {name:<26} | {score:5.1f} | {n:6d} | {1000 * sum(times) / n:9.3f} | {1000 * max(times):9.3f} |")


if __name__ == "__main__":
    main()
