"""This project's trajectory-level GRPO against stable-baselines3 PPO on CartPole-v1: time and steps to 475.

    uv run --with stable-baselines3 benchmarks/compare_sb3.py [--repeats 1] [--seed 42] [--max-steps 300000]
        [--eval-every 2048] [--sb3-defaults] [--config PATH] [--json PATH] [key=value overrides for ours ...]

Both learners run in this one process, one after the other (with `--repeats N` they take turns, the
first mover swapping each repeat, seed = --seed + repeat for both), and train until their greedy mean
return over the SAME 20 held-out seeds (reset(seed=10**9 + i), i = 0..19, deterministic/argmax actions)
reaches 475, or a budget runs out:

1. this project: `GymGRPOExperiment` on examples/configs/grpo_cartpole.yaml, or --config (ppo_cartpole.yaml:
   PPO with the value head as critic, grpo.advantage_estimator=gae) (grpo.seed=SEED, Ray on 2
   CPUs, no checkpoints). "train s" is the wall time of `train()`, which validates at the start and every
   grpo.val_period updates and stops at grpo.target_val_return; "total s" adds the setup (Ray, collectors).
   Env steps: training episodes only. Budget: grpo.max_num_steps updates.
2. stable-baselines3 PPO with the RL Baselines3 Zoo's tuned CartPole-v1 hyperparameters
   (DLR-RM/rl-baselines3-zoo, hyperparams/ppo.yml, entry "CartPole-v1", marked "# Tuned"): n_envs 8,
   MlpPolicy, n_timesteps 1e5, n_steps 32, batch_size 256, gae_lambda 0.8, gamma 0.98, n_epochs 20,
   ent_coef 0.0, learning_rate lin_0.001, clip_range lin_0.2 (the zoo's `lin_x` = x * progress_remaining).
   The zoo's linear schedules run to 0 at its n_timesteps, so its budget is min(1e5, --max-steps).
   `--sb3-defaults` uses plain `PPO("MlpPolicy", env)` on one env instead (budget --max-steps).
   A callback evaluates at the start and every --eval-every env steps (20 separate gymnasium envs, stepped
   together with batched `predict(deterministic=True)`) and stops `learn()` at 475. "train s" is the wall
   time of `learn()`; "total s" adds building the envs and the model. SB3 runs at torch's default thread
   count (restored after ours, which sets 1 per process; --sb3-threads N to change); the count is printed.

Both train times include their own evaluation cost (ours: 20 greedy episodes every 5 updates on its Ray
collectors; SB3: every --eval-every steps; its evaluation seconds are also shown apart).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CONFIG = ROOT / "examples" / "configs" / "grpo_cartpole.yaml"
ENV_ID, TARGET, VAL_SEED_BASE, VAL_EPISODES = "CartPole-v1", 475.0, 10**9, 20
ZOO_N_TIMESTEPS = 100_000
DEFAULT_THREADS = torch.get_num_threads()


def _lin(x: float):
    return lambda progress_remaining: progress_remaining * x


def zoo_ppo_kwargs() -> dict[str, Any]:
    return dict(n_steps=32, batch_size=256, gae_lambda=0.8, gamma=0.98, n_epochs=20, ent_coef=0.0,
                learning_rate=_lin(0.001), clip_range=_lin(0.2))


def run_ours(config: str, seed: int, overrides: list[str], log_dir: str) -> dict[str, Any]:
    from nemo_like.gym.experiment import GymGRPOExperiment

    ov = [f"grpo.seed={seed}", "cluster.num_cpus=2", "checkpointing.enabled=false", f"logger.log_dir={log_dir}",
          "logger.tensorboard_enabled=false", f"grpo.target_val_return={TARGET}",
          f"grpo.val_episodes={VAL_EPISODES}", *overrides]
    t0 = time.perf_counter()
    with GymGRPOExperiment(config, overrides=ov) as exp:
        t1 = time.perf_counter()
        exp.train()
        t2 = time.perf_counter()
        tr = exp.trainer
        kind = "PPO/GAE" if tr.config.grpo.advantage_estimator == "gae" else "GRPO"  # e.g. --config examples/configs/ppo_cartpole.yaml
        return {"learner": f"ours ({kind})", "seed": seed, "reached": bool(tr.reached_target), "train_s": t2 - t1,
                "env_steps": tr.env_steps, "final_return": tr.last_val_metrics.get("val/return_mean", float("nan")),
                "total_s": t2 - t0, "updates": tr.step_count, "torch_threads": torch.get_num_threads()}


def greedy_return(model: Any, envs: list[gym.Env]) -> float:
    """Mean return of deterministic episodes from reset(seed=10**9 + i), the envs stepped together."""
    obs = [env.reset(seed=VAL_SEED_BASE + i)[0] for i, env in enumerate(envs)]
    rets, active = np.zeros(len(envs)), list(range(len(envs)))
    while active:
        actions, _ = model.predict(np.stack([obs[i] for i in active]), deterministic=True)
        still = []
        for i, a in zip(active, actions):
            obs[i], r, terminated, truncated, _ = envs[i].step(int(a))
            rets[i] += r
            if not (terminated or truncated):
                still.append(i)
        active = still
    return float(rets.mean())


def run_sb3(seed: int, max_steps: int, eval_every: int, defaults: bool, threads: int) -> dict[str, Any]:
    from stable_baselines3 import PPO
    from stable_baselines3.common.callbacks import BaseCallback
    from stable_baselines3.common.env_util import make_vec_env

    class GreedyEval(BaseCallback):
        def __init__(self) -> None:
            super().__init__()
            self.envs = [gym.make(ENV_ID) for _ in range(VAL_EPISODES)]
            self.last_eval, self.eval_s, self.reached_at, self.final = 0, 0.0, None, float("nan")

        def _evaluate(self) -> bool:
            t = time.perf_counter()
            self.final = greedy_return(self.model, self.envs)
            self.eval_s += time.perf_counter() - t
            self.last_eval = self.num_timesteps
            if self.final >= TARGET:
                self.reached_at = self.num_timesteps
            return self.reached_at is None

        def _on_training_start(self) -> None:
            self._evaluate()

        def _on_step(self) -> bool:
            if self.reached_at is not None:
                return False
            return self._evaluate() if self.num_timesteps - self.last_eval >= eval_every else True

    torch.set_num_threads(threads)
    budget = max_steps if defaults else min(max_steps, ZOO_N_TIMESTEPS)
    t0 = time.perf_counter()
    env = make_vec_env(ENV_ID, n_envs=1 if defaults else 8, seed=seed)
    model = PPO("MlpPolicy", env, seed=seed, verbose=0, **({} if defaults else zoo_ppo_kwargs()))
    cb = GreedyEval()
    t1 = time.perf_counter()
    model.learn(total_timesteps=budget, callback=cb)
    t2 = time.perf_counter()
    if cb.reached_at is None and cb.last_eval != model.num_timesteps:
        cb._evaluate()  # the budget ran out between evaluations: one last look
    env.close()
    return {"learner": f"SB3 PPO ({'defaults' if defaults else 'zoo'})", "seed": seed,
            "reached": cb.reached_at is not None, "train_s": t2 - t1,
            "env_steps": cb.reached_at if cb.reached_at is not None else model.num_timesteps,
            "final_return": cb.final, "total_s": t2 - t0, "eval_s": cb.eval_s, "budget": budget,
            "torch_threads": torch.get_num_threads()}


def _table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(len(header))]

    def line(r: list[str]) -> str:
        return "  ".join(str(c).ljust(w) if i == 0 else str(c).rjust(w) for i, (c, w) in enumerate(zip(r, widths)))

    return "\n".join([line(header), "  ".join("-" * w for w in widths)] + [line(r) for r in rows])


def _med(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 usage="compare_sb3.py [options] [key=value overrides for our config]")
    ap.add_argument("--repeats", type=int, default=1, help="runs of each learner, alternating (default 1)")
    ap.add_argument("--seed", type=int, default=42, help="seed of repeat 0 for both learners (default 42)")
    ap.add_argument("--max-steps", type=int, default=300_000, help="SB3's env-step budget (default 300000)")
    ap.add_argument("--eval-every", type=int, default=2048, help="SB3 evaluation period in env steps (default 2048)")
    ap.add_argument("--sb3-defaults", action="store_true", help="plain PPO defaults (1 env) instead of the zoo's")
    ap.add_argument("--config", default=str(DEFAULT_CONFIG), help="our config (default: grpo_cartpole.yaml)")
    ap.add_argument("--sb3-threads", type=int, default=DEFAULT_THREADS,
                    help=f"torch threads for SB3 (default: torch's default here, {DEFAULT_THREADS})")
    ap.add_argument("--skip-ours", action="store_true")
    ap.add_argument("--skip-sb3", action="store_true")
    ap.add_argument("--json", default=None, help="also write every number to this JSON file")
    args, overrides = ap.parse_known_args(argv)
    if bad := [o for o in overrides if "=" not in o or o.startswith("-")]:
        ap.error(f"unrecognized arguments: {' '.join(bad)}")
    sb3_version = None
    if not args.skip_sb3:
        try:
            import stable_baselines3
        except ImportError:
            ap.error("stable-baselines3 is not installed: uv run --with stable-baselines3 benchmarks/compare_sb3.py")
        sb3_version = stable_baselines3.__version__
    print(f"[compare_sb3] stable-baselines3 {sb3_version}, torch {torch.__version__}, gymnasium {gym.__version__};"
          f" torch threads: SB3 {args.sb3_threads}, ours policy.torch_threads (default 1)", flush=True)

    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="compare_sb3_") as tmp:
        for rep in range(args.repeats):
            seed = args.seed + rep
            order = ["ours", "sb3"] if rep % 2 == 0 else ["sb3", "ours"]
            for who in order:
                if (who == "ours" and args.skip_ours) or (who == "sb3" and args.skip_sb3):
                    continue
                print(f"[compare_sb3] repeat {rep + 1}/{args.repeats}: {who}, seed {seed}", flush=True)
                if who == "ours":
                    res = run_ours(args.config, seed, overrides, str(Path(tmp) / f"ours_{rep}"))
                else:
                    res = run_sb3(seed, args.max_steps, args.eval_every, args.sb3_defaults, args.sb3_threads)
                res["repeat"] = rep
                runs.append(res)
                print(f"[compare_sb3]   reached {TARGET:g}: {res['reached']}, train {res['train_s']:.1f} s, "
                      f"{res['env_steps']} env steps, final greedy return {res['final_return']:.1f}", flush=True)

    rows = [[r["learner"] + (f" #{r['repeat'] + 1}" if args.repeats > 1 else ""), "yes" if r["reached"] else "NO",
             f"{r['train_s']:.1f}", f"{r['env_steps']:,}", f"{r['final_return']:.1f}", f"{r['total_s']:.1f}",
             f"{r['eval_s']:.1f}" if "eval_s" in r else "-"] for r in runs]
    print(f"\nCartPole-v1, greedy mean return over {VAL_EPISODES} held-out seeds (10**9 + i) >= {TARGET:g}:")
    print(_table(rows, ["learner", f"reached {TARGET:g}", f"wall s to {TARGET:g} (train)",
                        f"env steps to {TARGET:g}", "final greedy return", "total wall s incl. setup",
                        "of which eval s"]))
    ours = [r for r in runs if r["learner"].startswith("ours")]
    sb3 = [r for r in runs if r["learner"].startswith("SB3")]
    summary: dict[str, Any] = {}
    if ours and sb3:
        summary = {"wall_ratio_ours_over_ppo": _med(ours, "train_s") / _med(sb3, "train_s"),
                   "total_wall_ratio_ours_over_ppo": _med(ours, "total_s") / _med(sb3, "total_s"),
                   "env_steps_ratio_ours_over_ppo": _med(ours, "env_steps") / _med(sb3, "env_steps"),
                   "all_reached": all(r["reached"] for r in runs)}
        what = "medians over repeats" if args.repeats > 1 else "one run each"
        print(f"\nours/PPO ({what}): train wall time {summary['wall_ratio_ours_over_ppo']:.2f}x (goal <= 2x), "
              f"incl. setup {summary['total_wall_ratio_ours_over_ppo']:.2f}x, "
              f"env steps {summary['env_steps_ratio_ours_over_ppo']:.2f}x")
        if not summary["all_reached"]:
            print(f"note: not every run reached {TARGET:g}; its numbers are at the end of its budget")
    print("Train wall times include each learner's own evaluations (ours: every grpo.val_period updates; "
          f"SB3: every {args.eval_every} env steps); setup (Ray start, collectors / envs, model) is only in total.")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args) | {"overrides": overrides},
                                               "sb3_version": sb3_version, "torch_threads_sb3": args.sb3_threads,
                                               "runs": runs, "summary": summary}, indent=1))
        print(f"[compare_sb3] wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
