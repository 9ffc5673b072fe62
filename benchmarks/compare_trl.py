"""This project against TRL's GRPOTrainer on the same GRPO work: seconds per step and held-out accuracy.

    uv run --with trl==1.16.0 benchmarks/compare_trl.py [--steps 60] [--config PATH] [--val-samples N]
        [--warmup 2] [--skip-trl] [--skip-project] [--sequential] [--json PATH] [--keep DIR] [--verbose]
        [key=value overrides for the project config ...]

Both sides read one project config (default: examples/configs/grpo_math_tiny.yaml, plus the
key=value overrides), so they train the same base model on the same prompts in the same order,
with the same group size, batch sizes, completion length, sampling temperature, learning-rate
schedule, clipping, loss normalisation and verifier. Every part runs in its own subprocess:
(1) prepare: resolve the model and render the prompts through the project's own dataset and
processor path; (2) this project (`GRPOExperiment`, validation at start and end) and (3) TRL's
`GRPOTrainer` (trl is a benchmark-only dependency: `uv run --with trl==...`); (4) one evaluator
grades the base model and both final models the same way (HF greedy `generate`, the project's
verifier) on the held-out problems.

(2) and (3) set up side by side, then take turns, one GRPO step each (the first mover swaps every
step): on a machine shared with other work the load then changes under both alike. `--sequential`
runs one whole side after the other instead.

A GRPO step = one generation of prompts x G completions + the optimizer steps over them. The
project's time is its own `timing/total` (and, for reference, the wall time of `exp.step()`); TRL's
is the wall time from its turn's start to the `on_step_end` of the GRPO step's last optimizer step
(generation, data loading and logging included). The first `--warmup` steps are left out of the
means and medians on both sides.
"""

from __future__ import annotations

import argparse
import json
import math
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
DEFAULT_CONFIG = ROOT / "examples" / "configs" / "grpo_math_tiny.yaml"
TRL_PIN = "1.16.0"
HOW_TO_RUN = f"uv run --with trl=={TRL_PIN} benchmarks/compare_trl.py [--steps 60] [key=value ...]"

from compare_trl_roles import _read, _summary, _trl_loss_type, _trl_scale_rewards, _write, trl_micro_batches  # noqa: E402


# ================================================================================================
# orchestrator
# ================================================================================================
def _grader_name(spec: dict) -> str:
    g = spec.get("grader", {"kind": "math"})
    if g["kind"] == "math":
        return "verify_math_answer"
    where = "last \\boxed{}" if g["answer_format"] == "boxed" else f"last <{g['answer_tag']}>"
    return f"reasoning-gym score_answer on the {where}{'' if g['partial_credit'] else ', exact answers only'}"


def _trl_available() -> str | None:
    try:
        import trl
    except (ImportError, RuntimeError, AttributeError):  # absent, or broken against this transformers
        return None
    return getattr(trl, "__version__", "?")


