"""Setting up a gym GRPO run: the checks that need the environment or a checkpoint (a network with a
value head for GAE, a checkpoint of this environment and network), then Ray, the collectors, the
network, its optimizer, the logger and the checkpointer, and the resume. ``setup_gym`` returns the
``GymGRPOTrainer`` (``nemo_like.gym.trainer``) that owns them all until ``close()``.
"""

from __future__ import annotations

import copy
import json
import time
from pathlib import Path
from typing import Any

import ray
import torch
from torch import nn

from nemo_like.algorithms.loss_functions import get_loss_fn
from nemo_like.config import ConfigError
from nemo_like.distributed.ray_cluster import init_ray, shutdown_ray_if_started
from nemo_like.distributed.resource_pools import PLAN_HEADER, PlacementError, place_roles
from nemo_like.environments.supervision import EnvironmentStartError
from nemo_like.gym.agent import ObsBatch, build_network
from nemo_like.gym.collector import CollectorGroup
from nemo_like.gym.config import GYM_ROLES, GymMasterConfig
from nemo_like.gym.step_env import ObsSpec, make_step_env
from nemo_like.gym.trainer import AGENT_FILE, GymGRPOTrainer
from nemo_like.utils.checkpoint import preflight_checkpoints, resume_wanted
from nemo_like.utils.checkpoint_io import CheckpointError
from nemo_like.utils.logger import Logger

__all__ = ["check_gym_resume_compatible", "check_value_head", "setup_gym"]


def _reference_coef(loss_fn: Any) -> float:
    """The KL coefficient of a built loss, by either side's name for it (0 when it has none)."""
    cfg = getattr(loss_fn, "config", None)
    return float(getattr(cfg, "ref_kl_coef", getattr(cfg, "reference_policy_kl_penalty", 0.0)) or 0.0)


def check_gym_resume_compatible(cfg: GymMasterConfig, checkpoint: Path) -> None:
    """ConfigError unless the checkpoint in ``checkpoint`` was written by a run of this environment
    and network (anything else would fail on the weights' shapes, or resume a different run)."""
    path = checkpoint / "run_config.json"
    if not (checkpoint / AGENT_FILE).exists() or not path.exists():
        raise ConfigError(f"checkpointing.checkpoint_dir={cfg.checkpointing.checkpoint_dir}: {checkpoint.name} is not "
                          "a gym GRPO checkpoint (no agent.pt); point checkpoint_dir elsewhere, or set "
                          "checkpointing.resume=false to start over there")
    saved = json.loads(path.read_text())
    now = cfg.model_dump(mode="json")
    keys = [("env", "id"), ("env", "kwargs"), ("env", "max_episode_steps")] + [
        ("policy", k) for k in ("network", "hidden_sizes", "activation", "cnn_channels", "cnn_kernel_size")]
    for section, key in keys:
        old, new = saved.get(section, {}).get(key), now[section][key]
        if old != new:
            raise ConfigError(f"{section}.{key}={new!r} but the checkpoint in checkpointing.checkpoint_dir="
                              f"{cfg.checkpointing.checkpoint_dir} was trained with {old!r}: use that value, "
                              "or start a new run (checkpointing.resume=false there, or another checkpoint_dir)")


def check_value_head(net: nn.Module, spec: ObsSpec, cfg: GymMasterConfig) -> None:
    """ConfigError unless ``net(obs)`` returns a value [N] next to the logits: grpo.advantage_estimator=gae
    trains the value head as its critic."""
    def zeros(shape: tuple[int, ...]) -> torch.Tensor:
        return torch.zeros(2, *shape)

    if spec.image_shape is not None and spec.vector_dim:
        obs: ObsBatch = {"image": zeros(spec.image_shape), "vector": zeros((spec.vector_dim,))}
    else:
        obs = zeros(spec.image_shape) if spec.image_shape is not None else zeros((spec.vector_dim,))
    with torch.no_grad():
        out = net(obs)
    value = out[1] if isinstance(out, tuple) and len(out) == 2 else None
    if not isinstance(value, torch.Tensor) or value.shape != (2,):
        got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise ConfigError(f"grpo.advantage_estimator=gae trains the network's value head, but policy.network="
                          f"{cfg.policy.network!r} returns no value [N] next to its logits (got {got}): use a "
                          "network with a value head (mlp, cnn) or a group-relative grpo.advantage_estimator (mean_std)")


def _wait_for_collector_cpus(cfg: GymMasterConfig) -> None:
    """Without pools: ConfigError unless the collectors' CPUs are free (they would wait forever)."""
    need = cfg.env.num_collectors * cfg.env.cpus_per_collector
    # The CPUs of a run closed just before (a notebook cell run again) come back within moments.
    deadline = time.monotonic() + 10.0
    while (have := ray.available_resources().get("CPU", 0.0)) < need and time.monotonic() < deadline:
        time.sleep(0.2)
    if need > have:
        raise ConfigError(f"env.num_collectors={cfg.env.num_collectors} x env.cpus_per_collector="
                          f"{cfg.env.cpus_per_collector} needs {need:g} CPUs; the Ray cluster has {have:g} free "
                          f"of {ray.cluster_resources().get('CPU', 0.0):g} (lower one of them, e.g. "
                          "env.cpus_per_collector=0.5, or close the run that holds them)")


