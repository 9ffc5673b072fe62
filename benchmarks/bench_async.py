"""Synchronous against asynchronous GRPO on one config, in one run: wall time and held-out accuracy.

    uv run benchmarks/bench_async.py                                  # multi-env default, latency 0 and 1 s
    uv run benchmarks/bench_async.py --latency 1.0 --steps 12         # one scenario, shorter
    uv run benchmarks/bench_async.py --png async.png --json async.json key=value ...
    uv run benchmarks/bench_async.py --latency 1.0 --seeds 4 --val-samples 400 --json a.json   # paired stats
    uv run benchmarks/bench_async.py --report a.json                  # the tables of a saved (or partial) run

For each tool-call latency (``env.tool.call_latency_s``: every tool call waits that long, as a web
API would), the synchronous loop (the config as it is) and the asynchronous one
(``grpo.async_rollouts`` with a separate rollout group, ``--rollout-workers``, ``--staleness``) train the same number of
steps from the same base model, one after the other, each in a fresh subprocess. Wall time is the
training loop's (validation included, Ray start and model loading not). The table gives both
sides' wall time, their ratio and the final per-task held-out accuracies; the PNG plots held-out
accuracy against wall-clock seconds.

With ``--seeds N`` (or ``--seed-list``) each side runs once per ``grpo.seed`` (the prompt order and the
sampling; the base model is the same), and every task's final held-out results are compared problem
by problem: both sides of a seed grade the same problems, so each (seed, problem) is a pair. Per task
the table gives the mean accuracy of each side, the mean async - sync difference over seeds with its
spread and 95% t-interval (the test of the training procedure: a seed is the unit that varies), the
pooled McNemar exact test over every (seed, problem) pair (the test of these trained models), and
the mean policy-version lag of each task's training samples. ``--val-samples`` raises every held-out
set (capped at what a generated split holds). Results are written to ``--json`` after every run.
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

from nemo_like.utils.stats import mcnemar_exact_p, paired_counts, paired_mean_difference

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


def val_samples_override(config: str, overrides: list[str], n: int) -> list[str]:
    """``grpo.max_val_samples`` and every generated validation set raised to ``n`` problems (a split
    with fewer gives all it has: num_samples null where the generator allows it)."""
    from nemo_like.config import load_config
    from nemo_like.data.datasets import load_dataset_from_config
    from nemo_like.data.errors import DataError

    cfg = load_config(config, overrides)
    sets = []
    for v in cfg.data.validation_list:
        d = v.model_dump(exclude_unset=True, mode="json")
        if v.generator is not None:
            d["generator"]["num_samples"] = n
            try:
                load_dataset_from_config(v.model_copy(update={"generator": v.generator.model_copy(
                    update={"num_samples": n})}))
            except DataError:
                if "num_samples" not in type(v.generator).model_fields or \
                        type(v.generator).model_fields["num_samples"].is_required():
                    raise
                d["generator"]["num_samples"] = None  # every problem of the split
        sets.append(d)
    return [f"grpo.max_val_samples={n}", f"data.validation={json.dumps(sets)}"]


def _task_lag(batch: dict, step: int) -> dict[str, float]:
    """Mean steps behind the trained weights of each task's samples in this step's batch."""
    if "policy_version" not in batch:
        return {}
    lag = (step - batch["policy_version"]).clamp(min=0).float().tolist()
    out: dict[str, list[float]] = {}
    for t, x in zip(batch["task_name"], lag):
        out.setdefault(t, []).append(x)
    return {f"lag/{t}": sum(xs) / len(xs) for t, xs in out.items()}


def run_child(config: str, spec: dict, out: str) -> None:
    """One training run: setup, then step() to the end, validating as the config says."""
    from nemo_like.algorithms.grpo_run import setup
    from nemo_like.config import load_config

    cfg = load_config(config, spec["overrides"])
    trainer = setup(cfg, resume=False)
    points, steps = [], []
    try:
        if spec.get("base_val", True):
            trainer.validate()  # the base model's: the same for both sides and every seed, not timed
            points.append({"wall_s": 0.0, "step": 0, **trainer.last_val_metrics})
        t0 = time.perf_counter()
        for _ in range(cfg.grpo.max_num_steps):
            m = trainer.step()
            steps.append({k: v for k, v in m.items() if k.startswith(("timing/", "train/", "async/"))}
                         | _task_lag(trainer.last_batch, trainer.step_count - 1))
            if any(k.startswith("val/") for k in m):
                points.append({"wall_s": time.perf_counter() - t0, "step": trainer.step_count,
                               **{k: v for k, v in m.items() if k.startswith("val/")}})
        if not (cfg.grpo.val_period and trainer.step_count % cfg.grpo.val_period == 0):
            trainer.validate()
            points.append({"wall_s": time.perf_counter() - t0, "step": trainer.step_count, **trainer.last_val_metrics})
        wall = time.perf_counter() - t0
        final = trainer.last_val_results
    finally:
        trainer.close()
    Path(out).write_text(json.dumps({"wall_s": wall, "points": points, "steps": steps, "final": final}))


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
    ap.add_argument("--seeds", type=int, default=None,
                    help="runs per side: grpo.seed, grpo.seed+1, ... (default: the config's seed, once)")
    ap.add_argument("--seed-list", default=None, metavar="A,B,...", help="these grpo.seed values instead")
    ap.add_argument("--val-samples", type=int, default=None,
                    help="held-out problems per task (grpo.max_val_samples and every generated validation set; "
                         "a split with fewer gives all it has)")
    ap.add_argument("--base-val-every", action="store_true",
                    help="validate the base model in every run (default: in the first seed's only: it is the same)")
    ap.add_argument("--async-extra", action="append", metavar="KEY=VALUE",
                    help="an override of the async side only (repeatable), e.g. a hypothesis to test")
    ap.add_argument("--sides", default="sync,async",
                    help="which sides to run (default both; one side alone, e.g. to set a variant beside a saved run)")
    ap.add_argument("--jobs", type=int, default=1,
                    help="runs at once (default 1; more measures accuracy only: the runs share the cores)")
    ap.add_argument("--report", default=None, metavar="JSON", help="print the tables of a saved --json and exit")
    ap.add_argument("--png", default="bench_async.png")
    ap.add_argument("--json", default=None, help="every run's results, written after each run")
    ap.add_argument("--_child", nargs=2, help=argparse.SUPPRESS)
    args, overrides = ap.parse_known_args(argv)
    if args._child:
        spec, out = args._child
        run_child(args.config, json.loads(spec), out)
        return 0
    if args.report:
        saved = json.loads(Path(args.report).read_text())
        print_report(saved["meta"], _runs_from_json(saved["runs"]))
        return 0
    cpus = os.cpu_count() or 2
    if args.rollout_workers < 1:
        ap.error(f"--rollout-workers must be at least 1, got {args.rollout_workers}")
    if args.seeds is not None and args.seed_list:
        ap.error("give --seeds N or --seed-list a,b,..., not both")
    if args.jobs < 1:
        ap.error(f"--jobs must be at least 1, got {args.jobs}")
    if args.seeds is not None and args.seeds < 1:
        ap.error(f"--seeds must be at least 1, got {args.seeds}")
    split = tuple(int(x) for x in args.async_threads.split(",")) if args.async_threads else None
    latencies = args.latency or [0.0, 1.0]
    base = QUIET + ([f"grpo.max_num_steps={args.steps}"] if args.steps else []) + overrides
    if args.val_samples:
        base += val_samples_override(args.config, base, args.val_samples)
    seeds: list[int | None] = [None]  # the config's own grpo.seed
    if args.seed_list:
        seeds = [int(x) for x in args.seed_list.split(",")]
    elif args.seeds:
        from nemo_like.config import load_config

        first = load_config(args.config, base).grpo.seed
        seeds = [first + i for i in range(args.seeds)]
    async_o = async_overrides(args.staleness, cpus, split, args.rollout_workers)
    meta = {"command": f"uv run benchmarks/bench_async.py {' '.join(argv)}", "config": args.config, "cpus": cpus,
            "async": async_o + (args.async_extra or []), "staleness": args.staleness, "latencies": latencies, "seeds": seeds}
    jobs: list[tuple[tuple[float, int | None, str], dict]] = []
    for lat in latencies:
        # Tool calls that wait on I/O must not queue for a thread: a slot per call of a whole batch.
        lat_o = [f"env.tool.call_latency_s={lat}", "env.tool.max_concurrent_calls=256", "env.tool.max_stuck_calls=256",
                 f"env.tool.timeout_s={max(2.0, 2 * lat + 1)}"] if lat else []
        for seed in seeds:
            seed_o = [] if seed is None else [f"grpo.seed={seed}"]
            for mode, extra in (("sync", []), ("async", async_o + (args.async_extra or []))):
                if mode not in args.sides.split(","):
                    continue
                # The base model's validation is the same for every run: once per latency is enough.
                jobs.append(((lat, seed, mode), {"overrides": base + lat_o + seed_o + extra,
                                                 "base_val": seed == seeds[0] or args.base_val_every}))
    runs = run_all(args.config, jobs, args.jobs, meta, args.json)
    if len(runs) < len(jobs):
        print(f"[bench_async] {len(jobs) - len(runs)} of {len(jobs)} runs failed (see above)", flush=True)
    if not runs:
        return 1
    print_report(meta, runs)
    if all((lat, seeds[0], m) in runs for lat in latencies for m in ("sync", "async")):
        _plot(runs, latencies, seeds[0], args.png)
        print(f"\naccuracy against wall-clock seconds (seed {seeds[0] if seeds[0] is not None else 'default'}): "
              f"{args.png}")
    return 0 if len(runs) == len(jobs) else 1


def run_all(config: str, jobs: list, parallel: int, meta: dict, json_path: str | None) -> dict:
    """Each run in a fresh subprocess, up to ``parallel`` at once (their output then goes to a log file
    each); the results so far are written to ``json_path`` after every run."""
    runs: dict[tuple[float, int | None, str], dict] = {}
    logs = Path(tempfile.mkdtemp(prefix="bench_async_"))
    pending, running = list(enumerate(jobs)), {}
    while pending or running:
        while pending and len(running) < parallel:
            i, (key, spec) = pending.pop(0)
            out, log = logs / f"run{i}.json", logs / f"run{i}.log"
            cmd = [sys.executable, __file__, "--config", config, "--_child", json.dumps(spec), str(out)]
            sink = open(log, "w") if parallel > 1 else None  # noqa: SIM115 - closed when the run ends
            print(f"[bench_async] latency {key[0]:g} s, seed {key[1] if key[1] is not None else 'default'}, "
                  f"{key[2]}: running" + (f" (log: {log})" if sink else ""), flush=True)
            proc = subprocess.Popen(cmd, cwd=ROOT, stdout=sink, stderr=subprocess.STDOUT if sink else None)
            running[proc] = (key, out, log, sink)
        time.sleep(1.0)
        for proc in [p for p in running if p.poll() is not None]:
            key, out, log, sink = running.pop(proc)
            if sink:
                sink.close()
            if proc.returncode != 0 or not out.exists():
                print(f"[bench_async] {key}: FAILED with exit code {proc.returncode}" +
                      (f"; its log: {log}" if sink else ""), flush=True)
                continue
            runs[key] = json.loads(out.read_text())
            print(f"[bench_async] {key}: done, {runs[key]['wall_s']:.1f} s", flush=True)
            if json_path:  # after every run: a benchmark cut short still leaves what it measured
                Path(json_path).write_text(json.dumps({"meta": meta, "runs": {
                    f"{k[0]}/{k[1]}/{k[2]}": v for k, v in runs.items()}}, indent=1))
    return runs


def _runs_from_json(saved: dict) -> dict[tuple[float, int | None, str], dict]:
    out = {}
    for key, v in saved.items():
        lat, seed, mode = key.split("/")
        out[(float(lat), None if seed == "None" else int(seed), mode)] = v
    return out


def per_task(final: dict) -> dict[str, list[bool]]:
    """A validation's per-problem results (``trainer.last_val_results``) split by task, in order."""
    out: dict[str, list[bool]] = {}
    for t, ok in zip(final["task_name"], final["correct"]):
        out.setdefault(t, []).append(bool(ok))
    return out


