"""Build a GRPO run: ``setup(config)`` starts (or joins) Ray, checks the environments first, builds the
base model if needed, the datasets, the policy (and critic, and rollout group) workers, the logger and
the checkpointer, and resumes from the newest intact checkpoint. The trainer it returns is
``nemo_like.algorithms.grpo.GRPOTrainer``; ``grpo_train`` there is the loop."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

from nemo_like.algorithms.distillation import teacher_policy_config
from nemo_like.algorithms.grpo import GRPOTrainer
from nemo_like.algorithms.grpo_setup import (
    build_task_dataset,
    check_critic_tokenizer,
    check_prompt_lengths,
    check_resume_compatible,
    check_same_tokenizer,
    env_config,
    make_train_sampler,
    run_identity,
)
from nemo_like.algorithms.loss_functions import get_loss_fn
from nemo_like.config import ConfigError, MasterConfig
from nemo_like.utils.checkpoint import CheckpointError, preflight_checkpoints, resume_wanted
from nemo_like.utils.logger import Logger

__all__ = ["setup"]


def setup(config: MasterConfig, *, resume: bool | None = None) -> GRPOTrainer:
    """Start (or join) Ray, build the base model if needed, datasets, environment actors, the policy
    workers, logger and checkpointer; resume from the latest checkpoint in checkpoint_dir when it is
    this run's. ``resume``: None follows ``checkpointing.resume``; True/False force it (the notebook API)."""
    import ray

    from nemo_like.data.chat_templates import resolve_chat_template
    from nemo_like.data.datasets import load_dataset_from_config
    from nemo_like.distributed.ray_cluster import init_ray, shutdown_ray_if_started
    from nemo_like.distributed.resource_pools import PlacementError, place_roles
    from nemo_like.environments.registry import create_env_actor, registered_envs
    from nemo_like.environments.supervision import wait_for_env_actors
    from nemo_like.models.critic.critic import Critic
    from nemo_like.models.generation.backends import generation_worker_cls
    from nemo_like.models.generation.rollout_group import RolloutGroup
    from nemo_like.models.policy.lm_policy import Policy
    from nemo_like.models.pretrained import resolve_model_source
    from nemo_like.models.tokenizers import load_tokenizer as load_policy_tokenizer

    cfg = config.model_copy(deep=True)
    random.seed(cfg.grpo.seed)
    np.random.seed(cfg.grpo.seed)
    torch.manual_seed(cfg.grpo.seed)
    resources: list[Any] = []
    # Data files are read before Ray starts, so a malformed file fails in a second.
    train_cfgs, val_cfgs = cfg.data.train_list, cfg.data.validation_list
    train_rows = [load_dataset_from_config(c) for c in train_cfgs]
    val_rows = [load_dataset_from_config(c) for c in val_cfgs]
    # So is a checkpoint_dir of a different run, in use by a live one, or with only damaged checkpoints.
    try:
        ckpt, latest = preflight_checkpoints(cfg.checkpointing, resume)
    except CheckpointError as e:
        raise ConfigError(str(e)) from None
    # The model names as the user gave them (cfg's are resolved below) and the data files' digests.
    identity = run_identity(config)
    if latest is not None:
        check_resume_compatible(config, latest, identity)
    for ds_cfg in train_cfgs + val_cfgs:  # and so does a reward function that cannot be imported
        env_config(cfg, ds_cfg)  # or an environment nobody registered
        if ds_cfg.env_name not in registered_envs():
            raise ConfigError(f"data (task {ds_cfg.task_name!r}).env_name: no environment {ds_cfg.env_name!r} is "
                              f"registered; registered: {registered_envs()} (register_env() it before setup)")

    def free() -> None:
        while resources:
            try:
                resources.pop()()
            except Exception as e:
                print(f"[nemo_like] cleanup: {e!r}")

    def load_tokenizer() -> Any:
        try:  # with the template policy.chat_template names; a model without one is refused here
            tok = load_policy_tokenizer(cfg.policy.tokenizer_name or cfg.policy.model_name,
                                        chat_template=cfg.policy.chat_template,
                                        trust_remote_code=cfg.policy.trust_remote_code)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        # Prompts too long for data.max_input_seq_length are cut and carry no loss: counted, and a run
        # where many would be is refused (before Ray starts, unless the model is the bootstrapped one).
        check_prompt_lengths(train_cfgs, train_rows, tok, "train", max_in, cfg.data.max_cut_prompt_frac)
        if val_rows:
            check_prompt_lengths(val_cfgs, val_rows, tok, "validation", max_in, cfg.data.max_cut_prompt_frac)
        return tok

    max_in = cfg.data.max_input_seq_length
    if cfg.policy.chat_template != "default":
        # The template's text, read here: a worker on another node (or in another folder) resolves no
        # relative .jinja path, and what the run trained with is then in its saved config.
        cfg.policy.chat_template = resolve_chat_template(cfg.policy.chat_template)
    bootstrap = cfg.bootstrap is not None and cfg.bootstrap.enabled
    if not bootstrap:  # a gguf: file becomes a normal HF folder once (cached); a hub id or folder stays as is
        cfg.policy.model_name = resolve_model_source(cfg.policy.model_name)
        if cfg.policy.tokenizer_name:
            cfg.policy.tokenizer_name = resolve_model_source(cfg.policy.tokenizer_name)
        tokenizer = load_tokenizer()
    if cfg.critic is not None and cfg.critic.model_name:  # a value model of its own must read the same tokens
        cfg.critic.model_name = resolve_model_source(cfg.critic.model_name, key="critic.model_name")
        check_critic_tokenizer(cfg.critic.model_name, cfg.policy.tokenizer_name or cfg.policy.model_name,
                               cfg.policy.trust_remote_code)
    if cfg.teacher is not None:  # (with the bootstrapped student, once it is built)
        cfg.teacher.model_name = resolve_model_source(cfg.teacher.model_name, key="teacher.model_name")
        if not bootstrap:
            _check_teacher_tokenizer(cfg)
    try:
        if init_ray(address=cfg.cluster.address, num_cpus=cfg.cluster.num_cpus):
            resources.append(lambda: shutdown_ray_if_started(True))
        # The environments first: a constructor that raises (no bubblewrap, a tool that does not import,
        # a service down) fails the run in seconds, naming it, before the model and data are built.
        envs: dict[str, Any] = {}
        for ds_cfg in train_cfgs + val_cfgs:
            if ds_cfg.task_name not in envs:
                actor = create_env_actor(ds_cfg.env_name, env_config(cfg, ds_cfg))
                envs[ds_cfg.task_name] = actor
                resources.append(lambda a=actor: ray.kill(a, no_restart=True))
        wait_for_env_actors(envs, {d.task_name: d.env_name for d in train_cfgs + val_cfgs})
        if bootstrap:
            from nemo_like.models.bootstrap import ensure_base_model

            path = ensure_base_model(cfg)
            cfg.policy.model_name, cfg.policy.tokenizer_name = path, path
            tokenizer = load_tokenizer()
            if cfg.teacher is not None:
                _check_teacher_tokenizer(cfg)
        # Every role's room is reserved before a model loads (a short cluster fails in seconds), and the
        # plan is printed: which pool (or group of its own) each role runs on, and on which nodes.
        roles = cfg.run_roles()  # the reference model has no workers of its own: it lives in the policy's
        try:
            plan = place_roles(cfg.cluster, [r for r, on in roles.items() if on and r != "reference"])
        except PlacementError as e:
            raise ConfigError(str(e)) from None
        resources.append(plan.shutdown)
        print("[nemo_like] placement (role -> pool -> nodes):\n" + "\n".join(
            f"  {line}" for line in plan.describe(reference=roles["reference"])))

        train_ds = build_task_dataset(train_cfgs, train_rows, tokenizer, max_in)
        val_ds = build_task_dataset(val_cfgs, val_rows, tokenizer, max_in) if val_rows else None

        policy = Policy(plan["policy"], cfg.policy, seed=cfg.grpo.seed, init_reference_model=roles["reference"])
        resources.append(policy.shutdown)
        critic = None
        if cfg.critic is not None:  # a value model of its own, on its own workers (cluster.critic)
            critic = Critic(plan["critic"], cfg.critic, cfg.policy, seed=cfg.grpo.seed)
            resources.append(critic.shutdown)
        rm_scorer = None
        if cfg.reward_model is not None:  # a trained reward model on workers of its own (cluster.reward_model)
            rm_scorer = _reward_model_scorer(cfg, plan["reward_model"], resources)
        teacher = None
        if cfg.teacher is not None:  # frozen: log-probs only, on workers of its own (cluster.teacher)
            teacher = Policy(plan["teacher"], teacher_policy_config(cfg.policy, cfg.teacher), seed=cfg.grpo.seed,
                             init_reference_model=False, init_optimizer=False, name_prefix="teacher")
            resources.append(teacher.shutdown)
        generator = policy
        if not cfg.policy.generation.colocated:  # a rollout group of its own, sent the weights after each update
            generator = RolloutGroup(cfg.policy, cfg.cluster.generation, seed=cfg.grpo.seed,
                                     worker_cls=generation_worker_cls(cfg.policy.generation.backend),
                                     cluster=plan["generation"])
            resources.append(generator.shutdown)
        logger = Logger(cfg.logger)
        resources.append(logger.close)
        logger.log_hyperparams(cfg)
    except BaseException:
        free()
        raise

    trainer = GRPOTrainer(config=cfg, policy=policy, tokenizer=tokenizer, train_dataset=train_ds,
                          val_dataset=val_ds, envs=envs, logger=logger, checkpointer=ckpt,
                          sampler=make_train_sampler(train_cfgs, train_ds, cfg.grpo.seed),
                          loss_fn=get_loss_fn(cfg.loss_fn.name, cfg.loss_fn), _resources=resources, critic=critic,
                          generator=generator, rm_scorer=rm_scorer, run_identity=identity, teacher=teacher)
    try:  # checkpoint_dir is locked until trainer.close(); the newest intact checkpoint is resumed
        latest = ckpt.open_for_run(resume_wanted(cfg.checkpointing, resume)) if ckpt else None
        if latest is not None:
            check_resume_compatible(config, latest, identity)
            trainer.load_checkpoint(latest)
            # Rows the crashed run logged after the checkpoint leave metrics.jsonl too: each step once.
            trainer.history = logger.keep_steps_up_to(trainer.step_count)
            print(f"[nemo_like] resumed from {latest} at step {trainer.step_count}")
        else:  # step 0: an earlier run's rows in this log_dir are set aside, not mixed with this run's
            logger.set_aside_previous_rows()
        if generator is not policy:  # the rollout workers start from the trainer's weights, resumed or not
            generator.update_weights_from(policy, version=trainer.step_count)
    except BaseException as e:
        trainer.close()
        if isinstance(e, CheckpointError):
            raise ConfigError(str(e)) from None
        raise
    return trainer


