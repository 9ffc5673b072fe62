"""The set-up every offline trainer shares (reward model, DPO, SFT): config loading, the batch plan,
the resume check, and one ``OfflineRun`` owning Ray, placement, logger, checkpoints and resume state.

A trainer is its data, its model and its step; everything around them is here::

    cfg = load_trainer_config(MyConfig, path, overrides)          # ConfigError naming the key
    items = load_my_data(cfg.data)                                # data errors before Ray starts
    batches = epoch_batches(len(items), gbs, cfg.trainer.num_epochs, cfg.trainer.seed, cfg.trainer.max_steps)
    plan = {"items": len(items), "global_batch_size": gbs, "seed": cfg.trainer.seed}
    with OfflineRun(cfg.cluster, cfg.checkpointing, cfg.logger, plan, len(batches)) as run:  # preflight, Ray
        model_dir = resolve_my_model(...)            # may build the bootstrapped base (needs the CPUs)
        model = MyModel(run.place({"policy": "the model trained"}), ...)
        run.own(model.shutdown)                      # shut down when the run ends, whatever happens
        state = run.open(cfg, load_weights=lambda p: model.load_checkpoint(str(p / "policy")))
        if state is None:                            # fresh: step-0 evaluation, logged at step 0
            state = {"first": evaluate(model)}; run.logger.log_metrics(state["first"], step=0)
        for step, (epoch, idx) in run.steps(batches):   # skips the steps a resumed run already trained
            metrics = train_one(model, idx)
            run.logger.log_metrics(metrics, step=step)
            run.maybe_save(step, lambda p: model.save_checkpoint(str(p / "policy")), state | {...},
                           val_metrics=last_val, val_step=last_val_step)

``open`` returns the train state saved with the checkpoint resumed from (``run.start_step`` is its
step), or None for a fresh start. A checkpoint saved by a run with another ``plan`` (other batches),
or with more steps than this run has, is refused with a CheckpointError naming both, before Ray starts.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from nemo_like.config import ConfigError, apply_overrides, format_validation_error, load_yaml_with_provenance
from nemo_like.config_sections import ROLES, ClusterConfig
from nemo_like.distributed.ray_cluster import init_ray, shutdown_ray_if_started
from nemo_like.distributed.resource_pools import PlacementError, place_roles, refuse_roles_not_placed
from nemo_like.utils.checkpoint import (
    CheckpointError,
    CheckpointingConfig,
    preflight_checkpoints,
    ranked_training_info,
    resume_wanted,
)
from nemo_like.utils.checkpoint_io import load_train_state, save_train_state
from nemo_like.utils.logger import Logger, LoggerConfig

__all__ = ["OfflineRun", "OfflineTrainerConfig", "check_policy_only_cluster", "check_resumable", "epoch_batches",
           "load_trainer_config", "steps_trained"]

C = TypeVar("C", bound=BaseModel)


def load_trainer_config(schema: type[C], path: str | Path, overrides: list[str] | None = None) -> C:
    """``schema`` validated from the YAML at ``path`` (with its ``defaults:``) and ``key=value``
    overrides; a bad key or value is a ConfigError naming the key and the file it came from."""
    raw, provenance = load_yaml_with_provenance(path, schema, {})
    raw = apply_overrides(raw, list(overrides or []), schema=schema, provenance=provenance)
    try:
        return schema.model_validate(raw)
    except ValidationError as e:
        raise ConfigError(f"invalid config: {format_validation_error(e, provenance)}") from None


class OfflineTrainerConfig(BaseModel):
    """How long an offline trainer trains and how often it evaluates (``trainer:``)."""

    model_config = ConfigDict(extra="forbid")
    # Passes over the training data, each in a new shuffle.
    num_epochs: int = Field(1, gt=0)
    # Steps between held-out evaluations (0: only at the start and the end).
    val_period: int = Field(10, ge=0)
    # Stop after this many optimizer steps (None: every whole global batch of every epoch).
    max_steps: int | None = Field(None, gt=0)
    # Seed of the epochs' shuffles and of the model's initialisation (a new head, LoRA adapters).
    seed: int = 0


# Sections of the language-model run's cluster schema that size workers an offline trainer never starts.
_NO_WORKERS = {"generation": "rollout", "critic": "critic", "reward_model": "reward-model scoring",
               "teacher": "teacher"}


def check_policy_only_cluster(c: ClusterConfig, run: str, labels: dict[str, str], hints: dict[str, str]) -> None:
    """The cluster section of a run whose only workers are the model it trains (the policy role):
    ValueError naming a section that sizes workers it never starts, or a role it does not have
    (``hints``: role -> why it has none, what to write instead)."""
    for section, what in _NO_WORKERS.items():
        if section in c.model_fields_set:
            raise ValueError(f"cluster.{section}: {run} starts no {what} workers; the model it trains is sized by "
                             "cluster.num_workers, cluster.cpus_per_worker and cluster.gpus_per_worker: set those "
                             f"instead of cluster.{section}")
    refuse_roles_not_placed(c.roles, run, labels, hints)
    c.check_roles({r: r == "policy" for r in ROLES}, {})


def steps_trained(resumed_at: int, steps: int) -> str:
    """What a run trained, for its closing line: "60 steps", "steps 31-60 after resuming at step 30"."""
    if not resumed_at:
        return f"{steps} steps"
    if resumed_at == steps:
        return f"no step left to train (resumed at the last one, {steps})"
    return f"steps {resumed_at + 1}-{steps} after resuming at step {resumed_at}"


def epoch_batches(n_items: int, global_batch_size: int, num_epochs: int, seed: int,
                  max_steps: int | None = None) -> list[tuple[int, list[int]]]:
    """(epoch, item indices) of every step: whole global batches of each epoch's shuffle (the
    remainder waits for the next epoch's), the same list on every run with the same arguments, so a
    resumed run goes on with the batches the interrupted one would have drawn; cut at ``max_steps``."""
    rng = random.Random(seed)
    out = []
    for epoch in range(num_epochs):
        order = list(range(n_items))
        rng.shuffle(order)
        out += [(epoch, order[s:s + global_batch_size]) for s in range(0, n_items - global_batch_size + 1,
                                                                        global_batch_size)]
    return out[:max_steps] if max_steps else out


def check_resumable(path: Path, plan: Mapping[str, Any], steps: int) -> dict[str, Any]:
    """The checkpoint's train state, if this run can go on from it: saved with the same ``plan`` (what
    fixes the batches) and no further than this run's ``steps``; else CheckpointError naming both."""
    state = load_train_state(path)
    if state.get("plan") != dict(plan) or state["step"] > steps:
        raise CheckpointError(f"{path} was saved by a run with {state.get('plan')} at step {state['step']}; this run "
                              f"has {dict(plan)} and {steps} steps: it cannot go on from there. Use another "
                              "checkpointing.checkpoint_dir, or the settings it was saved with")
    return state


