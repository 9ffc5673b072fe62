"""Chaos, measured: a GRPO run whose processes are killed (SIGKILL) at seeded random moments, against an
undisturbed run of the same config and seed.

    uv run benchmarks/chaos.py [--config examples/configs/grpo_multi_env_async.yaml] [--steps 120]
        [--kills 30] [--kinds env,grader,rollout,policy,driver] [--seed 0] [--gap 1,4]
        [--work DIR] [--skip-reference] [key=value overrides for both runs ...]
    uv run benchmarks/chaos.py --gym --config examples/configs/grpo_cartpole.yaml --steps 400 --kinds collector,driver

Kinds of process (found among the driver's descendants by their command line):

    env        an environment actor (ray::MathEnvironment, ray::CodeEnvironment, ...)
    grader     a math grader pool process (the math environment's verifier subprocess)
    rollout    a rollout worker (ray::RolloutWorker; separate generation, async GRPO)
    policy     a policy training worker (ray::HFPolicyWorker)
    collector  a step collector of an agent run (ray::TrajectoryCollector; with --gym)
    driver     the driver itself (examples/run_grpo_math.py, or run_grpo_gym.py with --gym): kill -9,
               then started again (resume)

Both runs save a checkpoint every step (``checkpointing.save_period=1``). The chaos run is started,
and whenever its driver exits before its last step (killed, or stopped because a worker it cannot
replace died) it is started again with the same command, which resumes from the newest checkpoint.
One kill at a time: after each kill the harness waits until the run either logs two more steps (the
kill was survived in place; the step in flight may end before the driver hears of the kill) or its
driver exits (recovered by resume), then waits a random --gap before
the next kill, chosen by cycling through the kinds in a seeded shuffled order (a kind with no live
process at that moment is skipped for the next).

The table then compares the chaos run's metrics.jsonl with the undisturbed run's: rows duplicated or
missing, the prompts each step trained (``prompt_ids``: a skipped or twice-trained prompt shows up as
a difference; agent runs have none), and the final held-out accuracy (agent runs: greedy return).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = {False: ROOT / "examples" / "run_grpo_math.py", True: ROOT / "examples" / "run_grpo_gym.py"}

KIND_PATTERNS = {
    "env": re.compile(r"^ray::\w*Environment\b"),
    "grader": re.compile(r"grader_pool import _worker_main"),
    "rollout": re.compile(r"^ray::RolloutWorker\b"),
    "policy": re.compile(r"^ray::HFPolicyWorker\b"),
    "collector": re.compile(r"^ray::TrajectoryCollector\b"),
}
ALL_KINDS = ("env", "grader", "rollout", "policy", "collector", "driver")
LM_KINDS = ("env", "grader", "rollout", "policy", "driver")


# ---- processes --------------------------------------------------------------------------------
def _processes() -> dict[int, tuple[int, str]]:
    """pid -> (ppid, command line) of every process readable now."""
    out = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{d}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except (OSError, IndexError, ValueError):
            continue
        out[int(d)] = (ppid, cmd)
    return out


def descendants(root: int) -> dict[int, str]:
    procs = _processes()
    children = collections.defaultdict(list)
    for pid, (ppid, _) in procs.items():
        children[ppid].append(pid)
    out, todo = {}, [root]
    while todo:
        for c in children.get(todo.pop(), []):
            out[c] = procs[c][1]
            todo.append(c)
    return out


def find(kind: str, driver: int) -> list[tuple[int, str]]:
    pat = KIND_PATTERNS[kind]
    return sorted((pid, cmd) for pid, cmd in descendants(driver).items() if pat.search(cmd))


# ---- metrics.jsonl ------------------------------------------------------------------------------
def read_rows(log_dir: Path) -> list[dict]:
    """Not utils.jsonl_files.read_metrics_jsonl: this file is read while a driver that may be killed
    mid-line writes it, so a partial last line is skipped, not an error."""
    path = log_dir / "metrics.jsonl"
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return rows


def last_step(log_dir: Path) -> int:
    return max((r["step"] for r in read_rows(log_dir) if "timing/total" in r), default=0)


def final_accuracy(rows: list[dict]) -> float | None:
    """The last held-out accuracy (agent runs: greedy return) logged."""
    key = "val/accuracy" if any("val/accuracy" in r for r in rows) else "val/return_mean"
    vals = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
    return round(max(vals)[1], 3) if vals else None


# ---- one driver -------------------------------------------------------------------------------
@dataclass
class Driver:
    cmd: list[str]
    log: Path
    proc: subprocess.Popen | None = None
    tail: collections.deque = field(default_factory=lambda: collections.deque(maxlen=40))

    def start(self) -> None:
        f = open(self.log, "a")
        f.write(f"\n===== start {time.strftime('%H:%M:%S')}: {' '.join(self.cmd)}\n")
        f.flush()
        self.tail.clear()
        # A session of its own: the Ray head processes the driver starts can be swept with it.
        self.proc = subprocess.Popen(self.cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     start_new_session=True, text=True, errors="replace", bufsize=1)

        def pump(p=self.proc) -> None:
            for line in p.stdout:
                f.write(line)
                for part in line.replace("\r", "\n").splitlines():
                    if part.strip() and not part.startswith("GRPO:"):
                        self.tail.append(part.rstrip())
            f.close()

        threading.Thread(target=pump, daemon=True).start()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def sweep(self) -> None:
        """After the driver exited: SIGKILL what is left of its Ray (head, workers, graders)."""
        if self.proc is None:
            return
        left = descendants(self.proc.pid)
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        # Ray workers are children of the raylet; an orphan is re-parented and found by its session dir.
        time.sleep(1.0)

    def stop_line(self) -> str:
        """The driver's last words: the last line that names an error, else its last line."""
        lines = list(self.tail)
        for line in reversed(lines):
            if re.search(r"Error|error|stopped|failed|died", line):
                return line.strip()[:160]
        return lines[-1].strip()[:160] if lines else ""


