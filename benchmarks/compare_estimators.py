"""Advantage estimators side by side on one base model and one piece of work: held-out accuracy
against training time and against samples.

    uv run benchmarks/compare_estimators.py [--steps 100] [--seconds 240] [--val-samples 200]
        [--val-period 5] [--prompts 32] [--generations 4] [--only grpo,rloo] [--json PATH] [--png PATH]
        [--keep DIR] [--verbose] [key=value overrides for every variant ...]

    # all six, at most ~28 min on 2 cores (each variant: ~20 s setup + at most 240 s of loop + ~15 s)
    uv run benchmarks/compare_estimators.py --json results/compare_estimators.json --png results/compare_estimators.png
    # a smoke run (~2 min)
    uv run benchmarks/compare_estimators.py --steps 2 --val-samples 16 --only grpo,gae --prompts 8 \
        policy.train_global_batch_size=32 policy.train_micro_batch_size=32 critic.warmup_steps=1

Variants (``--only`` picks some, by these names):

    grpo          grpo.advantage_estimator=grpo (leave-one-out mean, divided by the group std)
    dr_grpo       grpo.advantage_estimator=dr_grpo (reward minus the group mean, no std)
    rloo          grpo.advantage_estimator=rloo (minus the mean of the group's other members)
    reinforce_pp  grpo.advantage_estimator=reinforce_pp (group-centred, whitened over the batch)
    remax         grpo.advantage_estimator=remax (minus the reward of one greedy sample per prompt)
    gae           PPO: examples/configs/ppo_math_tiny.yaml as it is (a critic on its own worker,
                  GAE, KL penalty in the reward, critic warm-up), with the same batch as the others

The first five start from examples/configs/grpo_math_tiny.yaml (the embedded default: its
bootstrapped base model, cached under ~/.cache/nemo_like, and its 2-digit addition). Every variant
gets the same prompts in the same order (same seed, same sampler), the same prompts x samples per
step (default 32 x 4 = 128; dynamic sampling off everywhere, so no variant draws extra prompts), the
same held-out problems (the first --val-samples of the validation set) and the same stopping rule:
--steps GRPO steps or --seconds of its training loop (``grpo.max_duration_s``: no step starts after
it is spent; the loop's time includes its validations), whichever comes first. Validation (greedy)
at the start, every --val-period steps and at the end. ReMax also generates one greedy sample per
prompt per step (not counted as a sample); PPO-GAE's first ``critic.warmup_steps`` steps train only
the critic. The lr schedule (linear decay over ``--steps``) is the same per step for all. Overrides
apply to every variant, except ``critic.*`` and ``cluster.critic.*``, which only PPO-GAE has.

Each variant runs in its own subprocess (this file with a hidden ``--_child`` flag), one after the
other, so one that crashes leaves the others running, and each starts its own Ray. Its metrics are
read from its logger's metrics.jsonl (logger.log_dir in the work folder; ``--keep DIR`` keeps it).

Time on the x-axis is training time: the sum of the steps' ``timing/total`` (generation, reward,
log-probs, critic, update; validation and logging left out). "acc @ equal time" is each variant's
validation nearest to the shortest variant's total training time; "acc @ equal samples" is its
validation nearest to the smallest step count any variant reached (samples per step are equal).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
GRPO_CONFIG = ROOT / "examples" / "configs" / "grpo_math_tiny.yaml"
PPO_CONFIG = ROOT / "examples" / "configs" / "ppo_math_tiny.yaml"

# name -> (label in the table, config file, the variant's own overrides)
VARIANTS: dict[str, tuple[str, Path, list[str]]] = {
    "grpo": ("GRPO", GRPO_CONFIG, ["grpo.advantage_estimator=grpo"]),
    "dr_grpo": ("Dr.GRPO", GRPO_CONFIG, ["grpo.advantage_estimator=dr_grpo"]),
    "rloo": ("RLOO", GRPO_CONFIG, ["grpo.advantage_estimator=rloo"]),
    "reinforce_pp": ("REINFORCE++", GRPO_CONFIG, ["grpo.advantage_estimator=reinforce_pp"]),
    "remax": ("ReMax", GRPO_CONFIG, ["grpo.advantage_estimator=remax"]),
    "gae": ("PPO-GAE", PPO_CONFIG, ["grpo.advantage_estimator=gae"]),
}
CRITIC_ONLY = ("critic.", "cluster.critic.")  # override prefixes only the critic's variant may take


def variant_overrides(name: str, *, steps: int, seconds: float | None, val_samples: int, val_period: int,
                      prompts: int, generations: int, work: Path, user: list[str]) -> list[str]:
    """The overrides of one variant: the shared batch, stopping rule and validation, a log folder of
    its own, no checkpoints, then its estimator, then the user's (the critic's only for ``gae``)."""
    d = work / name
    out = [f"grpo.num_prompts_per_step={prompts}", f"grpo.num_generations_per_prompt={generations}",
           "grpo.dynamic_sampling.enabled=false", f"grpo.max_num_steps={steps}", f"grpo.val_period={val_period}",
           "grpo.val_at_start=true", "grpo.val_at_end=true", f"grpo.max_val_samples={val_samples}",
           "checkpointing.enabled=false", f"checkpointing.checkpoint_dir={d / 'ckpt'}",
           f"logger.log_dir={d / 'logs'}", "logger.stdout_enabled=false", "logger.jsonl_enabled=true",
           "logger.tensorboard_enabled=false", "logger.wandb_enabled=false"]
    if seconds is not None:
        out.append(f"grpo.max_duration_s={seconds}")
    out += VARIANTS[name][2]
    out += [o for o in user if name == "gae" or not o.lstrip("+").startswith(CRITIC_ONLY)]
    return out


# ================================================================================================
# reading a run back (pure)
# ================================================================================================
def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The rows of a metrics.jsonl; a last line cut off by a crash is skipped."""
    rows = []
    if not path.exists():
        return rows
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def build_curve(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """One run's record from its metrics rows: per step the seconds (``timing/total``) and samples,
    and every validation with the training time and samples spent before it."""
    steps, step_s, samples, train_s, cum_samples = [], [], [], [], []
    val: list[dict[str, Any]] = []
    t = n = 0.0
    vf = None
    for r in rows:
        if r.get("timing/total") is not None:  # a training step (may also carry a validation)
            t += r["timing/total"]
            n += r.get("train/num_samples") or 0.0
            steps.append(int(r["step"]))
            step_s.append(r["timing/total"])
            samples.append(r.get("train/num_samples") or 0.0)
            train_s.append(t)
            cum_samples.append(n)
            if r.get("critic/vf_explained_var") is not None:
                vf = r["critic/vf_explained_var"]
        if r.get("val/accuracy") is not None:
            point = {"step": int(r["step"]), "train_s": t, "samples": n, "accuracy": r["val/accuracy"],
                     "val_s": r.get("timing/validation")}
            if val and val[-1]["step"] == point["step"]:
                val[-1] = point  # validated twice at one step: the later one counts
            else:
                val.append(point)
    return {"steps": steps, "step_s": step_s, "samples": samples, "train_s": train_s, "cum_samples": cum_samples,
            "val": val, "last_vf_explained_var": vf}


def nearest(points: list[dict[str, Any]], key: str, target: float) -> dict[str, Any] | None:
    """The point whose ``key`` is nearest ``target`` (the earlier one on a tie)."""
    best = None
    for p in points:
        if best is None or abs(p[key] - target) < abs(best[key] - target):
            best = p
    return best


def summarize(curves: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Per variant: accuracy at start and end, at the common time mark and the common step, mean
    s/step without step 1, steps done; and the two marks."""
    ran = {k: c for k, c in curves.items() if c["steps"]}
    time_mark = min((c["train_s"][-1] for c in ran.values()), default=None)
    step_mark = min((c["steps"][-1] for c in ran.values()), default=None)
    out: dict[str, Any] = {"time_mark_s": time_mark, "step_mark": step_mark, "variants": {}}
    for k, c in curves.items():
        v = c["val"]
        later = c["step_s"][1:]
        at_t = nearest(v, "train_s", time_mark) if time_mark is not None and c["steps"] else None
        at_s = nearest(v, "step", step_mark) if step_mark is not None and c["steps"] else None
        out["variants"][k] = {
            "acc_start": v[0]["accuracy"] if v and v[0]["step"] == 0 else None,
            "acc_end": v[-1]["accuracy"] if v and v[-1]["step"] > 0 else None,
            "end_step": v[-1]["step"] if v else None,
            "acc_at_time": at_t and at_t["accuracy"], "acc_at_time_s": at_t and at_t["train_s"],
            "acc_at_step": at_s and at_s["accuracy"], "acc_at_step_step": at_s and at_s["step"],
            "s_per_step_mean": statistics.mean(later) if later else None,
            "s_per_step_median": statistics.median(later) if later else None,
            "first_step_s": c["step_s"][0] if c["step_s"] else None,
            "steps_done": len(c["steps"]), "train_s": c["train_s"][-1] if c["train_s"] else 0.0,
            "samples": c["cum_samples"][-1] if c["cum_samples"] else 0.0,
            "last_vf_explained_var": c["last_vf_explained_var"],
        }
    return out


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.1%}"


def format_table(summary: dict[str, Any], labels: dict[str, str], status: dict[str, str]) -> str:
    """The printed table: one row per variant."""
    tm, sm = summary["time_mark_s"], summary["step_mark"]
    header = ["estimator", "acc start", "acc end", f"acc @ {tm:.0f} s" if tm is not None else "acc @ time",
              f"acc @ step {sm}" if sm is not None else "acc @ step", "s/step", "steps", "train s", "stopped",
              "vf expl. var"]
    rows = []
    for k, s in summary["variants"].items():
        at_t = _pct(s["acc_at_time"])
        if s["acc_at_time"] is not None and tm is not None and f"{s['acc_at_time_s']:.0f}" != f"{tm:.0f}":
            at_t += f" ({s['acc_at_time_s']:.0f} s)"
        at_s = _pct(s["acc_at_step"])
        if s["acc_at_step"] is not None and s["acc_at_step_step"] != sm:
            at_s += f" (step {s['acc_at_step_step']})"
        vf = s["last_vf_explained_var"]
        rows.append([labels.get(k, k), _pct(s["acc_start"]), _pct(s["acc_end"]), at_t, at_s,
                     "-" if s["s_per_step_mean"] is None else f"{s['s_per_step_mean']:.2f}",
                     str(s["steps_done"]), f"{s['train_s']:.0f}", status.get(k, "-"),
                     "-" if vf is None else f"{vf:.3f}"])
    widths = [max(len(r[i]) for r in rows + [header]) for i in range(len(header))]

    def line(r: list[str]) -> str:
        return "  ".join(c.ljust(w) if i in (0, 8) else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip()

    return "\n".join([line(header), "  ".join("-" * w for w in widths)] + [line(r) for r in rows])


def plot(curves: dict[str, dict[str, Any]], labels: dict[str, str], path: str, title: str,
         marks: tuple[float | None, float | None] = (None, None)) -> None:
    """Held-out accuracy against training seconds (left) and against samples (right); ``marks``: the
    common time and sample count of the table, drawn as dotted lines."""
    import textwrap

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for i, (k, c) in enumerate(curves.items()):
        if not c["val"]:
            continue
        ys = [p["accuracy"] for p in c["val"]]
        for ax, key in zip(axes, ("train_s", "samples")):
            ax.plot([p[key] for p in c["val"]], ys, marker="o", ms=3, color=f"C{i}", label=labels.get(k, k))
    axes[0].set_xlabel("training seconds (sum of timing/total; validation excluded)")
    axes[1].set_xlabel("training samples")
    for ax in axes:
        ax.set_ylabel("held-out greedy accuracy")
        ax.grid(alpha=0.3)
    for ax, m in zip(axes, marks):
        if m is not None:
            ax.axvline(m, color="grey", ls=":", lw=1)
    axes[1].legend(fontsize=8)
    fig.suptitle("\n".join(textwrap.wrap(title, 150)), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ================================================================================================
# one variant (child process)
# ================================================================================================
def run_child(name: str, work: Path) -> int:
    from nemo_like.algorithms.grpo import grpo_train
    from nemo_like.algorithms.grpo_run import setup
    from nemo_like.config import load_config

    spec = json.loads((work / "spec.json").read_text())
    cfg = load_config(spec["config"], spec["overrides"])
    t0 = time.perf_counter()
    trainer = setup(cfg, resume=False)
    setup_s = time.perf_counter() - t0
    try:
        t1 = time.perf_counter()
        results = grpo_train(trainer)
        loop_s = time.perf_counter() - t1
        if trainer.stop_reason:
            why = f"collapse: {trainer.stop_reason}"
        elif trainer.step_count >= cfg.grpo.max_num_steps:
            why = "steps"
        else:
            why = "seconds"
    finally:
        trainer.close()
    (work / "child.json").write_text(json.dumps({"name": name, "setup_s": setup_s, "loop_s": loop_s,
                                                 "steps": len(results), "stopped": why,
                                                 "model": str(cfg.policy.model_name)}))
    return 0


# ================================================================================================
# orchestrator
# ================================================================================================
def _run_variant(name: str, vdir: Path, verbose: bool) -> tuple[int, float]:
    log = vdir / "child.log"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--_child", name, "--_work", str(vdir)]
    t0 = time.perf_counter()
    fh = None if verbose else open(log, "w")  # noqa: SIM115 (open for the child's lifetime)
    proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT if fh else None, cwd=ROOT)
    try:
        rc = proc.wait()
    except BaseException:  # interrupted here: SIGTERM lets the child shut its Ray down
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        raise
    finally:
        if fh:
            fh.close()
    if rc != 0 and log.exists():
        tail = log.read_text(errors="replace").splitlines()[-25:]
        print("\n".join(f"  | {line}" for line in tail), file=sys.stderr)
    return rc, time.perf_counter() - t0


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 usage="compare_estimators.py [options] [key=value overrides for every variant]")
    ap.add_argument("--steps", type=int, default=100, help="GRPO steps per variant at most (default 100)")
    ap.add_argument("--seconds", type=float, default=240.0,
                    help="training-loop seconds per variant at most (grpo.max_duration_s; default 240; 0: none)")
    ap.add_argument("--val-samples", type=int, default=200, help="held-out problems (default 200)")
    ap.add_argument("--val-period", type=int, default=5, help="validate every this many steps (default 5)")
    ap.add_argument("--prompts", type=int, default=32, help="prompts per step (default 32)")
    ap.add_argument("--generations", type=int, default=4, help="samples per prompt (default 4)")
    ap.add_argument("--only", default=None, help=f"comma-separated subset of {','.join(VARIANTS)}")
    ap.add_argument("--json", default=None, help="write every number to this JSON file")
    ap.add_argument("--png", default=None, help="draw the accuracy curves (against time and samples) here")
    ap.add_argument("--keep", default=None, help="keep the work folder (configs, logs, metrics.jsonl) here")
    ap.add_argument("--verbose", action="store_true", help="show the children's output instead of logging it")
    ap.add_argument("--_child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--_work", default=None, help=argparse.SUPPRESS)
    args, user = ap.parse_known_args(argv)
    if args._child:
        return run_child(args._child, Path(args._work))

    bad = [a for a in user if "=" not in a]
    if bad:
        ap.error(f"unexpected arguments {bad}: options are listed by --help, overrides are key=value")
    names = list(VARIANTS) if not args.only else [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown or not names:
        ap.error(f"--only: unknown variant(s) {unknown}; choose from {','.join(VARIANTS)}")
    if args.steps < 1 or args.val_samples < 1 or args.val_period < 0 or args.prompts < 1 or args.generations < 2:
        ap.error("--steps, --val-samples and --prompts must be >= 1, --val-period >= 0, --generations >= 2")
    seconds = args.seconds if args.seconds and args.seconds > 0 else None

    from nemo_like.config import ConfigError, load_config

    work = Path(args.keep).resolve() if args.keep else Path(tempfile.mkdtemp(prefix="compare_estimators_"))
    work.mkdir(parents=True, exist_ok=True)
    specs: dict[str, dict[str, Any]] = {}
    try:  # every variant's config is checked before the first child starts
        for n in names:
            ov = variant_overrides(n, steps=args.steps, seconds=seconds, val_samples=args.val_samples,
                                   val_period=args.val_period, prompts=args.prompts, generations=args.generations,
                                   work=work, user=user)
            load_config(VARIANTS[n][1], ov)
            specs[n] = {"config": str(VARIANTS[n][1]), "overrides": ov}
    except ConfigError as e:
        print(f"compare_estimators: variant {n}: {e}", file=sys.stderr)
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
        return 2

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # `kill` unwinds like Ctrl-C
    labels = {n: VARIANTS[n][0] for n in names}
    curves: dict[str, dict[str, Any]] = {}
    status: dict[str, str] = {}
    runs: dict[str, dict[str, Any]] = {}
    wall0 = time.perf_counter()
    try:
        for i, n in enumerate(names):
            vdir = work / n
            for stale in ("logs", "child.json", "child.log"):  # a kept folder reused: nothing old is read
                p = vdir / stale
                shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
            vdir.mkdir(parents=True, exist_ok=True)
            (vdir / "spec.json").write_text(json.dumps(specs[n], indent=1))
            load0 = os.getloadavg()[0]
            print(f"[compare_estimators] {i + 1}/{len(names)} {labels[n]}: running (load average {load0:.1f}; "
                  f"log {vdir / 'child.log'})", flush=True)
            rc, wall = _run_variant(n, vdir, args.verbose)
            child = json.loads((vdir / "child.json").read_text()) if (vdir / "child.json").exists() else {}
            curves[n] = build_curve(read_metrics(vdir / "logs" / "metrics.jsonl"))
            status[n] = child.get("stopped", "-") if rc == 0 else f"failed ({rc})"
            runs[n] = {"rc": rc, "wall_s": wall, "load_avg_start": load0, "load_avg_end": os.getloadavg()[0],
                       **child, **specs[n]}
            last = curves[n]["val"][-1]["accuracy"] if curves[n]["val"] else None
            setup = f" (setup {child['setup_s']:.0f} s)" if "setup_s" in child else ""
            print(f"[compare_estimators] {labels[n]}: {status[n]} after {len(curves[n]['steps'])} steps, "
                  f"{wall:.0f} s in all{setup}; last held-out accuracy {_pct(last)}; load average now "
                  f"{os.getloadavg()[0]:.1f}", flush=True)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)

    summary = summarize(curves)
    s = specs[names[0]]["overrides"]
    print(f"\n=== {len(names)} estimators, {args.prompts} prompts x {args.generations} samples per step, at most "
          f"{args.steps} steps or {f'{seconds:g}' if seconds else 'unlimited'} s of training loop each; "
          f"{args.val_samples} held-out problems, greedy; {os.cpu_count()} CPUs ===")
    if user:
        print(f"overrides: {' '.join(user)}")
    print(format_table(summary, labels, status))
    tm, sm = summary["time_mark_s"], summary["step_mark"]
    if tm is not None:
        print(f"\nacc @ {tm:.0f} s: the validation nearest the shortest variant's training time (in brackets where "
              f"it is not at that mark);\nacc @ step {sm}: the validation nearest the smallest step count reached "
              f"(x {args.prompts * args.generations} samples).\ns/step: mean timing/total without step 1; train s: "
              "the sum of timing/total (validation excluded); vf expl. var: the critic's last.")
    total = time.perf_counter() - wall0
    print(f"total wall time {total:.0f} s (" + ", ".join(f"{n} {r['wall_s']:.0f} s" for n, r in runs.items()) + ")")
    if args.png:
        plot(curves, labels, args.png, f"{args.prompts}x{args.generations} samples/step, {args.val_samples} "
             f"held-out problems, {os.cpu_count()} CPUs" + (f"; {' '.join(user)}" if user else ""),
             marks=(tm, sm * args.prompts * args.generations if sm is not None else None))
        print(f"[compare_estimators] wrote {args.png}")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "command": "uv run benchmarks/compare_estimators.py " + " ".join(argv),
            "settings": {"steps": args.steps, "seconds": seconds, "val_samples": args.val_samples,
                         "val_period": args.val_period, "prompts": args.prompts, "generations": args.generations,
                         "user_overrides": user, "cpus": os.cpu_count(), "first_variant_overrides": s},
            "summary": summary, "runs": runs, "curves": curves, "total_s": total}, indent=1))
        print(f"[compare_estimators] wrote {args.json}")
    return 0 if all(r["rc"] == 0 for r in runs.values()) else 1


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main(sys.argv[1:]))