def setup_gym(config: GymMasterConfig, *, resume: bool | None = None) -> GymGRPOTrainer:
    """Start (or join) Ray, the collectors, the network and its optimizer, the logger and the
    checkpointer; resume from the latest checkpoint in checkpoint_dir."""
    cfg = config.model_copy(deep=True)
    torch.manual_seed(cfg.grpo.seed)
    torch.set_num_threads(cfg.policy.torch_threads)
    try:
        ckpt, latest = preflight_checkpoints(cfg.checkpointing, resume)
    except CheckpointError as e:
        raise ConfigError(str(e)) from None
    if latest is not None:
        check_gym_resume_compatible(cfg, latest)
    # One instance here, before Ray starts: the observation kind is known only from the environment,
    # and a network that does not fit it (or an environment that does not build) fails in a second.
    probe = None
    try:
        probe = make_step_env(cfg.env.id, max_episode_steps=cfg.env.max_episode_steps, **cfg.env.kwargs)
        spec = probe.spec()
    except Exception as e:
        raise EnvironmentStartError(f"step environment {cfg.env.id!r} (env.kwargs={cfg.env.kwargs}, "
                                    f"env.max_episode_steps={cfg.env.max_episode_steps}) did not start: "
                                    f"{type(e).__name__}: {e}") from None
    finally:
        if probe is not None:
            probe.close()
    try:
        net = build_network(spec, cfg.policy, seed=cfg.grpo.seed)
    except ValueError as e:
        raise ConfigError(f"policy.network={cfg.policy.network!r} for {cfg.env.id!r}: {e}") from None
    if cfg.grpo.advantage_estimator == "gae":
        check_value_head(net, spec, cfg)
    loss_fn = get_loss_fn(cfg.loss_fn["name"], cfg.loss_options())
    resources: list[Any] = []

    def free() -> None:
        while resources:
            try:
                resources.pop()()
            except Exception as e:
                print(f"[nemo_like] cleanup: {e!r}")

    cluster = cfg.placement_cluster()  # the language-model run's schema and checks (the config checked it)
    try:
        if init_ray(address=cfg.cluster.address, num_cpus=cfg.cluster.num_cpus):
            resources.append(lambda: shutdown_ray_if_started(True))
        where: dict[str, Any] = {}
        if cluster.resource_pools:
            # Reserved as a GRPO run's roles are: a pool the cluster cannot hold fails here, naming it.
            try:
                plan = place_roles(cluster, list(GYM_ROLES))
            except PlacementError as e:
                raise ConfigError(str(e)) from None
            resources.append(plan.shutdown)
            print(plan.summary(labels=GYM_ROLES))
            where = {"placement": plan["generation"]}
        else:
            _wait_for_collector_cpus(cfg)
            print(f"{PLAN_HEADER}\n  generation ({GYM_ROLES['generation']}) -> no pool ({cfg.env.num_collectors} x "
                  f"{cfg.env.cpus_per_collector:g} CPU, restartable actors Ray places) -> any node with room")
        collectors = CollectorGroup(cfg.env.id, cfg.env.kwargs, cfg.env.max_episode_steps, cfg.policy,
                                    cfg.env.num_collectors, cfg.env.cpus_per_collector, seed=cfg.grpo.seed,
                                    collect_timeout_s=cfg.env.collect_timeout_s, **where)
        resources.append(collectors.close)
        # A frozen reference only when the loss has a KL term (clipped_pg has one by default).
        ref_net = copy.deepcopy(net).requires_grad_(False) if _reference_coef(loss_fn) > 0 else None
        optimizer = torch.optim.Adam(net.parameters(), lr=cfg.policy.learning_rate, eps=cfg.policy.adam_eps)
        logger = Logger(cfg.logger)
        resources.append(logger.close)
        logger.log_hyperparams(cfg)
        trainer = GymGRPOTrainer(config=cfg, collectors=collectors, net=net, optimizer=optimizer, loss_fn=loss_fn,
                                 logger=logger, checkpointer=ckpt, ref_net=ref_net, _resources=resources)
    except BaseException:
        free()
        raise
    try:  # checkpoint_dir is locked until trainer.close()
        latest = ckpt.open_for_run(resume_wanted(cfg.checkpointing, resume)) if ckpt else None
        if latest is not None:
            check_gym_resume_compatible(cfg, latest)  # again: one may have been saved since the preflight
            trainer.load_checkpoint(latest)
            trainer.history = logger.keep_steps_up_to(trainer.step_count)
            print(f"[nemo_like] resumed from {latest} at step {trainer.step_count}")
        else:
            logger.set_aside_previous_rows()
    except BaseException as e:
        trainer.close()
        if isinstance(e, CheckpointError):
            raise ConfigError(str(e)) from None
        raise
    return trainer
