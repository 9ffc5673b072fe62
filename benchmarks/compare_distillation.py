"""On-policy distillation against GRPO from the same student: held-out accuracy against training time.

    uv run benchmarks/compare_distillation.py [--work tiny|smollm2|all] [--distill-steps N] [--val-period N]
        [--val-samples N] [--teacher-cache DIR] [--distill KEY=VALUE ...] [--json PATH] [--keep DIR]
        [key=value overrides for both arms ...]

    uv run benchmarks/compare_distillation.py --work tiny --json results/compare_distillation.json

Per work, two arms from the same student (the recipe's base model), each in its own subprocess:

1. **GRPO**: the recipe as it is (tiny: examples/configs/grpo_math_tiny.yaml, 250 steps; smollm2:
   examples/configs/grpo_smollm2_cpu.yaml, 80 steps), validated every ``--val-period`` steps. Its
   trained model is the **teacher** (exported to ``--teacher-cache``, reused by a later run with the
   same recipe and overrides: the GRPO arm's curve is then read from the cache too), and its final
   held-out accuracy is the teacher's accuracy.
2. **Distillation**: the same recipe and student with ``teacher.model_name`` that model (the top-k
   objective as examples/configs/distill_math_tiny.yaml has it: the forward KL over the teacher's 16
   most likely tokens and the rest as one bucket; the batches of ``DISTILL_ARM``: fewer samples a
   prompt than GRPO's group; ``--distill teacher.objective=reverse_kl`` for the
   per-token reverse KL; ``teacher.reward_weight=0``: the rewards are graded and logged, never trained on),
   validated as often (SmolLM2: every 5 steps), stopped once it is within 2 points of the teacher or after ``--distill-steps``.

Time is training time: the sum of the steps' ``timing/total`` (generation, grading, log-probs, the
teacher's pass, the update; validation left out), as benchmarks/compare_estimators.py counts it.
"Steps / s to teacher - 2" are those of the first validation at or above the teacher's accuracy minus
2 points. The target: distillation gets there in at most a third of GRPO's time.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
WORKS = {"tiny": ROOT / "examples" / "configs" / "grpo_math_tiny.yaml",
         "smollm2": ROOT / "examples" / "configs" / "grpo_smollm2_cpu.yaml"}
MARGIN = 0.02
# The distillation arm's batches, the fastest measured (docs/performance.md). The teacher's signal needs
# no group of samples to compare: on the tiny work one sample a prompt and a global batch of distinct
# prompts a step; SmolLM2's prompts are long against its completions, so two samples share each one's
# computation (packing computes a shared prompt once), with half the recipe's batch and a larger step.
DISTILL_ARM = {"tiny": ["grpo.num_prompts_per_step=128", "grpo.num_generations_per_prompt=1"],
               "smollm2": ["grpo.num_prompts_per_step=16", "grpo.num_generations_per_prompt=2",
                           "policy.train_global_batch_size=32", "policy.optimizer.lr=3e-5", "grpo.val_period=5"]}


def read_curve(metrics: Path) -> dict[str, Any]:
    """Validations ({step, train_s, accuracy}) and training steps from a run's metrics.jsonl; train_s
    is the training time spent before that validation."""
    t, vals, steps = 0.0, [], 0
    for line in metrics.read_text().splitlines():
        try:
            r = json.loads(line)
        except json.JSONDecodeError:
            continue
        if r.get("timing/total") is not None:
            t += r["timing/total"]
            steps = int(r["step"])
        if r.get("val/accuracy") is not None:
            p = {"step": int(r["step"]), "train_s": t, "accuracy": float(r["val/accuracy"])}
            vals = vals[:-1] if vals and vals[-1]["step"] == p["step"] else vals
            vals.append(p)
    return {"val": vals, "steps": steps, "train_s": t}


def first_reaching(curve: dict[str, Any], target: float) -> dict[str, Any] | None:
    return next((p for p in curve["val"] if p["accuracy"] >= target - 1e-9), None)


# ---- the child: one arm ----------------------------------------------------------------------------
def run_child(spec_path: Path) -> int:
    from nemo_like.algorithms.grpo_run import setup
    from nemo_like.config import load_config

    spec = json.loads(spec_path.read_text())
    trainer = setup(load_config(spec["config"], spec["overrides"]), resume=False)
    try:
        trainer.validate(log=True)
        target = spec.get("stop_at")
        while trainer.step_count < trainer.config.grpo.max_num_steps:
            m = trainer.step()
            if target is not None and m.get("val/accuracy", -1.0) >= target - 1e-9:
                break
        if trainer.last_val_step != trainer.step_count:
            trainer.validate(log=True)
        if spec.get("export"):
            trainer.policy.export_merged(spec["export"])
    finally:
        trainer.close()
    return 0


def _arm(name: str, config: Path, overrides: list[str], work: Path, *, stop_at: float | None = None,
         export: str | None = None) -> dict[str, Any]:
    d = work / name
    d.mkdir(parents=True, exist_ok=True)
    overrides = overrides + [f"logger.log_dir={d / 'logs'}", "logger.tensorboard_enabled=false",
                             "checkpointing.enabled=false"]
    (d / "spec.json").write_text(json.dumps({"config": str(config), "overrides": overrides, "stop_at": stop_at,
                                             "export": export}))
    t0 = time.perf_counter()
    with open(d / "child.log", "w") as log:
        rc = subprocess.run([sys.executable, __file__, "--_child", str(d / "spec.json")], stdout=log,
                            stderr=subprocess.STDOUT, cwd=ROOT).returncode
    if rc:
        print("\n".join("  | " + x for x in (d / "child.log").read_text().splitlines()[-25:]), file=sys.stderr)
        raise SystemExit(f"{name}: the run failed (rc {rc}); its log: {d / 'child.log'}")
    return read_curve(d / "logs" / "metrics.jsonl") | {"wall_s": time.perf_counter() - t0}


def run_work(work_name: str, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    config = WORKS[work_name]
    common = [f"grpo.val_period={args.val_period}", f"grpo.max_val_samples={args.val_samples}", *args.overrides]
    key = hashlib.sha256(json.dumps([str(config), common]).encode()).hexdigest()[:12]
    cached = Path(args.teacher_cache) / f"{work_name}-{key}"
    if (cached / "teacher" / "config.json").is_file():
        print(f"[{work_name}] GRPO arm and teacher from {cached}")
        grpo = json.loads((cached / "grpo_curve.json").read_text())
    else:
        print(f"[{work_name}] GRPO from the student (its final model becomes the teacher) ...", flush=True)
        grpo = _arm(f"{work_name}-grpo", config, common, work, export=str(cached / "teacher"))
        (cached / "grpo_curve.json").write_text(json.dumps(grpo))
    teacher_acc = grpo["val"][-1]["accuracy"]
    target = teacher_acc - MARGIN
    print(f"[{work_name}] teacher {teacher_acc:.1%}; distilling into the student until {target:.1%} ...", flush=True)
    distill = _arm(f"{work_name}-distill", config, common + [
        f"teacher.model_name={cached / 'teacher'}", f"grpo.max_num_steps={args.distill_steps}",
        "grpo.dynamic_sampling.enabled=false",  # (refused with reward_weight 0: it drops groups that carry signal)
        # The teacher computes while the policy's workers wait: the same cores, one more Ray slot each.
        "cluster.num_cpus=4", "cluster.teacher.cpus_per_worker=2", "teacher.objective=topk", "teacher.topk_k=16",
        *DISTILL_ARM[work_name], *args.distill], work, stop_at=target)
    out = {"teacher_accuracy": teacher_acc, "target": target, "methods": {}}
    for name, c in (("grpo", grpo), ("distillation", distill)):
        hit = first_reaching(c, target)
        out["methods"][name] = {"start_accuracy": c["val"][0]["accuracy"], "final_accuracy": c["val"][-1]["accuracy"],
                                "steps": c["steps"], "train_s": c["train_s"],
                                "steps_to_target": hit and hit["step"], "seconds_to_target": hit and hit["train_s"]}
    g, d = out["methods"]["grpo"]["seconds_to_target"], out["methods"]["distillation"]["seconds_to_target"]
    out["time_ratio"] = d / g if g and d is not None else None
    return out


def format_table(results: dict[str, Any]) -> str:
    lines = ["| work | method | start | final | teacher | steps to teacher - 2 | s to teacher - 2 | steps run |",
             "|---|---|---|---|---|---|---|---|"]
    for work, r in results.items():
        for name, m in r["methods"].items():
            s = m["seconds_to_target"]
            lines.append(f"| {work} | {name} | {m['start_accuracy']:.1%} | {m['final_accuracy']:.1%} | "
                         f"{r['teacher_accuracy']:.1%} | {m['steps_to_target'] if s is not None else 'not reached'} | "
                         f"{f'{s:.0f}' if s is not None else '-'} | {m['steps']} |")
    ratios = [f"{w}: {r['time_ratio']:.2f}x" for w, r in results.items() if r["time_ratio"] is not None]
    return "\n".join(lines) + ("\n\ndistillation's time to teacher - 2 / GRPO's: " + ", ".join(ratios) if ratios else "")


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", choices=[*WORKS, "all"], default="tiny")
    ap.add_argument("--distill-steps", type=int, default=250, help="distillation steps at most (default 250)")
    ap.add_argument("--val-period", type=int, default=10, help="validate every this many steps (default 10)")
    ap.add_argument("--val-samples", type=int, default=500, help="held-out problems (default 500)")
    ap.add_argument("--teacher-cache", default=str(Path.home() / ".cache" / "nemo_like" / "distill_teachers"))
    ap.add_argument("--distill", action="append", default=[], metavar="KEY=VALUE",
                    help="an override for the distillation arm only (repeatable), e.g. teacher.kl_coef=4")
    ap.add_argument("--json", default=None, help="write the table's numbers here")
    ap.add_argument("--keep", default=None, help="keep the arms' logs in this folder")
    ap.add_argument("--_child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("overrides", nargs="*", help="key=value for both arms")
    args = ap.parse_args(argv)
    if args._child:
        return run_child(Path(args._child))
    Path(args.teacher_cache).mkdir(parents=True, exist_ok=True)
    work = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="compare_distillation-"))
    results = {w: run_work(w, args, work) for w in (list(WORKS) if args.work == "all" else [args.work])}
    print(format_table(results))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