def _check_teacher_tokenizer(cfg: MasterConfig) -> None:
    check_same_tokenizer(cfg.teacher.model_name, cfg.policy.tokenizer_name or cfg.policy.model_name,
                         "teacher.model_name", "distillation compares the two models token by token, so they must "
                         "share a tokenizer (cross-tokenizer distillation is not supported)",
                         cfg.teacher.trust_remote_code)


def _reward_model_scorer(cfg: MasterConfig, cluster: Any, resources: list[Any]) -> Any:
    """The reward model's worker group and the scorer that adds its score to the rewards."""
    from transformers import AutoTokenizer

    from nemo_like.algorithms.rm_reward import RewardModelScorer
    from nemo_like.models.pretrained import resolve_model_source
    from nemo_like.models.reward_model import RewardModel, RewardModelConfig

    r, c = cfg.reward_model, cfg.cluster.reward_model
    model_dir = resolve_model_source(r.model_name, key="reward_model.model_name")
    tok = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=r.trust_remote_code)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    # Scoring only: the training batch sizes just have to divide over the workers.
    rm = RewardModel(cluster, RewardModelConfig(
        model_name=model_dir, trust_remote_code=r.trust_remote_code, train_global_batch_size=c.num_workers,
        train_micro_batch_size=1, forward_micro_batch_size=r.forward_micro_batch_size), seed=cfg.grpo.seed)
    resources.append(rm.shutdown)
    return RewardModelScorer(r, rm, tok)

