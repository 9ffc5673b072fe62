"""GRPO, top to bottom: `setup(config)` builds everything, `GRPOTrainer.step()` is one GRPO step,
`grpo_train(trainer)` is the CLI's loop over it (a notebook drives `step()` itself).

One step: sample prompts -> G completions each -> grade in the task's environment actor ->
group-relative advantages -> previous/reference log-probs -> clipped policy-gradient update.
"""

from __future__ import annotations

import copy
import itertools
import json
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from nemo_like.algorithms.advantages import get_advantage_estimator
from nemo_like.algorithms.async_rollouts import AsyncRolloutRunner
from nemo_like.algorithms.distillation import DistillStage
from nemo_like.algorithms.grpo_loop import grpo_train
from nemo_like.algorithms.grpo_report import (
    accuracy_summary,
    per_task_metrics,
    per_task_summary,
    step_metrics,
    success_hint,
)
from nemo_like.algorithms.grpo_setup import RUN_IDENTITY_FILE, dump_config
from nemo_like.algorithms.guards import CollapseWatch, groups_with_spread, inert_samples, merge_rounds
from nemo_like.algorithms.loss_functions import LossFunction
from nemo_like.algorithms.ppo import PPOStage
from nemo_like.config import MasterConfig
from nemo_like.data.collate import rl_collate_fn
from nemo_like.data.sampler import EpochSampler, MixtureSampler
from nemo_like.distributed.batched_data_dict import BatchedDataDict
from nemo_like.distributed.stall import StallWatch
from nemo_like.environments.registry import step_concurrency
from nemo_like.environments.supervision import FailureWatch, step_timeouts
from nemo_like.experience.agent_rollouts import AgentServer, is_agent_env, rollout_with_agents
from nemo_like.experience.env_waves import EnvTimes
from nemo_like.experience.rollouts import flatten_message_logs, run_multi_turn_rollout, run_split_rollout
from nemo_like.experience.samples import sample_rows
from nemo_like.models.generation.backends import backend_capabilities
from nemo_like.utils.checkpoint import (
    CheckpointManager,
    load_train_state,
    ranked_training_info,
    restore_rng,
    save_train_state,
)
from nemo_like.utils.logger import Logger
from nemo_like.utils.timer import Timer

__all__ = ["GRPOTrainer", "accuracy_summary", "grpo_train", "per_task_metrics", "per_task_summary"]