def mean_lag(steps: list[dict], task: str) -> float:
    """Mean over steps of a task's mean policy-version lag (0: every sample from the trained weights)."""
    xs = [s[f"lag/{task}"] for s in steps if f"lag/{task}" in s]
    return sum(xs) / len(xs) if xs else 0.0


def compare_tasks(runs: dict[tuple[int | None, str], dict]) -> dict[str, dict]:
    """Per task, async against sync over the seeds both sides finished: each side's per-seed
    accuracy (points), the per-seed differences with their mean, spread, 95% t-interval and t-test p,
    the McNemar exact test over every (seed, problem) pair, and each side's mean lag."""
    seeds = sorted({s for s, m in runs if (s, "sync") in runs and (s, "async") in runs}, key=lambda s: (s is None, s))
    rows: dict[str, dict] = {}
    for seed in seeds:
        sync, asyn = per_task(runs[(seed, "sync")]["final"]), per_task(runs[(seed, "async")]["final"])
        for task, before in sync.items():
            after = asyn[task]
            gained, lost = paired_counts(before, after)
            r = rows.setdefault(task, {"seeds": [], "sync": [], "async": [], "diff": [], "gained": 0, "lost": 0,
                                       "pairs": 0, "lag_sync": [], "lag_async": []})
            a_s, a_a = 100 * sum(before) / len(before), 100 * sum(after) / len(after)
            r["seeds"].append(seed)
            r["sync"].append(a_s)
            r["async"].append(a_a)
            r["diff"].append(a_a - a_s)
            r["gained"] += gained
            r["lost"] += lost
            r["pairs"] += len(before)
            r["lag_sync"].append(mean_lag(runs[(seed, "sync")]["steps"], task))
            r["lag_async"].append(mean_lag(runs[(seed, "async")]["steps"], task))
    for r in rows.values():
        r["mcnemar_p"] = mcnemar_exact_p(r["gained"], r["lost"])
        r["seed_test"] = paired_mean_difference(r["diff"])
    return rows