class _Child:
    """One role in its own subprocess; with ``lockstep`` it also gets a go pipe and a done pipe."""

    def __init__(self, role: str, work: Path, verbose: bool, lockstep: bool, env_extra: dict[str, str] | None = None):
        self.role, self.log = role, work / f"{role}.log"
        env = dict(os.environ) | (env_extra or {})
        cmd = [sys.executable, str(Path(__file__).resolve().with_name("compare_trl_roles.py")), "--_role", role,
               "--_work", str(work)]
        self.go_w = self.done_r = None
        child_fds: tuple[int, ...] = ()
        if lockstep:
            go_r, self.go_w = os.pipe()
            self.done_r, done_w = os.pipe()
            child_fds = (go_r, done_w)
            cmd += ["--_go", str(go_r), "--_done", str(done_w)]
        print(f"[compare_trl] {role}: started (load average {os.getloadavg()[0]:.1f}; log {self.log})", flush=True)
        self.t0 = time.perf_counter()
        self._fh = None if verbose else open(self.log, "w")  # noqa: SIM115 (open for the child's lifetime)
        self.proc = subprocess.Popen(cmd, stdout=self._fh, stderr=subprocess.STDOUT if self._fh else None,
                                     env=env, cwd=ROOT, pass_fds=child_fds)
        for fd in child_fds:  # the child's ends: closed here, so a child that dies reads as EOF
            os.close(fd)
        self.seconds = 0.0

    def expect(self, what: bytes) -> None:
        assert self.done_r is not None
        got = os.read(self.done_r, 1)
        if got != what:
            self.proc.wait()
            self.fail()

    def go(self) -> None:
        assert self.go_w is not None
        os.write(self.go_w, b"G")

    def close_pipes(self) -> None:
        for fd in (self.go_w, self.done_r):
            if fd is not None:
                try:
                    os.close(fd)
                except OSError:
                    pass
        self.go_w = self.done_r = None

    def wait(self) -> float:
        rc = self.proc.wait()
        self.close_pipes()
        if self._fh:
            self._fh.close()
        if rc != 0:
            self.fail()
        self.seconds = time.perf_counter() - self.t0
        print(f"[compare_trl] {self.role}: done in {self.seconds:.0f} s (load average now {os.getloadavg()[0]:.1f})",
              flush=True)
        return self.seconds

    def fail(self) -> None:
        if self.log.exists():
            tail = self.log.read_text(errors="replace").splitlines()[-40:]
            print("\n".join(f"  | {line}" for line in tail), file=sys.stderr)
        raise SystemExit(f"compare_trl: the {self.role} step failed (exit {self.proc.returncode}); log: {self.log}")

    def stop(self) -> None:
        """After a failure elsewhere: EOF on its go pipe lets the child shut down (Ray included) by
        itself; it is terminated only if it does not."""
        self.close_pipes()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.terminate()
            self.proc.wait()


def _run_sides(roles: list[str], work: Path, steps: int, verbose: bool, sequential: bool,
               env_for: dict[str, dict[str, str]]) -> dict[str, float]:
    """Run the training sides. Alternating (the default): both start, set up (untimed) and then take
    turns, one GRPO step each, the first mover swapping every step, so a change in the machine's
    load lands on both. Sequential: one whole side after the other."""
    out: dict[str, float] = {}
    if sequential or len(roles) == 1:
        for role in roles:
            child = _Child(role, work, verbose, lockstep=False, env_extra=env_for.get(role))
            try:
                out[role] = child.wait()
            except BaseException:
                if child.proc.poll() is None:  # interrupted here: SIGTERM lets it shut Ray down
                    child.proc.terminate()
                    child.proc.wait()
                raise
        return out
    children = [_Child(role, work, verbose, lockstep=True, env_extra=env_for.get(role)) for role in roles]
    try:
        for c in children:
            c.expect(b"R")
        print(f"[compare_trl] both sides are set up; alternating {steps} GRPO steps", flush=True)
        for j in range(steps):
            for c in (children if j % 2 == 0 else children[::-1]):
                c.go()
                c.expect(b"D")
            if (j + 1) % 10 == 0 or j + 1 == steps:
                print(f"[compare_trl] step {j + 1}/{steps} done on both sides "
                      f"(load average {os.getloadavg()[0]:.1f})", flush=True)
        for c in children:
            out[c.role] = c.wait()
    except BaseException:
        for c in children:
            if c.proc.poll() is None:
                c.stop()
        raise
    return out


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.1%}"


def _sec(x: float | None) -> str:
    return "-" if x is None or math.isnan(x) else f"{x:.3f}"


def _table(rows: list[list[str]], header: list[str], numeric: bool = True) -> str:
    """Plain-text columns: the first left-aligned, the others right-aligned (``numeric``) or left."""
    widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(len(header))]

    def line(r: list[str]) -> str:
        return "  ".join(str(c).ljust(w) if i == 0 or not numeric else str(c).rjust(w)
                         for i, (c, w) in enumerate(zip(r, widths))).rstrip()

    return "\n".join([line(header), "  ".join("-" * w for w in widths)] + [line(r) for r in rows])


