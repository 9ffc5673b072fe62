"""Gold against proxy reward of a GRPO run trained on a reward model: a table by step, where the gold
score peaks, how far the proxy rose past it, and a picture (gold against proxy), from the run's
metrics.jsonl (grpo_rm_overopt_tiny.yaml logs both).

    uv run benchmarks/overoptimisation.py logs/grpo_rm_overopt_tiny/metrics.jsonl [--png PATH] [--every 10]

Proxy: the reward model's mean score of the step's samples (rm/score_mean). Gold: the environments'
mean reward of the same samples (rm/env_reward_mean), and the held-out greedy accuracy (val/accuracy)
where validated.
"""

from __future__ import annotations

import argparse

from nemo_like.utils.jsonl_files import read_metrics_jsonl


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("metrics")
    ap.add_argument("--png", default=None)
    ap.add_argument("--every", type=int, default=10)
    args = ap.parse_args(argv)
    rows = read_metrics_jsonl(args.metrics)
    steps = [r for r in rows if r.get("rm/score_mean") is not None]
    if not steps:
        raise SystemExit(f"{args.metrics}: no rm/score_mean: not a run with a reward_model section")
    val = {r["step"]: r["val/accuracy"] for r in rows if r.get("val/accuracy") is not None}

    def smooth(key: str, i: int, k: int = 5) -> float:  # mean over the k steps up to i: less noise
        xs = [s[key] for s in steps[max(0, i - k + 1):i + 1] if s.get(key) is not None]
        return sum(xs) / len(xs)

    print("| step | proxy: RM score (mean of 5 steps) | gold: verifier reward of the samples (mean of 5) | "
          "held-out greedy accuracy |")
    print("|---:|---:|---:|---:|")
    for i, s in enumerate(steps):
        if s["step"] % args.every == 0 or i == len(steps) - 1 or s["step"] == 1:
            acc = val.get(s["step"])
            print(f"| {s['step']} | {smooth('rm/score_mean', i):.3f} | {smooth('rm/env_reward_mean', i):.3f} | "
                  + (f"{acc:.1%}" if acc is not None else "") + " |")
    gold = [(smooth("rm/env_reward_mean", i), s["step"]) for i, s in enumerate(steps)]
    peak, at = max(gold)
    proxy_at = smooth("rm/score_mean", [s["step"] for s in steps].index(at))
    proxy_end = smooth("rm/score_mean", len(steps) - 1)
    print()
    print(f"gold (sample reward) peaks at {peak:.3f} at step {at}; the proxy there {proxy_at:.3f}, at the end "
          f"{proxy_end:.3f} ({proxy_end - proxy_at:+.3f}); gold at the end {gold[-1][0]:.3f}")
    if val:
        best = max(val.items(), key=lambda kv: kv[1])
        first = val.get(0, next(iter(val.values())))
        print(f"held-out accuracy: {first:.1%} at the start, best {best[1]:.1%} at step {best[0]}, "
              f"{val[max(val)]:.1%} at the end (step {max(val)})")
    if args.png:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(1, 2, figsize=(10, 4))
        xs = [s["step"] for s in steps]
        ax[0].plot(xs, [smooth("rm/score_mean", i) for i in range(len(steps))], label="proxy: RM score")
        ax[0].plot(xs, [g for g, _ in gold], label="gold: verifier reward")
        if val:
            ax[0].plot(list(val), list(val.values()), "o-", label="held-out accuracy")
        ax[0].set_xlabel("step")
        ax[0].legend()
        ax[1].plot([smooth("rm/score_mean", i) for i in range(len(steps))], [g for g, _ in gold], ".-")
        ax[1].set_xlabel("proxy (RM score)")
        ax[1].set_ylabel("gold (verifier reward)")
        fig.tight_layout()
        fig.savefig(args.png, dpi=100)
        print(f"picture: {args.png}")


if __name__ == "__main__":
    main()
