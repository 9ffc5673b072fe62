"""Typed config of trajectory-level GRPO on step environments (``examples/configs/grpo_cartpole.yaml``).

Same rules as the language-model config (nemo_like.config): YAML with ``defaults:``, ``key=value``
overrides, unknown keys refused with a did-you-mean, everything checked before Ray starts (the
environment id, the advantage estimator, the loss and its options, the network name).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from nemo_like.algorithms.advantages import ADVANTAGE_ESTIMATORS, estimator_needs, get_advantage_estimator
from nemo_like.algorithms.loss_functions import get_loss_fn
from nemo_like.config import (
    ConfigError,
    Provenance,
    UserImports,
    apply_overrides,
    format_validation_error,
    load_yaml_with_provenance,
    with_imports,
)
from nemo_like.config_sections import ClusterConfig, ResourcePoolConfig
from nemo_like.distributed.resource_pools import refuse_roles_not_placed
from nemo_like.gym.agent import AgentPolicyConfig
from nemo_like.gym.loss import VALUE_LOSS_KEYS, ValueLossConfig
from nemo_like.gym.step_env import check_step_env_name
from nemo_like.utils.checkpoint import CheckpointingConfig
from nemo_like.utils.logger import LoggerConfig
from nemo_like.utils.options import apply_registered_options

__all__ = ["GYM_ROLES", "GymMasterConfig", "load_gym_config", "validate_gym_config"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


def _known(name: str, check: Any) -> str:
    try:
        check(name)
    except KeyError as e:
        raise ValueError(e.args[0] if e.args else str(e)) from None
    return name


class StepEnvConfig(_Strict):
    id: str = "CartPole-v1"  # a registered step environment or a gymnasium id
    kwargs: dict[str, Any] = Field(default_factory=dict)  # passed to the environment's constructor
    max_episode_steps: int | None = Field(None, ge=1)  # None: the environment's own limit
    min_trajectory_length: int = Field(1, ge=1)  # shorter trajectories are dropped before grouping
    # Collector actors that run episodes in parallel, each with its own environment instances.
    num_collectors: int = Field(2, ge=1)
    # Ray CPUs reserved per collector (0.5: two per core); the run refuses to start if they are not free.
    cpus_per_collector: float = Field(1.0, gt=0)
    # A collector whose episodes of one update take longer is killed, restarted and given them again
    # (grpo's collector retries, then the run stops saying why): a simulator that hangs never hangs the run.
    collect_timeout_s: float | None = Field(600.0, gt=0)

    @field_validator("id")
    @classmethod
    def _registered(cls, value: str) -> str:
        return _known(value, check_step_env_name)


class TrajectoryGRPOConfig(BaseModel):
    # "allow": the selected estimator's own options (register_advantage_estimator(..., options=Model)).
    model_config = ConfigDict(extra="allow")

    group_size: int = Field(8, ge=2)  # K trajectories from one reset seed
    # Groups (reset seeds) collected per update: num_groups_per_step x group_size trajectories.
    num_groups_per_step: int = Field(8, ge=1)
    # "mean", "mean_std", "rloo", ...: group-relative, on episode returns. "gae": per step, with the
    # network's value head as the critic (trained by loss_fn.vf_coef's value term), gamma and lam below.
    advantage_estimator: str = "mean_std"
    # Added to the group's std by advantage_estimator mean_std (keeps the division finite).
    adv_eps: float = Field(1e-6, ge=0)
    gamma: float = Field(0.99, ge=0, le=1)  # gae only: discount
    lam: float = Field(0.95, ge=0, le=1)  # gae only: GAE's lambda
    whiten_advantages: bool = True  # gae only: advantages whitened over the batch's real steps
    # Passes over the update's complete groups, each split into num_minibatches optimizer steps.
    update_epochs: int = Field(2, ge=1)
    num_minibatches: int = Field(1, ge=1)  # optimizer steps per epoch (groups are split, never a trajectory)
    ref_sync_every: int = Field(10, ge=1)  # refresh the frozen reference every N updates (if ref_kl_coef > 0)
    max_refill_rounds: int = Field(2, ge=0)  # extra rounds to complete groups that lost trajectories
    # Updates to train (a resumed run continues up to it); target_val_return may stop it sooner.
    max_num_steps: int = Field(200, ge=1)
    val_period: int = Field(5, ge=0)  # 0: validate only at start and end
    val_episodes: int = Field(20, ge=1)  # greedy episodes on held-out seeds
    # Validate the initial policy before the first update (not when a run resumes).
    val_at_start: bool = True
    # Validate after the last update, unless it was just validated (val_period).
    val_at_end: bool = True
    target_val_return: float | None = None  # stop once val/return_mean reaches this
    max_empty_steps: int = Field(5, ge=1)  # consecutive steps without a complete group: the run stops
    # Seeds torch and the network's initial weights, each update's reset and action-sampling seeds, and
    # the minibatch order (validation uses fixed held-out seeds).
    seed: int = 42

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, data: Any) -> Any:
        if isinstance(data, dict) and "advantage" in data:
            raise ValueError("grpo.advantage is now grpo.advantage_estimator (the same key as the language-model "
                             f"trainer's): write grpo.advantage_estimator: {data['advantage']}")
        return data

    @model_validator(mode="after")
    def _options(self) -> TrajectoryGRPOConfig:
        apply_registered_options(self, "grpo", [(ADVANTAGE_ESTIMATORS, self.advantage_estimator)])
        return self

    @field_validator("advantage_estimator")
    @classmethod
    def _estimator(cls, value: str) -> str:
        _known(value, get_advantage_estimator)
        # Inputs the gym trainer can give: episode returns (every group-relative estimator), and for
        # gae per-step rewards and the value head's values. Others (remax's greedy rewards) it cannot.
        if value != "gae" and estimator_needs(value):
            raise ValueError(f"{value!r} needs {', '.join(estimator_needs(value))}, which the gym trainer does "
                             "not provide; use gae or a group-relative estimator (mean, mean_std, rloo, ...)")
        return value


# The collectors are a gym run's Ray workers, its rollout role (``generation``, as a language-model run's
# rollout group): env.num_collectors x env.cpus_per_collector without pools. The network trains in the
# driver process, which Ray does not place: a gym run has no policy or critic workers to put on a pool.
GYM_ROLES = {"generation": "the collectors"}
_DRIVER = ("the network (policy and value head) trains in the driver process, which is not a Ray worker and is "
           "not placed; the collectors are the run's workers: name cluster.roles.generation")
_OTHER_ROLES = {"policy": _DRIVER, "critic": _DRIVER, "reference": _DRIVER,
                "reward_model": "a gym run has no reward model; remove the key"}


class GymClusterConfig(_Strict):
    """The subset of the language-model run's ``cluster`` section a gym run uses (same keys, same
    meaning): the Ray cluster, and pools of machines for its roles."""

    # Ray cluster to join; None: $RAY_ADDRESS, else a new local cluster.
    address: str | None = None
    # CPUs of the local Ray cluster started here; None: every core. Ignored when joining a cluster.
    num_cpus: int | None = Field(None, ge=1)
    # Named pools of machines ({name: {nodes, cpus_per_node, gpus_per_node, node_resource}}) as in the
    # language-model config; empty: Ray places each collector where env.cpus_per_collector CPUs are free.
    resource_pools: dict[str, ResourcePoolConfig] = {}
    # Which pool each role runs on: a gym run has one, generation (the collectors); on a pool
    # env.num_collectors is a multiple of its nodes and the pool sets each collector's CPUs.
    roles: dict[str, str] = {}


class GymMasterConfig(UserImports):
    env: StepEnvConfig = Field(default_factory=StepEnvConfig)
    policy: AgentPolicyConfig = Field(default_factory=AgentPolicyConfig)
    grpo: TrajectoryGRPOConfig = Field(default_factory=TrajectoryGRPOConfig)
    # {name: <registered loss>, ...its options}; trajectory_pg takes ent_coef and ref_kl_coef. With
    # grpo.advantage_estimator=gae also vf_coef and cliprange_value (the value term, added to any policy loss).
    loss_fn: dict[str, Any] = Field(default_factory=lambda: {"name": "trajectory_pg"})
    logger: LoggerConfig = Field(default_factory=LoggerConfig)
    # Its metric_name defaults to val/return_mean here (an agent run logs no val/accuracy).
    checkpointing: CheckpointingConfig = Field(
        default_factory=lambda: CheckpointingConfig(metric_name="val/return_mean"))
    cluster: GymClusterConfig = Field(default_factory=GymClusterConfig)

    @model_validator(mode="before")
    @classmethod
    def _checkpoint_metric(cls, data: Any) -> Any:
        # The language-model default ranks checkpoints by val/accuracy, which an agent run never logs.
        if isinstance(data, dict) and isinstance(data.get("checkpointing"), dict):
            data["checkpointing"].setdefault("metric_name", "val/return_mean")
        return data

    @field_validator("loss_fn")
    @classmethod
    def _loss(cls, value: dict[str, Any]) -> dict[str, Any]:
        # null turns a value-loss key off: the way to undo one inherited from a PPO recipe.
        value = {k: v for k, v in value.items() if not (k in VALUE_LOSS_KEYS and v is None)}
        name = value.setdefault("name", "trajectory_pg")
        try:
            ValueLossConfig.model_validate({k: value[k] for k in VALUE_LOSS_KEYS if k in value})
        except ValidationError as e:
            raise ValueError(format_validation_error(e)) from None
        options = {k: v for k, v in value.items() if k != "name" and k not in VALUE_LOSS_KEYS}
        try:
            get_loss_fn(name, options)
        except KeyError as e:
            raise ValueError(f"name: {e.args[0] if e.args else e}") from None
        except (TypeError, ValueError) as e:
            # Another loss's typed config (clipped_pg) raises pydantic's multi-line report: one line.
            cause = e if isinstance(e, ValidationError) else e.__cause__
            if isinstance(cause, ValidationError):
                raise ValueError(f"options of loss {name!r}: {format_validation_error(cause)}") from None
            raise ValueError(str(e)) from None
        return value

    @model_validator(mode="after")
    def _checks(self) -> GymMasterConfig:
        if self.grpo.num_minibatches > self.grpo.num_groups_per_step:
            raise ValueError(f"grpo.num_minibatches ({self.grpo.num_minibatches}) is more than "
                             f"grpo.num_groups_per_step ({self.grpo.num_groups_per_step}): a minibatch is whole groups")
        if self.grpo.advantage_estimator != "gae" and (keys := [k for k in VALUE_LOSS_KEYS if k in self.loss_fn]):
            # Only GAE gives the value head returns to regress on: the key would be silently ignored.
            raise ValueError(f"loss_fn.{keys[0]} trains the value head, which only grpo.advantage_estimator=gae uses "
                             f"(grpo.advantage_estimator is {self.grpo.advantage_estimator!r}): set loss_fn.{keys[0]}: "
                             "null (or leave it out), or set grpo.advantage_estimator=gae")
        self.placement_cluster()
        return self

    def placement_cluster(self) -> ClusterConfig:
        """The run's placement in the language-model run's cluster schema, checked by its rules (one
        line naming the key): the collectors are the generation role, sized by env.num_collectors."""
        c, env = self.cluster, self.env
        refuse_roles_not_placed(c.roles, "a gym run", GYM_ROLES, _OTHER_ROLES)
        try:
            cluster = ClusterConfig(address=c.address, num_cpus=c.num_cpus, resource_pools=c.resource_pools,
                                    roles=c.roles, generation={"num_workers": env.num_collectors,
                                                               "cpus_per_worker": env.cpus_per_collector})
        except ValidationError as e:  # the pools' and roles' own rules: their message names the key
            raise ValueError(format_validation_error(e)) from None
        pool_name = c.roles.get("generation")
        if pool_name is not None:  # the collectors' size is gym's keys, so checked here under their names
            pool = c.resource_pools[pool_name]
            if pool.gpus_per_node:
                raise ValueError(f"cluster.resource_pools.{pool_name}.gpus_per_node={pool.gpus_per_node}: the collectors "
                                 "run their networks on the CPU, so a GPU would sit idle; use a pool without GPUs")
            if env.num_collectors % pool.nodes:
                raise ValueError(f"env.num_collectors={env.num_collectors} does not spread evenly over pool "
                                 f"{pool_name!r}'s {pool.nodes} nodes; use a multiple of {pool.nodes}")
            share = pool.cpus_per_node * pool.nodes / env.num_collectors
            if "cpus_per_collector" in env.model_fields_set and abs(env.cpus_per_collector - share) > 1e-9:
                raise ValueError(f"env.cpus_per_collector={env.cpus_per_collector:g}: on pool {pool_name!r} each "
                                 f"collector gets {share:g} CPU(s) (cpus_per_node / collectors a node); set "
                                 f"env.cpus_per_collector={share:g}, or cluster.resource_pools.{pool_name}.cpus_per_node="
                                 f"{env.cpus_per_collector * env.num_collectors / pool.nodes:g}")
            # The schema's own checks with the pool's share (a key set to it is no conflict).
            cluster = cluster.model_copy(update={"generation": cluster.generation.model_copy(
                update={"cpus_per_worker": share})})
        cluster.check_roles({"policy": False, "generation": True, "reference": False, "critic": False,
                             "reward_model": False}, {})
        return cluster

    def loss_options(self) -> dict[str, Any]:
        """The options of the policy loss (``loss_fn`` less its name and the value term's keys)."""
        return {k: v for k, v in self.loss_fn.items() if k != "name" and k not in VALUE_LOSS_KEYS}

    def value_loss(self) -> ValueLossConfig | None:
        """The value term's settings when the value head is trained (grpo.advantage_estimator=gae), else None."""
        if self.grpo.advantage_estimator != "gae":
            return None
        return ValueLossConfig.model_validate({k: self.loss_fn[k] for k in VALUE_LOSS_KEYS if k in self.loss_fn})


def validate_gym_config(cfg: dict, provenance: Provenance | None = None) -> GymMasterConfig:
    try:
        return GymMasterConfig.model_validate(cfg)
    except ValidationError as e:
        raise ConfigError(f"invalid config: {format_validation_error(e, provenance)}") from None


# The estimator's options live in grpo beside it (as in the language-model schema): a child that picks
# another estimator drops the parent's options. loss_fn is not listed: its free-form keys (vf_coef,
# cliprange_value) are the loss's whatever its name.
GYM_SELECTING = {"grpo": ("advantage_estimator",)}


def load_gym_config(path: str | Path, overrides: list[str] | None = None) -> GymMasterConfig:
    """The YAML (with its ``defaults:``, selecting keys replacing what they owned) and ``key=value``
    overrides, checked: a ConfigError names the key and the file and line (or command line) it came from."""
    raw, provenance = load_yaml_with_provenance(path, GymMasterConfig, GYM_SELECTING)
    raw, rest = with_imports(raw, list(overrides or []))
    return validate_gym_config(apply_overrides(raw, rest, schema=GymMasterConfig, provenance=provenance,
                                               selecting=GYM_SELECTING), provenance)