def _settings_table(spec: dict, proj: dict | None, trl_res: dict | None) -> str:
    hp = spec["hp"]
    proj_nice = (proj or {}).get("worker_nice")
    per = hp["optimizer_steps_per_step"]
    s = hp["scheduler"]
    sched = (f"{s['decay']}: 1.0 -> {s['min_lr_ratio']}x over {s['total_steps']} opt. steps"
             + (f", warmup {s['warmup_steps']}" if s["warmup_steps"] else "") if s["decay"] != "constant"
             else "constant" + (f", warmup {s['warmup_steps']}" if s["warmup_steps"] else ""))
    trl_loss = _trl_loss_type(hp)
    adv = "(r - group mean) / (group std + 1e-6)"
    if hp["leave_one_out"]:
        adv = "leave-one-out: G/(G-1) x (r - group mean) / (group std + 1e-6)"
    if hp["std_scale"] != "group":
        adv = f"std_scale={hp['std_scale']}" + (", leave-one-out" if hp["leave_one_out"] else "")
    reuse = hp["reuse_generation_logprobs"]
    reuse_s = ("the sampler's (reused; recomputed every "
               f"{hp['logprob_check_period']} steps)" if reuse in (True, "auto") and hp["precision"] == "float32"
               else "recomputed by a forward pass")
    micro, accum = trl_micro_batches(hp)
    rows = [
        ["model", spec["model_path"], "same folder"],
        ["prompts per GRPO step", hp["num_prompts_per_step"], "same prompts, same order (shuffle_dataset=False)"],
        ["completions per prompt (G)", hp["num_generations"], f"num_generations={hp['num_generations']}"],
        ["completions per step", hp["completions_per_step"], f"generation_batch_size={hp['completions_per_step']}"],
        ["optimizer steps per GRPO step", f"{per} (train_global_batch_size={hp['train_global_batch_size']})",
         f"steps_per_generation={per * accum}, per_device_train_batch_size={micro}, grad_accum={accum}"],
        ["micro-batch (rows per forward)", hp["train_micro_batch_size"], micro],
        ["samples in each optimizer step", "contiguous whole groups", "random half of the generation (TRL shuffles)"],
        ["max new tokens", hp["max_new_tokens"], f"max_completion_length={hp['max_new_tokens']}"],
        ["prompt: max tokens / truncated", f"{hp['max_input_seq_length']} / {spec['prompts_truncated']}",
         "no limit / 0"],
        ["sampling", f"T={hp['temperature']}, top_p={hp['top_p']}, top_k={hp['top_k']}", "same"],
        ["stop at", f"eos id {spec['eos_token_id']} ({spec['eos_token']})",
         f"eos ids {trl_res['eos_token_ids']}" if trl_res else "-"],
        ["optimizer", f"AdamW lr={hp['lr']}, betas={tuple(hp['betas'])}, eps={hp['eps']}, wd={hp['weight_decay']}",
         f"same ({trl_res['optim'] if trl_res else 'AdamW'} passed via optimizers=)"],
        ["lr schedule", sched, "same function (LambdaLR of the project's lr_factor)"],
        ["max grad norm", hp["max_grad_norm"], hp["max_grad_norm"] or 0.0],
        ["KL to reference (beta)", hp["kl"], hp["kl"]],
        ["ratio clip", f"[1-{hp['clip_low']}, 1+{hp['clip_high']}]"
         + (f", dual clip c={hp['dual_clip_c']}" if hp["dual_clip_c"] else ""),
         f"epsilon={hp['clip_low']}, epsilon_high={hp['clip_high']}"],
        ["loss normalisation", "token mean over the global batch" if hp["token_level_loss"] else "per-sample mean",
         f"loss_type='{trl_loss}'" + (" (tokens of the generation / steps_per_generation)" if trl_loss == "dapo" else "")],
        ["advantage", adv, f"scale_rewards='{_trl_scale_rewards(hp)}': (r - group mean) / (group std + 1e-4)"],
        ["old-policy log-probs", reuse_s, "recomputed by a forward pass over the generation"],
        ["overlong filtering", hp["overlong_filtering"], f"mask_truncated_completions={hp['overlong_filtering']}"],
        ["precision", hp["precision"] + ("" if hp["precision"] == "float32" else " compute, float32 master weights"),
         "bf16=False, fp16=False" if hp["precision"] == "float32" else f"{hp['precision']} autocast (Accelerate)"],
        ["device", "GPU" if hp.get("gpus_per_worker") else "CPU",
         "GPU" if hp.get("gpus_per_worker") else "CPU (use_cpu=True)"],
        ["CPU threads (training)", f"{hp['num_workers']} worker(s) x {spec['threads'] // hp['num_workers']}",
         f"1 process x {trl_res['threads_in_training'] if trl_res else spec['threads']}"],
        ["CPU priority (nice) of the compute", f"{proj_nice} (Ray policy worker)" if proj_nice is not None else "-",
         f"{trl_res['nice']} (set to match)" if trl_res else "-"],
        ["reward", f"{_grader_name(spec)} env actor", "the same rule as a reward function"],
        ["seed", hp["seed"], hp["seed"]],
    ]
    if trl_res is not None:
        same = len(spec["train"]) - trl_res["prompt_ids_differ"]
        rows.append(["prompt token ids == project's", "-", f"{same}/{len(spec['train'])}"])
    return _table([[str(c) for c in r] for r in rows], ["setting", "project", f"TRL {TRL_PIN}"], numeric=False)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 usage="compare_trl.py [options] [key=value overrides for the project config]")
    ap.add_argument("--steps", type=int, default=60, help="GRPO steps on each side (default 60)")
    ap.add_argument("--config", default=str(DEFAULT_CONFIG), help="project config (default: grpo_math_tiny.yaml)")
    ap.add_argument("--val-samples", type=int, default=None, help="held-out problems (default: the config's)")
    ap.add_argument("--warmup", type=int, default=2, help="first steps left out of the timing (default 2)")
    ap.add_argument("--skip-trl", action="store_true")
    ap.add_argument("--skip-project", action="store_true")
    ap.add_argument("--json", default=None, help="also write every number to this JSON file")
    ap.add_argument("--keep", default=None, help="keep the work folder (logs, final models) here")
    ap.add_argument("--trl-nice", type=int, default=None,
                    help="niceness of the TRL process (default: Ray's worker niceness, which the project's "
                         "training worker runs at: $RAY_worker_niceness, else 15)")
    ap.add_argument("--sequential", action="store_true",
                    help="run one whole side after the other instead of alternating their steps")
    ap.add_argument("--verbose", action="store_true", help="show the children's output instead of logging it")
    args, rest = ap.parse_known_args(argv)

    bad = [a for a in rest if "=" not in a]
    if bad:
        ap.error(f"unexpected arguments {bad}: options are listed by --help, overrides are key=value")
    if args.steps < 1:
        ap.error("--steps must be at least 1")
    if args.skip_trl and args.skip_project:
        ap.error("--skip-trl and --skip-project together leave nothing to run")
    trl_version = None
    if not args.skip_trl:
        trl_version = _trl_available()
        if trl_version is None:
            print("compare_trl: trl is not importable. TRL is a benchmark-only dependency; run this script as\n"
                  f"    {HOW_TO_RUN}\n(or pass --skip-trl to time the project alone)", file=sys.stderr)
            return 2
        if trl_version != TRL_PIN:
            print(f"[compare_trl] note: trl {trl_version} is installed; the script was written against {TRL_PIN}")

    # The schedule must span the benchmark run, validation is done by this script at start and end only,
    # and the run must neither resume nor leave checkpoints or logs in the repository.
    work = Path(args.keep).resolve() if args.keep else Path(tempfile.mkdtemp(prefix="compare_trl_"))
    work.mkdir(parents=True, exist_ok=True)
    for stale in ("spec.json", "project.json", "trl.json", "eval.json", "project_final", "trl_final", "trl_out"):
        if (work / stale).is_dir():  # a kept folder reused: nothing of an earlier run may be read back
            shutil.rmtree(work / stale)
        else:
            (work / stale).unlink(missing_ok=True)
    # TRL's GRPOTrainer has no dynamic sampling: the side-by-side runs the same algorithm on both sides.
    overrides = [f"grpo.max_num_steps={args.steps}", "grpo.val_period=0", "checkpointing.enabled=false",
                 "grpo.dynamic_sampling.enabled=false",
                 f"checkpointing.checkpoint_dir={work / 'project_ckpt'}", f"logger.log_dir={work / 'project_logs'}",
                 "logger.stdout_enabled=false", "logger.tensorboard_enabled=false", "logger.wandb_enabled=false"]
    if args.val_samples is not None:
        overrides.append(f"grpo.max_val_samples={args.val_samples}")
    overrides += rest
    from nemo_like.config import ConfigError, load_config

    try:  # a bad key or value fails here in a second, before any child starts
        load_config(args.config, overrides)
    except ConfigError as e:
        print(f"compare_trl: {e}", file=sys.stderr)
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
        return 2
    _write(work / "request.json", {"config": str(Path(args.config).resolve()), "overrides": overrides,
                                    "user_overrides": rest, "steps": args.steps})
    # `kill` (SIGTERM) unwinds like Ctrl-C: the children are stopped and the work folder removed.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    wall0 = time.perf_counter()
    durations: dict[str, float] = {}
    try:
        durations["prepare"] = _Child("prepare", work, args.verbose, lockstep=False).wait()
        spec = _read(work / "spec.json")
        threads = str(spec["threads"])
        one_process = {"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads, "TOKENIZERS_PARALLELISM": "false"}
        trl_nice = args.trl_nice if args.trl_nice is not None else int(os.environ.get("RAY_worker_niceness", "15"))
        roles = [r for r, skip in (("project", args.skip_project), ("trl", args.skip_trl)) if not skip]
        durations |= _run_sides(roles, work, args.steps, args.verbose, args.sequential,
                                {"trl": one_process | {"COMPARE_TRL_NICE": str(trl_nice)}})
        durations["eval"] = _Child("eval", work, args.verbose, lockstep=False, env_extra=one_process).wait()
        proj = _read(work / "project.json") if not args.skip_project else None
        trl_res = _read(work / "trl.json") if not args.skip_trl else None
        ev = _read(work / "eval.json")
        report = _report(args, spec, proj, trl_res, ev, durations, time.perf_counter() - wall0)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
        print(f"\n[compare_trl] wrote {args.json}")
    return 0


def _report(args, spec, proj, trl_res, ev, durations, total_s) -> dict[str, Any]:
    from nemo_like.utils.stats import paired_change

    w, steps = args.warmup, spec["steps"]
    if w >= steps:
        print(f"[compare_trl] note: --warmup {w} >= --steps {steps}; timing over all steps instead")
        w = 0
    p_tot = _summary(proj["step_total"], w) if proj else None
    p_wall = _summary(proj["step_wall"], w) if proj else None
    t_wall = _summary(trl_res["step_wall"], w) if trl_res else None
    base = ev["base"]
    p_ev, t_ev = ev.get("project"), ev.get("trl")
    def ratio(a, b):
        return "-" if not (a and b) else f"{a['mean'] / b['mean']:.2f}"
    def ratio_med(a, b):
        return "-" if not (a and b) else f"{a['median'] / b['median']:.2f}"
    n_val = len(spec["val"])
    # Step j of one side ran right before or after step j of the other (when alternating), so the
    # ratio of the two sees nearly the same machine load: its median is the drift-proof comparison.
    paired_ratio = "-"
    if proj and trl_res:
        ratios = [a / b for a, b in zip(proj["step_total"][w:], trl_res["step_wall"][w:]) if b > 0]
        paired_ratio = f"{statistics.median(ratios):.2f}" if ratios else "-"
    timed = f"steps {w + 1}-{steps}" if w else f"all {steps} steps"

    user = spec["user_overrides"]
    print(f"\n=== settings (config {spec['config']}" + (f", overrides {' '.join(user)}" if user else "") + ") ===")
    print(_settings_table(spec, proj, trl_res))
    if proj and trl_res and proj.get("worker_nice") is not None and proj["worker_nice"] != trl_res["nice"]:
        print(f"note: the project's worker ran at nice {proj['worker_nice']} and TRL at {trl_res['nice']}: under "
              "load from other work the two got unequal CPU shares (--trl-nice sets TRL's)")

    def load(res: dict | None) -> str:
        xs = (res or {}).get("load_avg", [])[w:]
        return f"{statistics.mean(xs):.1f} (1-min)" if xs else "-"

    def last(xs: list[float], k: int = 5) -> str:
        xs = [x for x in xs if not math.isnan(x)][-k:]
        return f"{statistics.mean(xs):.3f}" if xs else "-"

    rows = [
        [f"s/GRPO step, mean ({timed})", _sec(p_tot and p_tot["mean"]), _sec(t_wall and t_wall["mean"]),
         ratio(p_tot, t_wall)],
        [f"s/GRPO step, median ({timed})", _sec(p_tot and p_tot["median"]), _sec(t_wall and t_wall["median"]),
         ratio_med(p_tot, t_wall)],
        ["median of per-step ratios (step j vs step j)", "", "", paired_ratio],
        ["s/GRPO step, min / max", f"{_sec(p_tot and p_tot['min'])} / {_sec(p_tot and p_tot['max'])}" if p_tot else "-",
         f"{_sec(t_wall['min'])} / {_sec(t_wall['max'])}" if t_wall else "-", ""],
        ["s/GRPO step, wall of step() (mean)", _sec(p_wall and p_wall["mean"]), _sec(t_wall and t_wall["mean"]),
         ratio(p_wall, t_wall)],
        ["first (warm-up) step, s", _sec(p_tot and p_tot["first"]), _sec(t_wall and t_wall["first"]), ""],
        [f"held-out greedy acc, step 0 (n={n_val})", _pct(base["accuracy"]) if proj else "-",
         _pct(base["accuracy"]) if trl_res else "-", ""],
        [f"held-out greedy acc, step {steps}", _pct(p_ev and p_ev["accuracy"]), _pct(t_ev and t_ev["accuracy"]),
         f"{(p_ev['accuracy'] - t_ev['accuracy']) * 100:+.1f} pts" if (p_ev and t_ev) else ""],
        ["  (project's own validate(), start -> end)",
         f"{_pct(proj['val_acc'][0])} -> {_pct(proj['val_acc'][1])}" if proj else "-", "", ""],
        ["train reward, step 1 / mean of last 5",
         f"{proj['reward_mean'][0]:.3f} / {last(proj['reward_mean'])}" if proj else "-",
         f"{trl_res['reward_mean'][0]:.3f} / {last(trl_res['reward_mean'])}" if trl_res and trl_res["reward_mean"] else "-",
         ""],
        ["load average during the timed steps", load(proj), load(trl_res), ""],
    ]
    mode = ("sequential: one side after the other" if args.sequential or not (proj and trl_res)
            else "alternating: the sides took turns, one GRPO step each")
    print(f"\n=== results: {steps} GRPO steps per side ({mode}); timing leaves out the first {w} (warm-up) ===")
    print(_table(rows, ["", "project", f"TRL {trl_res['trl_version'] if trl_res else TRL_PIN}", "project/TRL"]))
    print("\nproject s/step: its own timing/total (data, generation, reward, log-probs, update; logging and"
          "\nvalidation excluded). TRL s/step: wall time from the start of its turn to the on_step_end of the"
          f"\nGRPO step's last optimizer step (of {spec['hp']['optimizer_steps_per_step']}; generation, data"
          " loading and logging included).\nAccuracy: every model graded by the same evaluator here: HF greedy"
          f" generate, at most {spec['hp']['max_new_tokens']} new tokens,\nstop at {spec['eos_token']},"
          f" {_grader_name(spec)}; paired results on the same problems (McNemar):")
    paired = {}
    if p_ev:
        paired["project: start -> end"] = paired_change(base["correct"], p_ev["correct"])
    if t_ev:
        paired["TRL: start -> end"] = paired_change(base["correct"], t_ev["correct"])
    if p_ev and t_ev:
        paired["TRL end -> project end"] = paired_change(t_ev["correct"], p_ev["correct"])
    if proj and p_ev:
        same = sum(a == b for a, b in zip(proj["val_correct"][1], p_ev["correct"]))
        paired["project end: own validate() vs this evaluator"] = f"{same}/{len(p_ev['correct'])} problems agree"
    for k, v in paired.items():
        print(f"  {k}: {v}")
    print(f"\ntotal wall time {total_s:.0f} s (" + ", ".join(f"{k} {v:.0f} s" for k, v in durations.items()) + ")")
    return {"settings": {k: v for k, v in spec.items() if k not in ("train", "val")}, "warmup": w,
            "project": proj and {k: v for k, v in proj.items() if k != "val_correct"} | {
                "s_per_step_total": p_tot, "s_per_step_wall": p_wall},
            "trl": trl_res and trl_res | {"s_per_step_wall": t_wall},
            "eval": {k: {kk: vv for kk, vv in v.items() if kk != "correct"} for k, v in ev.items()},
            "paired": paired, "median_paired_step_ratio": paired_ratio, "durations_s": durations, "total_s": total_s}


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