def run_command(config: str, steps: int, log_dir: Path, ckpt_dir: Path, overrides: list[str],
                gym: bool = False) -> list[str]:
    more = ["grpo.target_val_return=null"] if gym else []  # every run goes all the steps
    return [sys.executable, str(SCRIPTS[gym]), "--config", config, f"grpo.max_num_steps={steps}", *more,
            f"grpo.val_period={steps}", f"logger.log_dir={log_dir}", "logger.tensorboard_enabled=false",
            f"checkpointing.checkpoint_dir={ckpt_dir}", "checkpointing.save_period=1",
            "checkpointing.metric_name=null", *overrides]


def reference_run(args, work: Path) -> tuple[list[dict], float]:
    log_dir = work / "reference" / "logs"
    cmd = run_command(args.config, args.steps, log_dir, work / "reference" / "ckpt", args.overrides, args.gym)
    t0 = time.time()
    d = Driver(cmd, work / "reference.log")
    d.start()
    d.proc.wait()
    d.sweep()
    if d.proc.returncode != 0:
        raise SystemExit(f"the undisturbed run failed (exit {d.proc.returncode}): {d.stop_line()}; see {d.log}")
    return read_rows(log_dir), time.time() - t0


@dataclass
class Kill:
    kind: str
    name: str
    step: int
    outcome: str = ""
    stop_line: str = ""


def chaos_run(args, work: Path) -> tuple[list[Kill], list[dict], int, float, list[str]]:
    log_dir = work / "chaos" / "logs"
    cmd = run_command(args.config, args.steps, log_dir, work / "chaos" / "ckpt", args.overrides, args.gym)
    rng = random.Random(args.seed)
    kinds = list(args.kinds)
    rng.shuffle(kinds)
    lo, hi = args.gap
    kills: list[Kill] = []
    starts, notes = 0, []
    d = Driver(cmd, work / "chaos.log")
    t0 = time.time()
    k = 0
    need_progress = True  # after a start: wait until it trains (a step logged) before the next kill
    while True:
        if not d.alive():
            if d.proc is not None:
                d.sweep()
                if d.proc.returncode == 0 and last_step(log_dir) >= args.steps:
                    break
                if starts > args.kills + 20:
                    raise SystemExit(f"the chaos run was started {starts} times without finishing; see {d.log}")
            at_start = last_step(log_dir)
            d.start()
            starts += 1
            need_progress = True
        if len(kills) >= args.kills:  # enough: let the run finish (restarted above if it stops)
            d.proc.wait()
            continue
        if need_progress:
            while d.alive() and last_step(log_dir) <= at_start:
                time.sleep(0.2)
            need_progress = False
        time.sleep(rng.uniform(lo, hi))
        if not d.alive():
            continue
        # The next kind in the shuffled cycle that has a live process.
        for _ in range(len(kinds)):
            kind = kinds[k % len(kinds)]
            k += 1
            if kind == "driver":
                targets = [(d.proc.pid, "driver")]
            else:
                targets = find(kind, d.proc.pid)
            if targets:
                break
            print(f"[chaos] no live {kind} process now; the next kind", flush=True)
        else:
            continue
        pid, name = rng.choice(targets)
        step = last_step(log_dir)
        if step >= args.steps:
            continue
        kill = Kill(kind, re.sub(r"\s.*", "", name) if kind != "grader" else "grader", step)
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            continue
        kills.append(kill)
        print(f"[chaos] kill {len(kills)}: {kind} ({kill.name}, pid {pid}) at step {step}", flush=True)
        # Outcome: a new step logged with the driver alive (survived), or the driver exits (resume).
        deadline = time.time() + args.outcome_timeout
        while time.time() < deadline:
            if not d.alive():
                kill.outcome = "resume"
                kill.stop_line = "" if kind == "driver" else d.stop_line()
                break
            # Two steps: the one in flight at the kill may still complete before the driver hears of it.
            if last_step(log_dir) >= step + 2:
                kill.outcome = "in place"
                break
            time.sleep(0.2)
        else:
            kill.outcome = "hung"
            notes.append(f"kill {len(kills)} ({kind} at step {step}): no step and no exit in "
                         f"{args.outcome_timeout:.0f} s; the driver was killed")
            os.kill(d.proc.pid, signal.SIGKILL)
            d.proc.wait()
        print(f"[chaos]   -> {kill.outcome}" + (f": {kill.stop_line}" if kill.stop_line else ""), flush=True)
    return kills, read_rows(log_dir), starts, time.time() - t0, notes