def _fmt_p(p: float) -> str:
    return "n/a" if p != p else ("< 0.001" if p < 0.001 else f"{p:.3f}")


def _fmt_pts(x: float, sign: str = "+") -> str:
    return "n/a" if x != x else f"{x:{sign}.1f}"


def step_mean(steps: list[dict], key: str) -> float:
    """Mean over the steps that logged ``key`` (NaN when none did)."""
    xs = [s[key] for s in steps if key in s]
    return sum(xs) / len(xs) if xs else float("nan")


def print_report(meta: dict, runs: dict[tuple[float, int | None, str], dict]) -> None:
    print(f"\ncommand: {meta['command']}")
    print(f"config: {meta['config']} ({meta['cpus']} CPUs); async: max_staleness={meta['staleness']}, "
          f"{' '.join(meta['async'][4:])}\n")
    print("| tool latency | seed | mode | wall s | s/step | async/sync | final held-out accuracy per task | "
          "staleness max |")
    print("|---|---|---|---|---|---|---|---|")
    for (lat, seed, mode), r in sorted(runs.items(), key=lambda kv: (kv[0][0], str(kv[0][1]), kv[0][2] != "sync")):
        n = max(1, len(r["steps"]))
        accs = ", ".join(f"{t} {a:.1%}" for t, a in _accs(r["points"][-1]).items())
        stale = max((s.get("train/staleness_max", 0.0) for s in r["steps"]), default=0.0)
        sync = runs.get((lat, seed, "sync"))
        ratio = f"{r['wall_s'] / sync['wall_s']:.2f}" if mode == "async" and sync else ""
        print(f"| {lat:g} s | {seed} | {mode} | {r['wall_s']:.1f} | {r['wall_s'] / n:.2f} | {ratio} | {accs} | {stale:g} |")
    for lat in sorted({k[0] for k in runs}):
        rows = compare_tasks({(s, m): v for (la, s, m), v in runs.items() if la == lat})
        if not rows:
            continue
        print(f"\ntool latency {lat:g} s, async - sync per task (points; seeds {next(iter(rows.values()))['seeds']}):\n")
        print("| task | sync mean | async mean | per-seed diff | mean diff | sd | 95% interval | t-test p | "
              "(seed, problem) pairs | gained / lost | McNemar p | lag sync | lag async |")
        print("|---|---:|---:|---|---:|---:|---|---:|---:|---|---:|---:|---:|")
        for task, r in rows.items():
            t = r["seed_test"]
            n = len(r["diff"])
            print(f"| {task} | {sum(r['sync']) / n:.1f} | {sum(r['async']) / n:.1f} | "
                  f"{', '.join(f'{d:+.1f}' for d in r['diff'])} | {t['mean']:+.1f} | {_fmt_pts(t['sd'], '')} | "
                  f"[{_fmt_pts(t['ci_low'])}, {_fmt_pts(t['ci_high'])}] | {_fmt_p(t['p'])} | {r['pairs']} | "
                  f"{r['gained']} / {r['lost']} | {_fmt_p(r['mcnemar_p'])} | {sum(r['lag_sync']) / n:.2f} | "
                  f"{sum(r['lag_async']) / n:.2f} |")
        # The importance correction of the async side: a weight near 1 and nothing truncated means it
        # barely changed the loss (the stale samples' weights were close to the trained ones).
        for (la, seed, mode), r in sorted(runs.items(), key=lambda kv: str(kv[0][1])):
            if la == lat and mode == "async":
                print(f"async seed {seed}: mean staleness {step_mean(r['steps'], 'train/staleness_mean'):.2f}, "
                      f"importance weight exp(prev - gen) {step_mean(r['steps'], 'train/sampling_importance_ratio'):.4f}, "
                      f"truncated {step_mean(r['steps'], 'train/is_truncated_fraction'):.2%} of tokens, "
                      f"|gen - prev| factor {step_mean(r['steps'], 'train/token_mult_prob_error'):.4f}")


def _plot(runs: dict, latencies: list[float], seed: int | None, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(latencies), figsize=(5.5 * len(latencies), 3.6), squeeze=False)
    for ax, lat in zip(axes[0], latencies):
        for mode, style in (("sync", "-"), ("async", "--")):  # a colour per task, a line style per mode
            pts = runs[(lat, seed, mode)]["points"]
            for k, task in enumerate(_accs(pts[-1])):
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
