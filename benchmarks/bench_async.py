"""Synchronous against asynchronous GRPO on one config, in one run: wall time and held-out accuracy.

    uv run benchmarks/bench_async.py                                  # multi-env default, latency 0 and 1 s
    uv run benchmarks/bench_async.py --latency 1.0 --steps 12         # one scenario, shorter
    uv run benchmarks/bench_async.py --png async.png --json async.json key=value ...

For each tool-call latency (``env.tool.call_latency_s``: every tool call waits that long, as a web
API would), the synchronous loop (the config as it is) and the asynchronous one
(``grpo.async_rollouts`` with a separate rollout group, ``--rollout-workers``, ``--staleness``) train the same number of
steps from the same base model, one after the other, each in a fresh subprocess. Wall time is the
training loop's (validation included, Ray start and model loading not). The table gives both
sides' wall time, their ratio and the final per-task held-out accuracies; the PNG plots held-out
accuracy against wall-clock seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CONFIG = ROOT / "examples" / "configs" / "grpo_multi_env_tiny.yaml"
QUIET = ["checkpointing.enabled=false", "logger.jsonl_enabled=false", "logger.tensorboard_enabled=false",
         "logger.stdout_enabled=false", "logger.wandb_enabled=false"]


def async_overrides(staleness: int, cpus: int, split: tuple[int, int] | None = None,
                    rollout_workers: int = 2) -> list[str]:
    """Async GRPO on this machine: the trainer and ``rollout_workers`` rollout workers share its
    cores (``split``: threads of the trainer and of each rollout worker). More threads in all than
    the machine has oversubscribes it on purpose: the trainer computes a third of the time or less
    (its update skips inert samples), and rollouts wait on their environments."""
    train_cpus, gen_cpus = split or (max(1, cpus // 2), max(1, (cpus - max(1, cpus // 2)) // rollout_workers))
    out = ["policy.generation.colocated=false", "grpo.async_rollouts.enabled=true",
           f"grpo.async_rollouts.max_staleness={staleness}", "loss_fn.use_importance_sampling_correction=true",
           "loss_fn.truncated_importance_sampling_ratio=2.0", f"cluster.cpus_per_worker={train_cpus}",
           f"cluster.generation.num_workers={rollout_workers}", f"cluster.generation.cpus_per_worker={gen_cpus}"]
    slots = train_cpus + gen_cpus * rollout_workers
    if slots > cpus:  # Ray's CPUs are a count of slots, not cores
        out.append(f"cluster.num_cpus={slots + 1}")
    return out


def run_child(config: str, overrides: list[str], out: str) -> None:
    """One training run: setup, then step() to the end, validating as the config says."""
    from nemo_like.algorithms.grpo_run import setup
    from nemo_like.config import load_config

    cfg = load_config(config, overrides)
    trainer = setup(cfg, resume=False)
    points, steps = [], []
    try:
        trainer.validate()  # the base model's: the same for both sides, not timed
        points.append({"wall_s": 0.0, "step": 0, **trainer.last_val_metrics})
        t0 = time.perf_counter()
        for _ in range(cfg.grpo.max_num_steps):
            m = trainer.step()
            steps.append({k: v for k, v in m.items() if k.startswith(("timing/", "train/staleness", "async/",
                                                                      "train/policy_version_lag", "train/reward_mean"))})
            if any(k.startswith("val/") for k in m):
                points.append({"wall_s": time.perf_counter() - t0, "step": trainer.step_count,
                               **{k: v for k, v in m.items() if k.startswith("val/")}})
        if not (cfg.grpo.val_period and trainer.step_count % cfg.grpo.val_period == 0):
            trainer.validate()
            points.append({"wall_s": time.perf_counter() - t0, "step": trainer.step_count, **trainer.last_val_metrics})
        wall = time.perf_counter() - t0
    finally:
        trainer.close()
    Path(out).write_text(json.dumps({"wall_s": wall, "points": points, "steps": steps}))


def _accs(point: dict) -> dict[str, float]:
    return {k.split("/")[1]: v for k, v in point.items() if k.startswith("val/") and k.endswith("/accuracy")
            and k.count("/") == 2} or {"all": point.get("val/accuracy", float("nan"))}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(DEFAULT_CONFIG))
    ap.add_argument("--latency", type=float, action="append", help="tool call latency(ies), s (default: 0 and 1)")
    ap.add_argument("--steps", type=int, default=None, help="GRPO steps (default: the config's)")
    ap.add_argument("--staleness", type=int, default=1)
    ap.add_argument("--async-threads", default=None, metavar="TRAIN,ROLLOUT",
                    help="threads of the async trainer and of each rollout worker (default: half the cores "
                         "to the trainer, the other half shared by the rollout workers, at least one each)")
    ap.add_argument("--rollout-workers", type=int, default=2,
                    help="async rollout workers (default 2: on 2 cores they take the trainer's core while it waits)")
    ap.add_argument("--png", default="bench_async.png")
    ap.add_argument("--json", default=None)
    ap.add_argument("--_child", nargs=2, help=argparse.SUPPRESS)
    args, overrides = ap.parse_known_args(argv)
    if args._child:
        spec, out = args._child
        run_child(args.config, json.loads(spec), out)
        return 0
    cpus = os.cpu_count() or 2
    if args.rollout_workers < 1:
        ap.error(f"--rollout-workers must be at least 1, got {args.rollout_workers}")
    split = tuple(int(x) for x in args.async_threads.split(",")) if args.async_threads else None
    latencies = args.latency or [0.0, 1.0]
    base = QUIET + ([f"grpo.max_num_steps={args.steps}"] if args.steps else []) + overrides
    results: dict[tuple[float, str], dict] = {}
    for lat in latencies:
        # Tool calls that wait on I/O must not queue for a thread: a slot per call of a whole batch.
        lat_o = [f"env.tool.call_latency_s={lat}", "env.tool.max_concurrent_calls=256", "env.tool.max_stuck_calls=256",
                 f"env.tool.timeout_s={max(2.0, 2 * lat + 1)}"] if lat else []
        for mode, extra in (("sync", []), ("async", async_overrides(args.staleness, cpus, split, args.rollout_workers))):
            with tempfile.TemporaryDirectory() as tmp:
                out = Path(tmp) / "r.json"
                cmd = [sys.executable, __file__, "--config", args.config, "--_child",
                       json.dumps(base + lat_o + extra), str(out)]
                print(f"[bench_async] latency {lat:g} s, {mode}: running", flush=True)
                subprocess.run(cmd, check=True, cwd=ROOT)
                results[(lat, mode)] = json.loads(out.read_text())

    print(f"\ncommand: uv run benchmarks/bench_async.py {' '.join(argv)}")
    print(f"config: {args.config} ({os.cpu_count()} CPUs); async: max_staleness={args.staleness}, "
          f"{' '.join(async_overrides(args.staleness, cpus, split, args.rollout_workers)[4:])}\n")
    print("| tool latency | mode | wall s | s/step | async/sync | final held-out accuracy per task | staleness max |")
    print("|---|---|---|---|---|---|---|")
    for lat in latencies:
        sync_wall = results[(lat, "sync")]["wall_s"]
        for mode in ("sync", "async"):
            r = results[(lat, mode)]
            n = max(1, len(r["steps"]))
            accs = ", ".join(f"{t} {a:.1%}" for t, a in _accs(r["points"][-1]).items())
            stale = max((s.get("train/staleness_max", 0.0) for s in r["steps"]), default=0.0)
            ratio = f"{r['wall_s'] / sync_wall:.2f}" if mode == "async" else ""
            print(f"| {lat:g} s | {mode} | {r['wall_s']:.1f} | {r['wall_s'] / n:.2f} | {ratio} | {accs} | "
                  f"{stale:g} |")
    _plot(results, latencies, args.png)
    print(f"\naccuracy against wall-clock seconds: {args.png}")
    if args.json:
        Path(args.json).write_text(json.dumps({f"{k[0]}/{k[1]}": v for k, v in results.items()}, indent=1))
    return 0


def _plot(results: dict, latencies: list[float], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(latencies), figsize=(5.5 * len(latencies), 3.6), squeeze=False)
    for ax, lat in zip(axes[0], latencies):
        for mode, style in (("sync", "-"), ("async", "--")):  # a colour per task, a line style per mode
            pts = results[(lat, mode)]["points"]
            for k, task in enumerate(_accs(pts[0])):
                xs = [p["wall_s"] for p in pts]
                ys = [_accs(p).get(task, float("nan")) for p in pts]
                ax.plot(xs, ys, style, color=f"C{k}", marker="o" if mode == "sync" else "s", label=f"{mode} {task}")
        ax.set_title(f"tool latency {lat:g} s")
        ax.set_xlabel("wall-clock seconds (training loop)")
        ax.set_ylabel("held-out greedy accuracy")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main(sys.argv[1:]))