@dataclass
class GRPOTrainer:
    """Long-lived state of a GRPO run. Build it with `setup(config)`."""

    config: MasterConfig
    policy: Any
    tokenizer: Any
    train_dataset: Any
    val_dataset: Any
    envs: dict[str, Any]
    logger: Logger
    checkpointer: CheckpointManager | None
    sampler: EpochSampler | MixtureSampler
    loss_fn: LossFunction
    step_count: int = 0
    last_val_metrics: dict[str, float] = field(default_factory=dict)
    last_val_step: int = -1  # the step last_val_metrics were measured at
    _moved: bool = False  # this step updated a model (step() then counts it as done if it fails)
    _taken: Any = None  # (step, batch, runner state before) of the async batch this step took
    _retired: list = field(default_factory=list)  # (old environment actor, batches to take before killing it)
    # Per-problem results of the first and the latest validation (task_name, correct), for paired stats.
    first_val_results: dict[str, list] | None = None
    last_val_results: dict[str, list] | None = None
    last_batch: BatchedDataDict | None = None
    last_val_batch: BatchedDataDict | None = None
    history: list[dict[str, float]] = field(default_factory=list)
    _resources: list[Any] = field(default_factory=list)  # shut down in close(), in reverse order
    env_watch: FailureWatch = field(init=False)
    # task -> environment name, for tasks whose grader set_env replaced (its step_timeout_s applies)
    env_names: dict[str, str] = field(default_factory=dict)

    collapse_watch: CollapseWatch = field(init=False)
    stall_watch: StallWatch = field(init=False)  # a step that stops making progress stops the run (grpo.stall_watch)
    # Environment call times per task (grpo.slow_env_first_s): which tasks a turn generates first.
    env_times: EnvTimes | None = field(init=False, default=None)
    stop_reason: str | None = None  # why the run stopped early (a collapse), else None
    # What generates: the policy itself (colocated) or a rollout group that is sent the weights after
    # every update (policy.generation.colocated: false). None: the policy.
    generator: Any = None
    # Async GRPO's producer (grpo.async_rollouts), started at the first step.
    async_rollouts: AsyncRolloutRunner | None = None
    # PPO's parts (algorithms/ppo.py): the critic facade, if any, and the KL-in-reward controller.
    critic: Any = None
    ppo: PPOStage = field(init=False)
    # A reward model's score added to the training samples' rewards (algorithms/rm_reward.py), if any.
    rm_scorer: Any = None
    # The model names as given and the data files' digests (grpo_setup.run_identity): saved with each
    # checkpoint, so a run of another model or data in the same checkpoint_dir is never resumed.
    run_identity: dict[str, Any] | None = None
    # The OpenAI-compatible server agent tasks' programs talk to (experience/agent_rollouts.py), if any.
    agent_server: Any = None
    # On-policy distillation's frozen teacher (a Policy without an optimizer; algorithms/distillation.py).
    teacher: Any = None
    distill: DistillStage = field(init=False)

    def __post_init__(self) -> None:
        task_envs = {d.task_name: d.env_name for d in self.config.data.train_list}
        self.env_watch = FailureWatch(self.config.grpo.max_consecutive_env_failures, {  # agent tasks: most failed
            t: float((self.config.env.get(e) or {}).get("max_failed_fraction", 0.5))
            for t, e in task_envs.items() if is_agent_env(e)}, env_names=task_envs)
        self.collapse_watch = CollapseWatch(self.config.grpo.stop_on_collapse)
        self.stall_watch = StallWatch(**self.config.grpo.stall_watch.model_dump()).start()
        self._resources.insert(0, self.stall_watch.close)
        self.generator = self.generator if self.generator is not None else self.policy
        self.ppo = PPOStage(self.config, self.critic)
        self.distill = DistillStage(self.config.teacher, self.teacher)
        self.loss_fn = self.distill.wrap_loss(self.loss_fn)
        self._local = threading.local()
        s = self.config.grpo.slow_env_first_s
        self.env_times = EnvTimes(s) if s is not None else None  # per task, across steps and validation

    # ---- one GRPO step --------------------------------------------------------------------------
    def step(self) -> dict[str, float]:
        """One GRPO step (phases 1-7 in ``_step``). A step that raises (an error, Ctrl-C in a notebook)
        before any weights moved leaves the trainer as it was: the sampler is put back and an async
        batch is handed back to the runner, so the next ``step()`` trains the same prompts and a save
        in between records none of them as trained. Once the critic or the policy was updated the
        step counts as done (its prompts are not trained twice) and the error is raised."""
        sampler_state = copy.deepcopy(self.sampler.state_dict())
        self._moved, self._taken = False, None
        try:
            with self.stall_watch.phase("step", f"step {self.step_count + 1}"):
                return self._step()
        except BaseException:
            if self._moved:
                self.step_count += 1
            elif self._taken is not None:
                self.async_rollouts.give_back(*self._taken)
            elif self.async_rollouts is None:  # (with async rollouts the runner's threads own the sampler)
                self.sampler.load_state_dict(sampler_state)
            raise

    def _step(self) -> dict[str, float]:
        cfg, timer = self.config, Timer()
        G = cfg.grpo.num_generations_per_prompt
        logprob_eff = None
        with timer.time("total"):
            # 1-2. Prompts, each repeated G times (samples of one prompt share a group id), generated
            # and graded. With dynamic sampling (DAPO) groups whose rewards are all equal are dropped
            # and more prompts drawn, for at most grpo.dynamic_sampling.max_gen_batches rounds.
            # Async GRPO: the batch was drawn, generated and graded ahead by the rollout workers
            # while earlier steps trained, from weights at most grpo.async_rollouts.max_staleness old.
            ds, rounds, keep, async_metrics = cfg.grpo.dynamic_sampling, [], [], {}
            while True:
                if self._async_runner() is not None:
                    with timer.time("wait_for_rollouts"):
                        before = self.async_rollouts.resume_sampler_state({})
                        taken, async_metrics = self.async_rollouts.next_batch(self.step_count)
                        self._taken = (self.step_count, taken, before)
                        self._kill_retired()
                    batch, rollout_metrics, idx = taken.batch, taken.metrics, range(taken.batch.size // G)
                else:
                    with timer.time("data"):
                        idx = self.sampler.next_indices(cfg.grpo.num_prompts_per_step)
                        batch = rl_collate_fn([self.train_dataset[i] for i in idx]).repeat_interleave(G)
                    with timer.time("generation_and_reward"):
                        batch, rollout_metrics = self._rollout(batch, greedy=False)
                        self.generator.finish_generation()
                rounds.append((batch, rollout_metrics))
                keep.append(groups_with_spread(batch["total_reward"], G))
                if not ds.enabled or sum(int(k.sum()) for k in keep) >= len(idx) or len(rounds) >= ds.max_gen_batches:
                    break
            # A task none of whose samples (in any round) could be graded, step after step, stops the run.
            self.env_watch.observe([t for b, _ in rounds for t in b["task_name"]],
                                   [e for b, _ in rounds for e in b["grading_error"]])
            if ds.enabled:
                batch, group_ids, rollout_metrics = merge_rounds(rounds, keep, G, len(idx))
            else:
                group_ids = torch.arange(len(idx)).repeat_interleave(G)
            rewards = batch["total_reward"]
            greedy_rewards = None
            if self.ppo.needs_greedy:  # ReMax: one greedy sample per prompt, graded like the others
                with timer.time("greedy_baseline"):
                    greedy, _ = self._rollout(rl_collate_fn([self.train_dataset[i] for i in idx]), greedy=True)
                    greedy_rewards = greedy["total_reward"].repeat_interleave(G)

            # 3. Training rows (one flat row per sample; only assistant tokens carry loss) and
            # advantages, computed on the driver (cheap, [N]) by the registered estimator. A sample
            # no reward function could score (NaN) gets advantage 0 and stays out of every baseline.
            # PPO (an estimator that needs values or token rewards, or the KL in the reward) computes
            # them in 4b, once the log-probs are known.
            train_data = flatten_message_logs(batch["message_log"], self.tokenizer.pad_token_id)
            scorable = torch.isfinite(rewards)
            advantages = torch.zeros_like(rewards)
            if not self.ppo.active and scorable.any():
                estimator = get_advantage_estimator(cfg.grpo.advantage_estimator)
                advantages[scorable] = estimator(rewards[scorable], group_ids[scorable], config=cfg.grpo,
                                                 token_mask=train_data["token_mask"][scorable])

            # 4. Training data: advantages, sample masks, previous and reference log-probs.
            train_data["sample_mask"] = batch["loss_multiplier"].float()
            if cfg.grpo.overlong_filtering:
                train_data["sample_mask"] *= (~batch["truncated"]).float()
            # Steps behind the trained weights of each sample's generating weights (separate rollout group).
            lag = self.step_count - batch["policy_version"] if "policy_version" in batch else None
            with timer.time("logprobs"):
                # Samples of older weights need the current ones' log-probs: the proximal policy of the
                # decoupled objective (their generation log-probs are the behaviour policy's).
                reused = self.reuse_generation_logprobs() and (lag is None or not bool(lag.any()))
                # Stale samples in a batch that is one optimizer step: the weights about to be updated
                # are the proximal ones, and the training forward pass gives their log-probs itself.
                # (One pass only: a second pass's weights are no longer the proximal ones.)
                proximal_in_train = (not reused and lag is not None and cfg.grpo.ppo_epochs == 1
                                     and train_data.size == cfg.policy.train_global_batch_size)
                if proximal_in_train:
                    train_data["proximal_is_current"] = torch.ones(train_data.size)
                elif reused:
                    # The sampler's own log-probs, from the same weights at the same precision: the
                    # forward pass that would recompute them changes nothing but the time.
                    train_data["prev_logprobs"] = train_data["generation_logprobs"]
                else:
                    lp = self.policy.get_logprobs(train_data)
                    train_data["prev_logprobs"] = lp["logprobs"]
                    if "padding_efficiency" in lp:
                        logprob_eff = float(lp["padding_efficiency"].mean())
                if cfg.loss_fn.reference_policy_kl_penalty > 0 or self.ppo.needs_reference:
                    train_data["reference_policy_logprobs"] = self.policy.get_reference_policy_logprobs(
                        train_data)["reference_logprobs"]
                elif not proximal_in_train:  # KL term is off: skip a forward pass (the loss takes curr's)
                    train_data["reference_policy_logprobs"] = train_data["prev_logprobs"]

            # 4b. PPO: the critic's values, the KL penalty in the reward, the estimator's advantages
            # ([N, T] for token-level ones), then the critic's update on the returns.
            ppo_metrics: dict[str, float] = {}
            if self.ppo.active:
                advantages, extras = self.ppo.advantages(train_data, rewards, group_ids, timer, greedy_rewards)
                ppo_metrics = extras["metrics"]
                if self.critic is not None:
                    self._moved = True
                    ppo_metrics |= self.ppo.update_critic(train_data, extras, timer)
            # 4c. Distillation: the teacher's log-probs of the sampled tokens, whose gap to the student's
            # is each token's advantage (teacher.reward_weight mixes the ones above in), or top-k targets.
            if self.distill.active:
                with timer.time("teacher_logprobs"):
                    advantages, distill_metrics = self.distill.apply(train_data, advantages)
                ppo_metrics |= distill_metrics
            train_data["advantages"] = advantages.float()

            # 5. Policy update, grpo.ppo_epochs passes over the batch: each clips its ratio against
            # the log-probs of 4 (from before the first pass). Samples that cannot move the weights
            # skip the pass (same update). During the critic's warm-up the actor is left as it is.
            warmup = self.ppo.in_warmup(self.step_count)
            if cfg.grpo.skip_inert_samples:
                train_data["skip_pass"] = inert_samples(train_data, self.loss_fn)
            train_metrics, pass_metrics = {}, {}
            if not warmup:
                with timer.time("train"):
                    self.policy.prepare_for_training()
                    self._moved = True
                    for k in range(1, cfg.grpo.ppo_epochs + 1):
                        train_metrics = self.policy.train(train_data, self.loss_fn)
                        if cfg.grpo.ppo_epochs > 1:
                            pass_metrics |= {f"train/pass{k}/{m}": v for m, v in train_metrics.items()}
                    self.policy.finish_training()

            # 6. Weight sync: a separate rollout group gets the new weights (version = optimizer steps).
            # Async: the trainer goes on once they are exported; a rollout worker loads them between
            # two engine steps, and calls sent later wait for them (samples record the version they used).
            refit_metrics = {}
            if self.generator is not self.policy and not warmup:
                with timer.time("weight_sync"):
                    refit_metrics = self.generator.update_weights_from(self.policy, version=self.step_count + 1,
                                                                       wait=self.async_rollouts is None)
                if self.async_rollouts is not None:
                    self.async_rollouts.weights_updated(self.step_count + 1)

        self.step_count += 1
        batch["advantages"] = advantages
        self.last_batch = batch
        metrics = step_metrics(
            cfg, batch, train_data, rewards, advantages, rollout_metrics, timer.get_timing_metrics(),
            train_metrics=train_metrics, pass_metrics=pass_metrics, ppo_metrics=ppo_metrics,
            refit_metrics=refit_metrics, async_metrics=async_metrics, epoch=self.sampler.epoch, warmup=warmup,
            reused=reused, lag=lag, logprob_eff=logprob_eff)

        if cfg.grpo.val_period and self.step_count % cfg.grpo.val_period == 0:
            metrics |= self.validate()
        # Which prompts this step drew (every round), as task:index: metrics.jsonl then says what each
        # step trained, and a resumed run can be checked for prompts skipped or trained twice.
        # (A group's samples are adjacent: one id per run of equal ids, whatever a round dropped.)
        prompt_ids = [f"{t}:{int(i)}" for b, _ in rounds
                      for (t, i), _ in itertools.groupby(zip(b["task_name"], b["idx"], strict=True))]
        self.logger.log_metrics(metrics, step=self.step_count, record={"prompt_ids": prompt_ids})
        if n := self.logger.wants_samples("train"):
            self.logger.log_samples(sample_rows(batch, n), self.step_count, "train")
        self.history.append({"step": self.step_count} | metrics)
        # A collapsed run stops (grpo_train ends, the CLI exits 3), with a checkpoint to look at.
        self.stop_reason = self.collapse_watch.observe(metrics, self.step_count) or self.stop_reason
        if self.checkpointer and (self.step_count % cfg.checkpointing.save_period == 0 or self.stop_reason):
            self.save_checkpoint(metrics)
        return metrics

    def epochs_trained(self) -> int:
        """Full passes over the training data whose prompts were handed to training (async: as of the
        last batch the trainer took, not of the batches generated ahead)."""
        state = self.sampler.state_dict()
        if self.async_rollouts is not None:
            state = self.async_rollouts.resume_sampler_state(state)
        return int(state["epoch"]) if "epoch" in state else min(int(p["epoch"]) for p in state["parts"])

    def reuse_generation_logprobs(self) -> bool:
        """Trust the sampler's log-probs as the old policy's: the same numbers when the sampler is the
        training model at float32 (in-worker HF backend). Recomputed every ``grpo.logprob_check_period``
        steps anyway, so ``train/token_mult_prob_error`` keeps measuring the mismatch. A separate
        backend says whether its numbers are the trainer's (its ``trainer_logprobs`` capability)."""
        g, p = self.config.grpo, self.config.policy
        on = g.reuse_generation_logprobs
        if on == "auto":  # colocated: the training workers' own model samples
            on = p.precision == "float32" and (p.generation.colocated or "trainer_logprobs" in
                                               backend_capabilities(p.generation.backend))
        return bool(on) and not (g.logprob_check_period and self.step_count % g.logprob_check_period == 0)

    def _rollout(self, batch: BatchedDataDict, greedy: bool, generator: Any = None,
                 with_rm: bool = True) -> tuple[BatchedDataDict, dict[str, float]]:
        cfg = self.config
        names = {d.task_name: d.env_name for d in cfg.data.train_list + cfg.data.validation_list} | self.env_names
        task_envs = {t: names.get(t, t) for t in self.envs}
        limits = step_timeouts(cfg.env, task_envs, cfg.grpo.env_step_timeout_s)
        # A fast tokenizer must not be used by two threads at once: each rollout thread has its own.
        if threading.current_thread() is threading.main_thread():
            tokenizer = self.tokenizer
        else:
            tokenizer = getattr(self._local, "tokenizer", None) or copy.deepcopy(self.tokenizer)
            self._local.tokenizer = tokenizer

        def env_rollout(b: BatchedDataDict, tok: Any = tokenizer) -> tuple[BatchedDataDict, dict[str, float]]:
            return run_multi_turn_rollout(
                generator or self.generator, b, tok, self.envs, max_turns=cfg.grpo.max_rollout_turns,
                max_seq_len=cfg.policy.max_total_sequence_length, greedy=greedy, step_timeouts=limits,
                step_concurrency=step_concurrency(task_envs), env_times=self.env_times)

        # Agent tasks (env.agent, env.verifiers): their programs drive generation through the run's OpenAI
        # server; the other tasks' samples roll out beside them.
        batch, metrics = rollout_with_agents(batch, task_envs, self.envs, env_rollout, self._agent_server, tokenizer,
                                             greedy=greedy, max_seq_len=cfg.policy.max_total_sequence_length)
        if with_rm and self.rm_scorer is not None:  # training samples (and ReMax's baseline), not validation
            batch, rm_metrics = self.rm_scorer.apply(batch)
            metrics |= rm_metrics
        return batch, metrics

    def _agent_server(self) -> AgentServer:
        """The run's OpenAI-compatible server for agent programs, started at the first agent rollout."""
        if self.agent_server is None:
            self.agent_server = AgentServer.for_run(self.config, self.generator, self.tokenizer,
                                                    version_fn=lambda: self.step_count)
            self._resources.append(self.agent_server.close)
        return self.agent_server

    def _async_runner(self) -> AsyncRolloutRunner | None:
        """The producer of grpo.async_rollouts, made at the first step (after any resume)."""
        a = self.config.grpo.async_rollouts
        if not a.enabled or self.async_rollouts is not None:
            return self.async_rollouts
        G = self.config.grpo.num_generations_per_prompt

        def draw() -> tuple[BatchedDataDict, dict]:
            idx = self.sampler.next_indices(self.config.grpo.num_prompts_per_step)
            batch = rl_collate_fn([self.train_dataset[i] for i in idx]).repeat_interleave(G)
            return batch, copy.deepcopy(self.sampler.state_dict())

        self.async_rollouts = AsyncRolloutRunner(
            draw=draw, rollout=lambda b: self._rollout(b, greedy=False), max_staleness=a.max_staleness,
            on_stale=a.on_stale, buffer_size=a.buffer_size, start_index=self.step_count,
            weights_version=self.step_count, end_index=self.config.grpo.max_num_steps,
            sampler_state=copy.deepcopy(self.sampler.state_dict()))
        self._resources.append(self.async_rollouts.close)
        return self.async_rollouts

    # ---- validation ------------------------------------------------------------------------------
    def validate(self, log: bool = False) -> dict[str, float]:
        """Greedy accuracy on the held-out set: the share of rewards >= grpo.success_threshold (1.0: right,
        for the built-in graders), with the mean reward beside it."""
        if self.val_dataset is None:
            return {}
        with self.stall_watch.phase("validation", f"the validation at step {self.step_count}"):
            return self._validate(log)

    def _validate(self, log: bool) -> dict[str, float]:
        cap = self.config.grpo.max_val_samples
        # Multi-task: up to max_val_samples of every task, so each task's accuracy is measured.
        idx = (self.val_dataset.first_indices(cap) if hasattr(self.val_dataset, "first_indices")
               else range(min(len(self.val_dataset), cap)))
        n = len(idx)
        t0 = time.perf_counter()
        batch = rl_collate_fn([self.val_dataset[i] for i in idx])
        if self.generator is self.policy:
            batch, m = self._rollout(batch, greedy=True, with_rm=False)
        else:  # the trainer's workers wait for validation anyway: they generate a share of it, beside the
            # rollout workers (shares by worker count: each worker has its own cores)
            batch, m = run_split_rollout(batch, [lambda b: self._rollout(b, True, self.policy, with_rm=False),
                                                 lambda b: self._rollout(b, True, self.generator, with_rm=False)],
                                         [self.policy.world_size, getattr(self.generator, "num_workers", 1)])
            self.policy.finish_generation()
        rewards, threshold = batch["total_reward"], self.config.grpo.success_threshold
        out = {"val/accuracy": float((rewards >= threshold).float().mean()),
               "val/reward_mean": float(rewards.nan_to_num(0.0).mean()),
               "val/response_length_mean": m["response_length_mean"], "val/truncation_rate": m["truncation_rate"],
               "val/turns_per_sample": m["turns_per_sample"],
               "val/num_samples": float(n), "timing/validation": time.perf_counter() - t0}
        if len(set(batch["task_name"])) > 1:
            out |= per_task_metrics(batch, "val", threshold)
        if self.first_val_results is None and (hint := success_hint(rewards, threshold)):
            print(hint)
        self.last_val_metrics, self.last_val_step = out, self.step_count
        self.last_val_results = {"task_name": list(batch["task_name"]), "correct": (rewards >= threshold).tolist()}
        self.last_val_batch = batch
        if (n := self.logger.wants_samples("val")) != 0:
            self.logger.log_samples(sample_rows(batch, n), self.step_count, "val")
        if self.first_val_results is None:
            self.first_val_results = self.last_val_results
        if log:
            self.logger.log_metrics(out, step=self.step_count)
            self.history.append({"step": self.step_count} | out)
        return out

    # ---- checkpoints ----------------------------------------------------------------------------
    def save_checkpoint(self, metrics: dict[str, float] | None = None) -> Path | None:
        if self.checkpointer is None:
            return None
        info = ranked_training_info(self.step_count, self.last_val_metrics, self.last_val_step, metrics)
        tmp = self.checkpointer.init_tmp_checkpoint(self.step_count, info)
        self.policy.save_checkpoint(str(tmp / "policy"))
        if self.critic is not None:
            self.critic.save_checkpoint(str(tmp / "critic"))
        (tmp / "run_config.json").write_text(json.dumps(dump_config(self.config), indent=1))
        if self.run_identity is not None:
            (tmp / RUN_IDENTITY_FILE).write_text(json.dumps(self.run_identity, indent=1))
        # Async: the sampler as of the last trained batch; batches in flight are drawn again on resume.
        sampler = self.sampler.state_dict()
        if self.async_rollouts is not None:
            sampler = self.async_rollouts.resume_sampler_state(sampler)
        save_train_state(tmp, {"step": self.step_count, "sampler": sampler,
                               "last_val_metrics": self.last_val_metrics, "first_val_results": self.first_val_results,
                               "last_val_results": self.last_val_results,
                               "collapse_counts": self.collapse_watch.state_dict(), "ppo": self.ppo.state_dict()})
        return self.checkpointer.finalize_checkpoint(tmp)

    def load_checkpoint(self, path: str | Path) -> None:
        path = Path(path)
        state = load_train_state(path)  # exact or refused: every file is checked against the manifest first
        self.policy.load_checkpoint(str(path / "policy"))
        if self.critic is not None:
            self.critic.load_checkpoint(str(path / "critic"))
        self.ppo.load_state_dict(state.get("ppo"))
        self.step_count = int(state["step"])
        self.sampler.load_state_dict(state["sampler"])
        restore_rng(state["rng"])
        self.last_val_metrics = state["last_val_metrics"]
        self.first_val_results, self.last_val_results = state["first_val_results"], state["last_val_results"]
        self.collapse_watch.load_state_dict(state.get("collapse_counts") or {})

    def set_env(self, task: str, actor: Any, env_name: str | None = None) -> None:
        """Grade ``task`` with ``actor`` (of environment ``env_name``) from the next rollout on; the
        old actor is killed once no batch in flight can still be using it."""
        import ray

        old = self.envs.get(task)
        self.envs[task] = actor
        if env_name is not None:
            self.env_names[task] = env_name
        self._resources.append(lambda a=actor: ray.kill(a, no_restart=True))
        if old is not None and old is not actor:
            # Async batches started before now may still be grading with the old actor: it is killed
            # once the trainer has taken them all (else those steps would train on nothing).
            runner = self.async_rollouts
            self._retired.append((old, runner.batches_started if runner is not None else 0))
            self._kill_retired()

    def _kill_retired(self) -> None:
        import ray

        taken = self.async_rollouts.batches_taken if self.async_rollouts is not None else 0
        for old, until in [r for r in self._retired if r[1] <= taken]:
            self._retired.remove((old, until))
            try:
                ray.kill(old, no_restart=True)
            except Exception:  # already dead: nothing to free
                pass

    def close(self) -> None:
        self.logger.close()
        while self._resources:
            res = self._resources.pop()
            try:
                res()
            except Exception as e:  # closing must free everything it can
                print(f"[nemo_like] while closing: {e!r}")
        if self.checkpointer is not None:  # checkpoint_dir is free for another run from here on
            self.checkpointer.release_lock()
