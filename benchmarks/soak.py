"""Soak: many GRPO steps in one process, sampling the memory (RSS) and open file descriptors of the
driver and of every process of the Ray cluster it started (policy workers, environment actors and
their grader processes, rollout workers, Ray's own) every ``--every`` steps; prints the growth of each
from ``--from-step`` to the end, and a table by role.

    uv run benchmarks/soak.py --steps 500 [--config examples/configs/grpo_math_tiny.yaml] [key=value ...]

The default config's dynamic sampling is turned off (one generation round a step: shorter steps, the
same code paths), validation runs every 100 steps, checkpoints every 100 (three kept). Exit code 1
when a process kind grew by more than ``--max-growth`` (5% by default) past its noise floor.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]


def _role(p: psutil.Process) -> str:
    try:
        cmd = p.cmdline()
    except (psutil.Error, OSError):
        return "?"
    head = cmd[0] if cmd else p.name()
    if head.startswith("ray::"):  # a Ray worker runs as "ray::ClassName" (or "ray::IDLE")
        return head.split(".")[0].split(" ")[0]
    text = " ".join(cmd)
    for key in ("raylet", "gcs_server", "dashboard", "log_monitor", "monitor.py", "runtime_env"):
        if key in text:
            return f"ray:{key}"
    return p.name()


def sample(driver: psutil.Process) -> dict[int, tuple[str, float, int]]:
    """pid -> (role, RSS MiB, open fds) of the driver and every descendant."""
    out = {}
    for p in [driver, *driver.children(recursive=True)]:
        try:
            out[p.pid] = ("driver" if p.pid == driver.pid else _role(p), p.memory_info().rss / 2**20, p.num_fds())
        except (psutil.Error, OSError):
            continue
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(ROOT / "examples" / "configs" / "grpo_math_tiny.yaml"))
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument("--from-step", type=int, default=50)
    ap.add_argument("--max-growth", type=float, default=0.05)
    ap.add_argument("--json", default=None, help="write every sample here")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()

    from nemo_like.experiment import GRPOExperiment

    overrides = [f"grpo.max_num_steps={args.steps}", "grpo.dynamic_sampling.enabled=false", "grpo.val_period=100",
                 "checkpointing.save_period=100", "checkpointing.keep_top_k=3", "logger.tensorboard_enabled=false",
                 "logger.stdout_enabled=false", "logger.log_dir=results/soak/logs",
                 "checkpointing.checkpoint_dir=results/soak/ckpt", *args.overrides]
    driver = psutil.Process(os.getpid())
    samples: list[tuple[int, dict[int, tuple[str, float, int]]]] = []
    t0 = time.perf_counter()
    with GRPOExperiment.from_config(args.config, overrides=overrides, resume=False) as exp:
        exp.validate()
        samples.append((0, sample(driver)))
        while exp.step_count < args.steps:
            exp.step()
            if exp.step_count % args.every == 0:
                samples.append((exp.step_count, sample(driver)))
                print(f"step {exp.step_count}: {len(samples[-1][1])} processes, driver "
                      f"{samples[-1][1][driver.pid][1]:.0f} MiB", file=sys.stderr, flush=True)
    wall = time.perf_counter() - t0
    if args.json:
        Path(args.json).write_text(json.dumps([[s, {str(k): v for k, v in d.items()}] for s, d in samples]))

    base = next((d for s, d in samples if s >= args.from_step), samples[0][1])
    base_step = next((s for s, _ in samples if s >= args.from_step), 0)
    last_step, last = samples[-1]
    by_role: dict[str, list[tuple[float, float, int, int]]] = defaultdict(list)
    for pid, (role, rss, fds) in last.items():
        if pid in base:  # alive from the base sample to the end (a restarted actor is a new process)
            by_role[role].append((base[pid][1], rss, base[pid][2], fds))
    print(f"\nsoak: {last_step} steps in {wall:.0f} s; growth from step {base_step} to {last_step}\n")
    print("| process | count | RSS MiB at base -> end | RSS growth | open fds base -> end |")
    print("|---|---:|---:|---:|---:|")
    worst = 0.0
    for role in sorted(by_role):
        rows = by_role[role]
        r0, r1 = sum(r[0] for r in rows), sum(r[1] for r in rows)
        f0, f1 = sum(r[2] for r in rows), sum(r[3] for r in rows)
        growth = (r1 - r0) / r0 if r0 else 0.0
        worst = max(worst, growth if r0 > 50 else 0.0)  # tiny processes: a few MiB is not a leak
        print(f"| {role} | {len(rows)} | {r0:.0f} -> {r1:.0f} | {100 * growth:+.1f}% | {f0} -> {f1} |")
    fd_growth = sum(r[3] - r[2] for rows in by_role.values() for r in rows)
    print(f"\nworst RSS growth of a process kind over 50 MiB: {100 * worst:+.1f}%; open fds {fd_growth:+d} in all")
    return 0 if worst <= args.max_growth and fd_growth <= 0 else 1


if __name__ == "__main__":
    sys.exit(main())