class OfflineRun:
    """Ray, the placement, the logger and the checkpoint directory of one offline training run.

    Constructing it checks the checkpoint directory (a live run's lock, damaged checkpoints, one this
    run cannot go on from) before anything starts; entering it starts Ray (if not running); leaving it
    releases the lock, closes the logger, shuts down what ``own`` was given (last first), frees the
    placement and stops the Ray it started, also on an error.
    """

    def __init__(self, cluster: ClusterConfig, checkpointing: CheckpointingConfig, logger: LoggerConfig,
                 plan: Mapping[str, Any], num_steps: int, resume: bool | None = None):
        self.cluster, self.checkpointing, self.logger_cfg = cluster, checkpointing, logger
        self.plan, self.num_steps, self._resume = dict(plan), num_steps, resume
        self.ckpt, self._found = preflight_checkpoints(checkpointing, resume)
        self._saved = check_resumable(self._found, self.plan, num_steps) if self._found is not None else None
        self.logger: Logger | None = None
        self.start_step = 0
        self.resumed_from: Path | None = None
        self._placed: Any = None
        self._owned: list[Callable[[], None]] = []
        self._ray_started = False

    def __enter__(self) -> OfflineRun:
        self._ray_started = init_ray(address=self.cluster.address, num_cpus=self.cluster.num_cpus)
        return self

    def place(self, labels: Mapping[str, str]) -> Any:
        """Reserve the roles ``labels`` names (role -> what it is in this run), as a GRPO run's roles
        are placed, and print the plan; returns the first role's placement (what a worker group takes).
        A pool too small is a ConfigError naming it. Call it after a bootstrapped base model is built:
        its SFT needs the CPUs the placement would hold."""
        try:
            self._placed = place_roles(self.cluster, list(labels))
        except PlacementError as e:
            raise ConfigError(str(e)) from None
        print(self._placed.summary(labels=dict(labels)))
        return self._placed[next(iter(labels))]

    def placement(self, role: str) -> Any:
        """Another placed role's placement (after ``place``)."""
        return self._placed[role]

    def own(self, shutdown: Callable[[], None]) -> None:
        """Call ``shutdown`` when the run ends (workers, before their placement is freed)."""
        self._owned.append(shutdown)

    def open(self, hyperparams: Any, load_weights: Callable[[Path], None]) -> dict[str, Any] | None:
        """Start the logger and take the checkpoint directory. Resuming: ``load_weights(checkpoint)``,
        the logger keeps only the rows up to its step, and the saved train state is returned (its
        ``step`` is ``start_step``). Fresh: an earlier run's rows are set aside; returns None."""
        self.logger = Logger(self.logger_cfg)
        latest = (self.ckpt.open_for_run(resume_wanted(self.checkpointing, self._resume))
                  if self.ckpt is not None else None)
        state = None
        if latest is not None:
            # Another run may have saved between the preflight and the lock: that checkpoint is checked too.
            state = self._saved if latest == self._found else check_resumable(latest, self.plan, self.num_steps)
            self.start_step, self.resumed_from = int(state["step"]), latest
            load_weights(latest)
            self.logger.keep_steps_up_to(self.start_step)  # rows the interrupted run logged after its checkpoint
            print(f"[nemo_like] resumed from {latest} at step {self.start_step}")
        else:
            self.logger.set_aside_previous_rows()  # an earlier run's rows in the same log_dir are kept apart
        self.logger.log_hyperparams(hyperparams)
        # What save_train_state adds itself (the format, the RNG states) is not the trainer's to carry on.
        return None if state is None else {k: v for k, v in state.items() if k not in ("format", "rng")}

    def steps(self, batches: list[Any]) -> Iterator[tuple[int, Any]]:
        """(step, batch) from step 1, without the steps trained before the checkpoint resumed from."""
        for step, batch in enumerate(batches, start=1):
            if step > self.start_step:
                yield step, batch

    def is_last(self, step: int) -> bool:
        return step == self.num_steps

    def maybe_save(self, step: int, save_weights: Callable[[Path], None], state: Mapping[str, Any],
                   val_metrics: Mapping[str, Any] | None = None, val_step: int = 0) -> Path | None:
        """A step_<step> checkpoint if checkpointing saves at this step (every ``save_period`` and the
        last): ``save_weights(tmp_dir)``, then ``state`` (plain values: what the run needs to go on,
        with ``step`` and ``plan`` added) as its train state. Ranked by ``val_metrics`` only when they
        are of this step's weights (``val_step == step``). Returns the finalized folder, or None."""
        if self.ckpt is None or not self.ckpt.should_save(step, is_last_step=self.is_last(step)):
            return None
        tmp = self.ckpt.init_tmp_checkpoint(step, ranked_training_info(step, val_metrics, val_step))
        save_weights(tmp)
        save_train_state(tmp, dict(state) | {"step": step, "plan": self.plan})
        return self.ckpt.finalize_checkpoint(tmp)

    def __exit__(self, *exc: Any) -> None:
        try:
            if self.ckpt is not None:
                self.ckpt.release_lock()
            if self.logger is not None:
                self.logger.close()
            for shutdown in reversed(self._owned):
                shutdown()
            if self._placed is not None:
                self._placed.shutdown()
        finally:
            shutdown_ray_if_started(self._ray_started)
