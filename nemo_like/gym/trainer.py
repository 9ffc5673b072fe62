"""Trajectory-level GRPO for agents on step environments (games, control): one update per `step()`.

A group is K trajectories from one reset seed (the step-environment analogue of G completions of
one prompt). Each trajectory is reduced to its return ``R_i = sum_t r_{i,t}``; the registered
advantage estimator (``grpo.advantage_estimator``: ``mean`` or ``mean_std``) makes it group-relative; the
registered loss (``loss_fn.name``, by default ``trajectory_pg``) is REINFORCE on the whole trajectory,
``-mean_i A_i sum_t log pi(a_t | s_t)``, recomputed with the live weights for ``update_epochs``
passes. The value head of the network is not trained then.

``grpo.advantage_estimator: gae`` is PPO with a critic instead: the network's value head gives V(s_t) (before
the update, no gradient), GAE (``grpo.gamma``, ``grpo.lam``) turns each trajectory's per-step rewards
into per-step advantages (whitened over the batch's real steps unless ``grpo.whiten_advantages`` is
off) and returns, and ``loss_fn.vf_coef * clipped_value_loss`` is added to the policy loss in the same
backward pass, as SB3's PPO does (here both heads also share the trunk; SB3's MlpPolicy gives each its
own 64x64 MLP). Groups still structure collection (K episodes
per reset seed) but play no part in the advantages.

Collectors are Ray actors (nemo_like.gym.collector) that act with the weights of the
latest update (pushed at the start of every step, checked by version); the learner runs here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from nemo_like.algorithms.advantages import get_advantage_estimator
from nemo_like.algorithms.ppo_terms import compute_gae, explained_variance, masked_mean, masked_whiten
from nemo_like.gym.agent import ObsBatch, obs_index, obs_to_tensor
from nemo_like.gym.collector import CollectorGroup, Trajectory
from nemo_like.gym.config import GymMasterConfig
from nemo_like.gym.loss import value_loss_term
from nemo_like.utils.checkpoint import CheckpointManager, ranked_training_info
from nemo_like.utils.checkpoint_io import load_train_state, save_train_state
from nemo_like.utils.logger import Logger
from nemo_like.utils.progress import progress_bar
from nemo_like.utils.timer import Timer

__all__ = ["AGENT_FILE", "GymGRPOTrainer", "VAL_SEED_BASE", "gym_grpo_train", "step_seeds", "trajectory_gae"]

# Training reset seeds are drawn from [0, VAL_SEED_BASE); validation uses VAL_SEED_BASE + i, so a
# held-out seed is never trained on.
VAL_SEED_BASE = 10**9
AGENT_FILE = "agent.pt"


def step_seeds(seed: int, step: int, n: int, round_: int = 0) -> np.ndarray:
    """The reset seeds of step ``step`` (refill round ``round_``): a pure function of the run seed,
    so a resumed run draws exactly what the uninterrupted one would have, with no sampler state."""
    return np.random.default_rng([seed, step, round_]).integers(0, VAL_SEED_BASE, size=n)


def policy_forward(net: nn.Module, obs: ObsBatch, actions: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Per-step ``log pi(a_t | s_t)``, the policy's entropy at ``s_t`` and the value head's ``V(s_t)``,
    all [N], with gradient (one forward pass for both heads)."""
    logits, value = net(obs)
    logp = torch.log_softmax(logits.float(), dim=-1)
    entropy = -(logp.exp() * logp).sum(dim=-1)
    return logp.gather(-1, actions[:, None]).squeeze(-1), entropy, value


