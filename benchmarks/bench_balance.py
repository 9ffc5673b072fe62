"""policy.balance_batch on and off, one after the other in one run: seconds per step of the training
and log-prob passes on two training workers, and how uneven their tokens were.

    uv run benchmarks/bench_balance.py [--config PATH] [--steps N] [--rounds R] [key=value ...]

Default: the multi-task default (math, code and tool calls: lengths differ by task), two policy
workers of one thread each. Each round runs --steps steps after one warm-up step per setting, off
then on; the table gives the mean over all rounds' steps.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

DEFAULT_CONFIG = Path(__file__).resolve().parents[1] / "examples" / "configs" / "grpo_multi_env_tiny.yaml"
KEYS = ("timing/train", "timing/logprobs", "timing/total", "train/dp_token_imbalance")


def _steps(config_path: str, overrides: list[str], steps: int) -> list[dict[str, float]]:
    from nemo_like.algorithms.grpo_run import setup
    from nemo_like.config import load_config

    trainer = setup(load_config(config_path, overrides), resume=False)
    try:
        trainer.step()  # warm-up: first calls pay for lazy initialisation
        return [trainer.step() for _ in range(steps)]
    finally:
        trainer.close()


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(DEFAULT_CONFIG))
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2)
    args, extra = ap.parse_known_args(argv)
    base = ["grpo.val_period=0", "grpo.val_at_start=false", "checkpointing.enabled=false",
            "logger.jsonl_enabled=false", "logger.tensorboard_enabled=false", "logger.stdout_enabled=false",
            "cluster.num_workers=2", "cluster.cpus_per_worker=1", "policy.num_threads=1", *extra]
    rows: dict[bool, list[dict[str, float]]] = {False: [], True: []}
    for _ in range(args.rounds):
        for on in (False, True):
            rows[on] += _steps(args.config, [*base, f"policy.balance_batch={str(on).lower()}"], args.steps)
    print(f"\nconfig: {args.config} {' '.join(base[6:])}; {args.rounds} rounds x {args.steps} steps a setting\n")
    print(f"| {'':<26} | {'balance_batch off':>17} | {'balance_batch on':>16} |")
    print(f"|{'-' * 28}|{'-' * 19}|{'-' * 18}|")
    for k in KEYS:
        off, on = (statistics.mean(r[k] for r in rows[b] if k in r) for b in (False, True))
        print(f"| {k:<26} | {off:17.3f} | {on:16.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
