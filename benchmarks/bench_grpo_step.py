"""Seconds per GRPO step, by phase, on a config (default: the embedded tiny one).

    uv run benchmarks/bench_grpo_step.py [--config PATH] [--steps N] [key=value ...]

Runs `--steps` steps after one warm-up step (validation, checkpoints and file logging off) and
prints a table: mean and max seconds per phase, and generated tokens per second.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

DEFAULT_CONFIG = Path(__file__).resolve().parents[1] / "examples" / "configs" / "grpo_math_tiny.yaml"


def main(argv: list[str]) -> int:
    from nemo_like.algorithms.grpo_run import setup
    from nemo_like.config import load_config

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(DEFAULT_CONFIG))
    ap.add_argument("--steps", type=int, default=5)
    args, overrides = ap.parse_known_args(argv)
    overrides = ["grpo.val_period=0", "grpo.val_at_start=false", "checkpointing.enabled=false",
                 "logger.jsonl_enabled=false", "logger.tensorboard_enabled=false", "logger.stdout_enabled=false",
                 "logger.wandb_enabled=false", *overrides]
    config = load_config(args.config, overrides)
    t0 = time.perf_counter()
    trainer = setup(config, resume=False)
    setup_s = time.perf_counter() - t0
    try:
        trainer.step()  # warm-up: first calls pay for lazy initialisation
        rows = [trainer.step() for _ in range(args.steps)]
    finally:
        trainer.close()

    phases = sorted({k for r in rows for k in r if k.startswith("timing/")})
    print(f"\nconfig: {args.config} {' '.join(overrides[7:])}")
    print(f"setup (Ray, base model, workers): {setup_s:.1f} s; {args.steps} timed steps after 1 warm-up\n")
    print(f"| {'phase':<32} | {'mean s':>8} | {'max s':>8} |")
    print(f"|{'-' * 34}|{'-' * 10}|{'-' * 10}|")
    for k in phases:
        vals = [r[k] for r in rows if k in r]
        print(f"| {k:<32} | {statistics.mean(vals):8.3f} | {max(vals):8.3f} |")
    for k in ("train/padding_efficiency", "train/logprob_padding_efficiency", "train/computed_tokens_ratio", "perf/generation_tokens_per_s",
              "perf/logprob_tokens_per_s", "perf/train_tokens_per_s", "perf/peak_memory_gb", "perf/mfu"):
        vals = [r[k] for r in rows if k in r]
        if vals:
            print(f"| {k:<32} | {statistics.mean(vals):8.3f} | {max(vals):8.3f} |")
    gen_tokens = [r["train/response_length_mean"] * r["train/num_samples"] for r in rows]
    gen_s = [r["timing/generation_and_reward"] for r in rows]
    print(f"| {'generated tokens / s (gen+reward)':<32} | {sum(gen_tokens) / sum(gen_s):8.0f} | {'':>8} |")
    print(f"| {'samples / s (whole step)':<32} | "
          f"{sum(r['train/num_samples'] for r in rows) / sum(r['timing/total'] for r in rows):8.1f} | {'':>8} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