def compare(ref: list[dict], got: list[dict], steps: int) -> dict[str, int]:
    def steps_of(rows):
        return [r["step"] for r in rows if "timing/total" in r or "train/return_mean" in r]

    s = steps_of(got)
    ref_prompts = {r["step"]: r.get("prompt_ids") for r in ref if "timing/total" in r}
    got_prompts = {r["step"]: r.get("prompt_ids") for r in got if "timing/total" in r}
    ref_all = collections.Counter(p for ids in ref_prompts.values() for p in ids or [])
    got_all = collections.Counter(p for ids in got_prompts.values() for p in ids or [])
    out = {"rows duplicated": len(s) - len(set(s)), "rows missing": len(set(range(1, steps + 1)) - set(s))}
    if not any(ref_prompts.values()):  # an agent run: no prompts
        return out
    return out | {
        "steps whose prompts differ": sum(ref_prompts.get(k) != got_prompts.get(k) for k in range(1, steps + 1)),
        "prompts skipped": sum((ref_all - got_all).values()),
        "prompts trained twice": sum((got_all - ref_all).values()),
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="examples/configs/grpo_multi_env_async.yaml")
    ap.add_argument("--gym", action="store_true", help="an agent run (examples/run_grpo_gym.py)")
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--kills", type=int, default=30)
    ap.add_argument("--kinds", default=None, help=f"default: {','.join(LM_KINDS)}; with --gym: collector,driver")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--gap", default="1,4", help="seconds between a kill's outcome and the next kill: LO,HI")
    ap.add_argument("--outcome-timeout", type=float, default=180.0)
    ap.add_argument("--work", default=None, help="folder for both runs (default: a new one under /tmp)")
    ap.add_argument("--skip-reference", action="store_true", help="no undisturbed run (no comparison)")
    ap.add_argument("overrides", nargs="*", help="key=value for both runs")
    args = ap.parse_args(argv)
    args.kinds = [k.strip() for k in (args.kinds or ("collector,driver" if args.gym else ",".join(LM_KINDS))).split(",")
                  if k.strip()]
    if bad := [k for k in args.kinds if k not in ALL_KINDS]:
        ap.error(f"--kinds: unknown {bad}; known: {', '.join(ALL_KINDS)}")
    args.gap = tuple(float(x) for x in args.gap.split(","))
    work = Path(args.work) if args.work else Path(f"/tmp/nemo_like_chaos_{os.getpid()}")
    work.mkdir(parents=True, exist_ok=True)
    print(f"[chaos] config {args.config}, {args.steps} steps, {args.kills} kills of {args.kinds}, seed {args.seed}; "
          f"work in {work}", flush=True)

    ref, ref_s = (None, 0.0) if args.skip_reference else reference_run(args, work)
    if ref is not None:
        print(f"[chaos] undisturbed run: {ref_s:.0f} s, final accuracy {final_accuracy(ref)}", flush=True)
    kills, rows, starts, chaos_s, notes = chaos_run(args, work)

    print()
    print(f"{args.config}, {args.steps} steps, seed {args.seed}: {len(kills)} kills, the driver started {starts} "
          f"times, {chaos_s:.0f} s (undisturbed: {ref_s:.0f} s)")
    print()
    print("| kind | kills | survived in place | recovered by resume | hung |")
    print("|---|---:|---:|---:|---:|")
    for kind in args.kinds:
        ks = [x for x in kills if x.kind == kind]
        print(f"| {kind} | {len(ks)} | {sum(x.outcome == 'in place' for x in ks)} | "
              f"{sum(x.outcome == 'resume' for x in ks)} | {sum(x.outcome == 'hung' for x in ks)} |")
    print(f"| **all** | **{len(kills)}** | {sum(x.outcome == 'in place' for x in kills)} | "
          f"{sum(x.outcome == 'resume' for x in kills)} | {sum(x.outcome == 'hung' for x in kills)} |")
    print()
    what = "greedy return" if args.gym else "accuracy"
    print("| check | value |")
    print("|---|---:|")
    if ref is not None:
        for name, value in compare(ref, rows, args.steps).items():
            print(f"| {name} (must be 0) | {value} |")
        print(f"| final held-out {what}, undisturbed | {final_accuracy(ref)} |")
    print(f"| final held-out {what}, chaos | {final_accuracy(rows)} |")
    # Worker names end in a random hex id: without it the same message counts once.
    lines = collections.Counter(re.sub(r"-[0-9a-f]{8}\b", "-...", x.stop_line) for x in kills if x.stop_line)
    if lines:
        print()
        print("What the driver said when a kill stopped it:")
        for line, n in lines.most_common():
            print(f"- ({n}x) {line}")
    for n in notes:
        print(f"- {n}")


if __name__ == "__main__":
    main()