def policy_logprobs(net: nn.Module, obs: ObsBatch, actions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-step ``log pi(a_t | s_t)`` and the policy's entropy at ``s_t``, both [N], with gradient."""
    return policy_forward(net, obs, actions)[:2]


def trajectory_gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, bootstrap: torch.Tensor, *,
                   gamma: float, lam: float, whiten: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE over whole episodes: ``rewards``, ``values`` (V(s_t) before the update) and ``mask`` (1 on
    real steps) [B, T]; ``bootstrap`` [B] is the value past each episode's last step: 0 for a terminated
    episode, V(s_T) for a truncated one whose final observation is known. Returns ``(advantages,
    returns)`` [B, T], 0 off the mask; ``returns = advantages + values`` (before whitening) are the
    value head's targets; the advantages are whitened over the mask's steps when ``whiten``.

    ``compute_gae`` takes the value past the last step as 0; ``gamma * bootstrap`` added to the last
    reward gives exactly ``delta_T = r_T + gamma * V(s_T) - V(s_{T-1})`` (SB3's PPO does the same on
    truncation)."""
    last = (mask.bool() & (mask.flip(1).cumsum(1).flip(1) == 1)).to(rewards.dtype)
    rewards = rewards + gamma * bootstrap.to(rewards.dtype)[:, None] * last
    adv, returns = compute_gae(rewards, values, mask, gamma=gamma, lam=lam)
    if whiten:
        adv = masked_whiten(adv, mask)
    return adv, returns


@dataclass
class _Batch:
    """The trajectories of the step, flat over steps, with the (trajectory, position) of each step."""

    obs: ObsBatch
    actions: torch.Tensor  # [N]
    traj: torch.Tensor  # [N] trajectory index
    pos: torch.Tensor  # [N] step index within its trajectory
    lengths: torch.Tensor  # [B]
    gen_logprobs: torch.Tensor  # [B, T]
    rewards: torch.Tensor  # [B, T], 0 past each trajectory's end

    @classmethod
    def from_trajectories(cls, trajs: list[Trajectory]) -> _Batch:
        lengths = torch.tensor([t.length for t in trajs])
        traj = torch.repeat_interleave(torch.arange(len(trajs)), lengths)
        pos = torch.cat([torch.arange(n) for n in lengths.tolist()])
        if isinstance(trajs[0].obs, dict):
            obs: ObsBatch = {k: torch.from_numpy(np.concatenate([t.obs[k] for t in trajs])) for k in trajs[0].obs}
        else:
            obs = torch.from_numpy(np.concatenate([t.obs for t in trajs]))
        actions = torch.from_numpy(np.concatenate([t.actions for t in trajs]))
        gen = torch.from_numpy(np.concatenate([t.logprobs for t in trajs]))
        rewards = torch.from_numpy(np.concatenate([np.asarray(t.rewards, dtype=np.float32) for t in trajs]))
        batch = cls(obs, actions, traj, pos, lengths, gen, rewards)
        batch.gen_logprobs, batch.rewards = batch.pad(gen), batch.pad(rewards)
        return batch

    def pad(self, flat: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """Per-step values [N] (of the trajectories ``rows``, in order) -> [B, T], differentiable."""
        traj, pos = (self.traj, self.pos) if rows is None else self.select(rows)[1:]
        b = len(self.lengths) if rows is None else len(rows)
        t = int(self.lengths.max()) if rows is None else int(self.lengths[rows].max())
        out = flat.new_zeros(b, t)
        return out.index_put((traj, pos), flat)

    def select(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Step indices of trajectories ``rows``, and their (new trajectory index, position)."""
        remap = torch.full((len(self.lengths),), -1, dtype=torch.long)
        remap[rows] = torch.arange(len(rows))
        steps = torch.nonzero(remap[self.traj] >= 0).squeeze(-1)
        return steps, remap[self.traj[steps]], self.pos[steps]

    def mask(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """[len(rows), T_rows] (every trajectory when ``rows`` is None): 1 on real steps."""
        lengths = self.lengths if rows is None else self.lengths[rows]
        return (torch.arange(int(lengths.max()))[None, :] < lengths[:, None]).float()


@dataclass
class GymGRPOTrainer:
    config: GymMasterConfig
    collectors: CollectorGroup
    net: nn.Module
    optimizer: torch.optim.Optimizer
    loss_fn: Any
    logger: Logger
    checkpointer: CheckpointManager | None = None
    ref_net: nn.Module | None = None
    step_count: int = 0
    env_steps: int = 0
    history: list[dict[str, float]] = field(default_factory=list)
    last_val_metrics: dict[str, float] = field(default_factory=dict)
    last_val_step: int = -1  # the step last_val_metrics were measured at
    first_val_return: float | None = None
    stop_reason: str | None = None  # the run cannot learn: train() stops, the CLI exits 1
    reached_target: bool = False  # val/return_mean reached grpo.target_val_return: train() stops
    _empty_steps: int = 0
    _last_error: str | None = None  # the first environment error seen, quoted when the run stops
    _resources: list[Any] = field(default_factory=list)

    def step(self) -> dict[str, float]:
        """One update: collect groups with the latest weights, then ``update_epochs`` passes."""
        cfg, g = self.config, self.config.grpo
        timer = Timer()
        metrics: dict[str, float] = {}
        with timer.time("total"):
            # 1. The collectors get the weights of the latest update (version = updates so far).
            with timer.time("weight_sync"):
                metrics["refit/bytes"] = self.sync_weights()  # 0 when a validation just sent them
            # 2-3. K trajectories per reset seed; short and failed ones are dropped and their groups
            #      refilled from the same seed; only complete groups are kept.
            with timer.time("collect"):
                groups, stats = self._collect_groups()
            metrics.update(stats)
            if groups:
                self._empty_steps = 0
                trajs = [t for grp in groups for t in grp]
                batch = _Batch.from_trajectories(trajs)
                # 4. Advantages: group-relative on episode returns ([B]), or with gae per step ([B, T])
                #    from the value head, which gets returns to regress on (critic).
                with timer.time("advantages"):
                    if g.advantage_estimator == "gae":
                        adv, critic = self._gae(batch, trajs)
                        metrics.update(self._critic_stats(batch, critic))
                    else:
                        returns = torch.tensor([t.ret for t in trajs], dtype=torch.float64)
                        group_ids = torch.repeat_interleave(torch.arange(len(groups)), g.group_size)
                        adv, critic = get_advantage_estimator(g.advantage_estimator)(returns, group_ids, config=g).float(), None
                # 5. Reference log-probs (only when the KL term is on) and the pre-update ones (a loss
                #    with a ratio, such as clipped_pg, needs them; trajectory_pg does not).
                with timer.time("reference"):
                    fixed = self._fixed_logprobs(batch)
                # 6. update_epochs passes of minibatches of whole groups (policy loss, plus the value
                #    term when the value head is trained).
                with timer.time("train"):
                    metrics.update(self._train(batch, adv, fixed, len(groups), critic))
                # 7. Refresh the frozen reference every ref_sync_every updates.
                if self.ref_net is not None and (self.step_count + 1) % g.ref_sync_every == 0:
                    self.ref_net.load_state_dict(self.net.state_dict())
                metrics.update(self._train_stats(groups, adv, batch))
            else:
                self._empty_steps += 1
                if self._empty_steps >= g.max_empty_steps:
                    self.stop_reason = (f"no complete group in {self._empty_steps} steps in a row: {stats['train/dropped_short']:.0f} "
                                        f"trajectories shorter than env.min_trajectory_length={cfg.env.min_trajectory_length} "
                                        f"and {stats['train/episodes_failed']:.0f} failed episodes in the last one"
                                        + (f" (first error: {self._last_error})" if self._last_error else ""))
        self.step_count += 1
        metrics["train/env_steps_total"] = float(self.env_steps)
        metrics["collectors/restarts"] = float(self.collectors.restarts)
        metrics.update({f"timing/{k}": v for k, v in timer.get_timing_metrics("sum").items()})
        metrics["timing/env_steps_per_s"] = metrics["train/env_steps"] / max(metrics["timing/collect"], 1e-9)
        # 8. Validation: greedy, on held-out seeds.
        if g.val_period and self.step_count % g.val_period == 0:
            metrics.update(self.validate())
        self.logger.log_metrics(metrics, step=self.step_count)
        self.history.append({"step": self.step_count} | metrics)
        if self.checkpointer and (self.step_count % cfg.checkpointing.save_period == 0 or self.stop_reason):
            self.save_checkpoint(metrics)
        return metrics

    def _collect_groups(self) -> tuple[list[list[Trajectory]], dict[str, float]]:
        g, env = self.config.grpo, self.config.env
        seeds = step_seeds(g.seed, self.step_count, g.num_groups_per_step)
        kept: list[list[Trajectory]] = [[] for _ in seeds]
        stats = {"train/dropped_short": 0.0, "train/episodes_failed": 0.0, "train/env_steps": 0.0,
                 "train/refill_rounds": 0.0}
        need = [g.group_size] * len(seeds)
        for round_ in range(g.max_refill_rounds + 1):
            sample_seeds = step_seeds(g.seed + 1, self.step_count, len(seeds), round_)
            jobs = [{"group_id": i, "seed": int(s), "count": n, "sample_seed": int(sample_seeds[i])}
                    for i, (s, n) in enumerate(zip(seeds, need, strict=True)) if n > 0]
            if not jobs:
                break
            stats["train/refill_rounds"] = float(round_)
            for t in self.collectors.collect(jobs):
                stats["train/env_steps"] += t.length
                if t.failed is not None:
                    stats["train/episodes_failed"] += 1
                    self._last_error = self._last_error or t.failed
                elif t.length < env.min_trajectory_length:
                    stats["train/dropped_short"] += 1
                else:
                    kept[t.group_id].append(t)
            need = [g.group_size - len(k) for k in kept]
        self.env_steps += int(stats["train/env_steps"])
        complete = [k for k in kept if len(k) == g.group_size]
        stats["train/groups_complete"] = float(len(complete))
        stats["train/groups_incomplete"] = float(len(kept) - len(complete))
        return complete, stats

    def _gae(self, batch: _Batch, trajs: list[Trajectory]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Per-step advantages [B, T] and ``{"values": V_old, "returns": R}`` [B, T] for the value term.

        The value past an episode's last step is 0 when it terminated. When it was truncated (time
        limit, the collector's step cap) the episode would have gone on, so, as SB3 does, it is
        bootstrapped with V(final observation), which the collector keeps as ``final_obs`` for
        truncated episodes only. Without it (a trajectory built elsewhere) the value past the end is 0,
        which treats the time limit as an end."""
        g = self.config.grpo
        mask = batch.mask()
        with torch.no_grad():
            values = batch.pad(self.net(batch.obs)[1].float())
            bootstrap = torch.zeros(len(trajs))
            finals = [(i, t.final_obs) for i, t in enumerate(trajs)
                      if t.truncated and not t.terminated and t.final_obs is not None]
            if finals:
                rows = torch.tensor([i for i, _ in finals])
                bootstrap[rows] = self.net(obs_to_tensor([o for _, o in finals]))[1].float()
        adv, returns = trajectory_gae(batch.rewards, values, mask, bootstrap, gamma=g.gamma, lam=g.lam,
                                      whiten=g.whiten_advantages)
        return adv.float(), {"values": values, "returns": returns.float()}

    @staticmethod
    def _critic_stats(batch: _Batch, critic: dict[str, torch.Tensor]) -> dict[str, float]:
        """The value head before this update against the returns it is trained toward, over real steps."""
        mask = batch.mask()
        return {"critic/vf_explained_var": explained_variance(critic["values"], critic["returns"], mask),
                "critic/values_mean": float(masked_mean(critic["values"], mask)),
                "critic/returns_mean": float(masked_mean(critic["returns"], mask))}

    def _fixed_logprobs(self, batch: _Batch) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        with torch.no_grad():
            if self.ref_net is not None:
                out["reference_policy_logprobs"] = batch.pad(policy_logprobs(self.ref_net, batch.obs, batch.actions)[0])
            if self.config.loss_fn["name"] != "trajectory_pg":
                out["prev_logprobs"] = batch.pad(policy_logprobs(self.net, batch.obs, batch.actions)[0])
                # A loss that always reads a reference (clipped_pg) but whose KL coefficient is 0 (no
                # reference network then) gets these: the term is multiplied by 0 anyway.
                out.setdefault("reference_policy_logprobs", out["prev_logprobs"])
        return out

    def _train(self, batch: _Batch, adv: torch.Tensor, fixed: dict[str, torch.Tensor], n_groups: int,
               critic: dict[str, torch.Tensor] | None = None) -> dict[str, float]:
        g, k = self.config.grpo, self.config.grpo.group_size
        value_cfg = self.config.value_loss() if critic is not None else None
        sums: dict[str, float] = {}
        critic_sums: dict[str, float] = {}
        n_updates = 0
        first_mismatch = None
        for epoch in range(g.update_epochs):
            order = torch.randperm(n_groups, generator=torch.Generator().manual_seed(g.seed * 7919 + self.step_count * 31 + epoch))
            # Fewer complete groups than minibatches (groups were dropped): one group per minibatch.
            for chunk in torch.tensor_split(order, min(g.num_minibatches, n_groups)):
                rows = (chunk[:, None] * k + torch.arange(k)[None, :]).flatten()
                steps, _, _ = batch.select(rows)
                lp, ent, value = policy_forward(self.net, obs_index(batch.obs, steps), batch.actions[steps])
                curr = batch.pad(lp, rows)
                mask = batch.mask(rows)
                width = curr.shape[1]
                gen = batch.gen_logprobs[rows][:, :width]
                if first_mismatch is None:  # the collectors acted with these very weights: ~0
                    first_mismatch = float(((curr.detach() - gen).abs() * mask).sum() / mask.sum())
                mb_adv = adv[rows] if adv.dim() == 1 else adv[rows][:, :width]
                data = {"advantages": mb_adv, "token_mask": mask, "generation_logprobs": gen,
                        "entropy": batch.pad(ent, rows),
                        **{name: v[rows][:, :width] for name, v in fixed.items()}}
                loss, m = self.loss_fn(curr, data, float(len(rows)), float(mask.sum()))
                if critic is not None and value_cfg is not None:  # one backward pass through the shared trunk
                    vf_loss, vm = value_loss_term(batch.pad(value.float(), rows), critic["values"][rows][:, :width],
                                                  critic["returns"][rows][:, :width], mask, value_cfg)
                    loss = loss + vf_loss
                    for name, v in vm.items():
                        critic_sums[name] = critic_sums.get(name, 0.0) + v
                self.optimizer.zero_grad(set_to_none=True)
                loss.backward()
                max_norm = self.config.policy.max_grad_norm
                grad_norm = nn.utils.clip_grad_norm_(self.net.parameters(), max_norm if max_norm else float("inf"))
                self.optimizer.step()
                n_updates += 1
                m["grad_norm"] = float(grad_norm)
                for name, v in m.items():
                    if name not in ("num_valid_seqs", "num_valid_tokens"):
                        sums[name] = sums.get(name, 0.0) + float(v)
        out = {f"train/{name}": v / n_updates for name, v in sums.items()}
        out.update({f"critic/{name}": v / n_updates for name, v in critic_sums.items()})
        out["train/logprob_mismatch"] = first_mismatch or 0.0
        out["train/optimizer_steps"] = float(n_updates)
        return out

    def _train_stats(self, groups: list[list[Trajectory]], adv: torch.Tensor, batch: _Batch) -> dict[str, float]:
        trajs = [t for grp in groups for t in grp]
        adv_abs = adv.abs().mean() if adv.dim() == 1 else masked_mean(adv.abs(), batch.mask())
        returns = np.array([t.ret for t in trajs])
        flat = sum(1 for grp in groups if len({t.ret for t in grp}) == 1)
        return {"train/return_mean": float(returns.mean()), "train/return_max": float(returns.max()),
                "train/return_min": float(returns.min()),
                "train/episode_length_mean": float(np.mean([t.length for t in trajs])),
                "train/advantage_abs_mean": float(adv_abs),
                "train/zero_std_groups": float(flat),
                "train/policy_version_lag": float(self.step_count - min(t.policy_version for t in trajs))}

    def sync_weights(self) -> float:
        """The collectors get the current weights, unless they have them already; the bytes sent."""
        if self.collectors.version == self.step_count:
            return 0.0
        return self.collectors.push_weights(self.net.state_dict(), self.step_count)

    def validate(self, log: bool = False) -> dict[str, float]:
        """Greedy episodes on ``grpo.val_episodes`` held-out seeds with the current weights."""
        g = self.config.grpo
        self.sync_weights()
        jobs = [{"group_id": i, "seed": VAL_SEED_BASE + i, "count": 1, "sample_seed": 0} for i in range(g.val_episodes)]
        trajs = [t for t in self.collectors.collect(jobs, greedy=True) if t.failed is None]
        returns = np.array([t.ret for t in trajs]) if trajs else np.array([np.nan])
        out = {"val/return_mean": float(returns.mean()), "val/return_std": float(returns.std()),
               "val/episode_length_mean": float(np.mean([t.length for t in trajs])) if trajs else float("nan"),
               "val/episodes_failed": float(g.val_episodes - len(trajs))}
        self.last_val_metrics, self.last_val_step = out, self.step_count
        if self.first_val_return is None:
            self.first_val_return = out["val/return_mean"]
        if g.target_val_return is not None and out["val/return_mean"] >= g.target_val_return:
            self.reached_target = True
        if log:
            self.logger.log_metrics(out, step=self.step_count)
            self.history.append({"step": self.step_count} | out)
        return out

    # ---- checkpoints -------------------------------------------------------------------------------
    def save_checkpoint(self, metrics: dict[str, float] | None = None) -> Path | None:
        if self.checkpointer is None:
            return None
        info = ranked_training_info(self.step_count, self.last_val_metrics, self.last_val_step, metrics)
        tmp = self.checkpointer.init_tmp_checkpoint(self.step_count, info)
        torch.save({"net": self.net.state_dict(), "optimizer": self.optimizer.state_dict(),
                    "ref": self.ref_net.state_dict() if self.ref_net is not None else None}, tmp / AGENT_FILE)
        (tmp / "run_config.json").write_text(json.dumps(self.config.model_dump(mode="json"), indent=1))
        save_train_state(tmp, {"step": self.step_count, "env_steps": self.env_steps,
                               "last_val_metrics": self.last_val_metrics,
                               "first_val_return": self.first_val_return, "empty_steps": self._empty_steps})
        return self.checkpointer.finalize_checkpoint(tmp)

    def load_checkpoint(self, path: str | Path) -> None:
        path = Path(path)
        state = load_train_state(path)  # every file is checked against the manifest first
        agent = torch.load(path / AGENT_FILE, weights_only=True, map_location="cpu")
        self.net.load_state_dict(agent["net"])
        self.optimizer.load_state_dict(agent["optimizer"])
        if self.ref_net is not None:
            self.ref_net.load_state_dict(agent["ref"] if agent["ref"] is not None else agent["net"])
        self.step_count, self.env_steps = int(state["step"]), int(state["env_steps"])
        self.last_val_metrics = dict(state["last_val_metrics"])
        self.first_val_return = state["first_val_return"]
        self._empty_steps = int(state["empty_steps"])
        # A run that had reached its target (and stopped) stays done when it is resumed as it was.
        target, last = self.config.grpo.target_val_return, self.last_val_metrics.get("val/return_mean")
        self.reached_target = target is not None and last is not None and last >= target

    def close(self) -> None:
        self.logger.close()
        while self._resources:
            res = self._resources.pop()
            try:
                res()
            except Exception as e:  # closing must free everything it can
                print(f"[nemo_like] while closing: {e!r}")
        if self.checkpointer is not None:
            self.checkpointer.release_lock()


def gym_grpo_train(trainer: GymGRPOTrainer, max_steps: int | None = None) -> list[dict[str, float]]:
    """Validation at start, ``step()`` until ``grpo.max_num_steps`` (or ``max_steps`` more), the
    target return or a stop; validation and a checkpoint at the end."""
    g = trainer.config.grpo
    total = g.max_num_steps if max_steps is None else trainer.step_count + max_steps
    if g.val_at_start and trainer.step_count == 0 and not trainer.history:
        trainer.validate(log=True)
    results: list[dict[str, float]] = []
    with progress_bar(total=total, initial=trainer.step_count, desc="GRPO", unit="update") as bar:
        while trainer.step_count < total and not trainer.stop_reason and not trainer.reached_target:
            m = trainer.step()
            results.append(m)
            bar.update(1)
            bar.set_postfix({"return": f"{m.get('train/return_mean', float('nan')):.1f}",
                             "val": f"{trainer.last_val_metrics.get('val/return_mean', float('nan')):.1f}"})
    last_validated = g.val_period and trainer.step_count % g.val_period == 0
    if g.val_at_end and results and not last_validated:
        trainer.validate(log=True)
    if trainer.checkpointer and results and trainer.step_count % trainer.config.checkpointing.save_period \
            and not trainer.stop_reason:
        trainer.save_checkpoint(results[-1])
    return results
