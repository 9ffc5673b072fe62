"""Reward-model training: Bradley-Terry on preference pairs, on a worker group of its own.

    uv run examples/run_rm.py [--config examples/configs/rm_math_tiny.yaml] [key=value ...]

Each step trains one global batch of pairs; every ``trainer.val_period`` steps and at the end the
held-out pairs are scored: pair accuracy (the chosen side scored higher) and the mean margin. With
``checkpointing.enabled`` the run saves step checkpoints and resumes from the newest one. The result
is saved to ``output_dir`` as a plain HF sequence-classification folder, tokenizer included.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from nemo_like.algorithms.trainer_base import (
    OfflineRun,
    OfflineTrainerConfig,
    check_policy_only_cluster,
    epoch_batches,
    load_trainer_config,
)
from nemo_like.config_sections import ClusterConfig
from nemo_like.data.errors import DataError
from nemo_like.data.preferences import PreferencePair, load_preference_pairs, math_preference_pairs, tokenize_pairs
from nemo_like.distributed.batched_data_dict import BatchedDataDict
from nemo_like.models.reward_model import RewardModelConfig
from nemo_like.utils.checkpoint import CheckpointingConfig
from nemo_like.utils.logger import LoggerConfig

BOOTSTRAP_PREFIX = "bootstrap:"


class MathPairsConfig(BaseModel):
    """Pairs built from the arithmetic task: the right ``\\boxed{}`` answer against a wrong one."""

    model_config = ConfigDict(extra="forbid")
    # "far": any other number; "near": off by one or ten, or two digits swapped (much harder to tell).
    wrong: Literal["far", "near"] = "far"
    # The share of pairs whose rejected side is the right answer made unreadable (a non-digit in it, an
    # empty box, no box) instead of a wrong number: teaches the model what the verifier scores 0.
    malformed: float = Field(0.0, ge=0.0, le=1.0)
    # Pairs built from the train split's problems.
    num_train: int = Field(2000, gt=0)
    # Held-out pairs, built from the validation split's problems.
    num_validation: int = Field(500, gt=0)
    # Seed of the problems and of which wrong answer each pair gets.
    seed: int = 0


class RMDataConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    # JSONL pair files (nemo_like/data/preferences.py has the format); or math_pairs instead.
    train: str | None = None
    # The held-out pair file (needed with train): pair accuracy and margin are measured on it.
    validation: str | None = None
    # Pairs built from the arithmetic task instead of files.
    math_pairs: MathPairsConfig | None = None
    # Tokens per side (prompt and response rendered by the chat template); longer sides are cut, counted.
    max_length: int = Field(64, gt=1)

    @model_validator(mode="after")
    def _one_source(self) -> RMDataConfig:
        if (self.train is None) == (self.math_pairs is None):
            raise ValueError("data: give either data.train (a JSONL pair file) or data.math_pairs, not both or neither")
        if self.train is not None and self.validation is None:
            raise ValueError("data.validation: a JSONL pair file of held-out pairs is needed with data.train")
        return self


class RMTrainerConfig(OfflineTrainerConfig):
    """How long reward-model training trains and how often it scores the held-out pairs."""


# The reward model a reward-model run trains is its policy role: the trainer's workers, sized by
# cluster.num_workers / cpus_per_worker / gpus_per_worker as the policy's are in a GRPO run, so a config
# without pools keeps its meaning and the cluster section is the language-model run's.
RM_ROLES = {"policy": "the reward model trained"}
_OTHER_ROLES = {
    "reward_model": "the reward model this run trains is its policy role (sized by cluster.num_workers, as the "
                    "policy's workers are in a GRPO run): write cluster.roles.policy instead",
    "generation": "nothing generates in reward-model training; remove the key",
    "critic": "there is no value model here; remove the key",
    "reference": "there is no reference model here; remove the key"}


class RMConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    # model_name "bootstrap:<GRPO config>" takes that config's bootstrapped tiny base model.
    reward_model: RewardModelConfig
    # The preference pairs: JSONL files or pairs built from the arithmetic task.
    data: RMDataConfig
    trainer: RMTrainerConfig = RMTrainerConfig()
    # The language-model run's cluster section (docs/reference/config.md, cluster.*): the reward model
    # trained is the policy role (cluster.num_workers...), placeable on cluster.resource_pools with
    # cluster.roles.policy; cluster.generation, .critic and .reward_model have no workers here.
    cluster: ClusterConfig = ClusterConfig()
    logger: LoggerConfig = LoggerConfig(log_dir="logs/rm")
    # step_<N> checkpoints (model, optimizer, where the run is) every save_period steps and at the end;
    # a run resumes from the newest intact one in checkpoint_dir. Ranked by the held-out pair accuracy.
    checkpointing: CheckpointingConfig = CheckpointingConfig(enabled=False, checkpoint_dir="results/rm/checkpoints",
                                                             save_period=50, metric_name="val/pair_accuracy")
    # Where the trained reward model is saved (a plain HF folder).
    output_dir: str = "results/rm"

    @model_validator(mode="after")
    def _placement(self) -> RMConfig:
        """Before Ray starts: the cluster sections and roles this run has, and a batch its workers split."""
        c = self.cluster
        check_policy_only_cluster(c, "reward-model training", RM_ROLES, _OTHER_ROLES)
        gbs = self.reward_model.train_global_batch_size
        if gbs % c.num_workers:
            raise ValueError(f"reward_model.train_global_batch_size={gbs} does not divide over cluster.num_workers="
                             f"{c.num_workers} workers; use a multiple of {c.num_workers}")
        return self


def load_rm_config(path: str | Path, overrides: list[str] | None = None) -> RMConfig:
    """The YAML (with its ``defaults:``) and ``key=value`` overrides, checked: ConfigError naming the key."""
    return load_trainer_config(RMConfig, path, overrides)


def load_pairs(cfg: RMDataConfig) -> tuple[list[PreferencePair], list[PreferencePair]]:
    """The training and held-out pairs of a ``data`` section (files checked line by line, or math pairs)."""
    if cfg.math_pairs is None:
        return load_preference_pairs(cfg.train), load_preference_pairs(cfg.validation)
    from nemo_like.data.datasets import ArithmeticConfig, generate_arithmetic_dataset

    m = cfg.math_pairs

    def rows(split: str, n: int, seed: int) -> list[dict[str, Any]]:
        ds = generate_arithmetic_dataset(ArithmeticConfig(split=split, num_samples=n, seed=seed, min_value=0,
                                                          max_value=99, ops=["+"]))
        return [dict(r) for r in ds]

    return (math_preference_pairs(rows("train", m.num_train, m.seed + 1), seed=m.seed, wrong=m.wrong,
                                  malformed=m.malformed),
            math_preference_pairs(rows("validation", m.num_validation, m.seed + 2), seed=m.seed + 1, wrong=m.wrong,
                                  malformed=m.malformed))


def resolve_model(name: str, key: str = "reward_model.model_name") -> str:
    """``bootstrap:<config>``: that GRPO config's bootstrapped base model (built if not cached); else
    the hub id or folder (errors name ``key``)."""
    if not name.startswith(BOOTSTRAP_PREFIX):
        from nemo_like.models.pretrained import resolve_model_source

        return resolve_model_source(name, key=key)
    from nemo_like.config import load_config
    from nemo_like.models.bootstrap import ensure_base_model

    return ensure_base_model(load_config(name[len(BOOTSTRAP_PREFIX):]))


def evaluate(rm: Any, val: dict[str, torch.Tensor]) -> dict[str, float]:
    scores = rm.score(BatchedDataDict(input_ids=val["input_ids"], input_lengths=val["input_lengths"]))
    margin = scores[0::2] - scores[1::2]
    return {"val/pair_accuracy": float((margin > 0).float().mean()), "val/margin": float(margin.mean()),
            "val/score_mean": float(scores.mean())}


def train_reward_model(cfg: RMConfig) -> dict[str, Any]:
    """The whole run; returns the final held-out metrics, the steps and the saved folder."""
    from transformers import AutoTokenizer

    from nemo_like.models.reward_model import RewardModel

    train_pairs, val_pairs = load_pairs(cfg.data)  # data errors before Ray starts
    gbs = cfg.reward_model.train_global_batch_size
    if len(train_pairs) < gbs:
        raise DataError(f"{len(train_pairs)} training pairs are fewer than one global batch "
                        f"(reward_model.train_global_batch_size={gbs})")
    t = cfg.trainer
    batches = epoch_batches(len(train_pairs), gbs, t.num_epochs, t.seed, t.max_steps)
    # What fixes the order of the batches: a resumed run must go on with the same ones.
    plan = {"pairs": len(train_pairs), "train_global_batch_size": gbs, "seed": t.seed}
    # So is a checkpoint_dir of another run, in use by a live one, with only damaged checkpoints, or
    # with a checkpoint this run cannot go on from (all refused here, before Ray starts).
    with OfflineRun(cfg.cluster, cfg.checkpointing, cfg.logger, plan, len(batches)) as run:
        model_dir = resolve_model(cfg.reward_model.model_name)
        tok = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=cfg.reward_model.trust_remote_code)
        if tok.pad_token_id is None:
            tok.pad_token = tok.eos_token
        train = tokenize_pairs(train_pairs, tok, cfg.data.max_length)
        val = tokenize_pairs(val_pairs, tok, cfg.data.max_length)
        # Placed as a GRPO run's roles are (after the base model is built: its SFT needs the CPUs): a
        # pool too small fails here, naming it, before the model loads; the plan is printed.
        rm = RewardModel(run.place(RM_ROLES), cfg.reward_model.model_copy(update={"model_name": model_dir}),
                         seed=t.seed)
        run.own(rm.shutdown)
        state = run.open(cfg, load_weights=lambda p: rm.load_checkpoint(str(p / "reward_model")))
        if state is not None:
            first, last, last_val = state["first"], state["last"], int(state["last_val"])
        else:
            last_val, first = 0, evaluate(rm, val)
            last = first
            run.logger.log_metrics(first, step=0)
        t0 = time.perf_counter()
        for step, (epoch, pairs) in run.steps(batches):
            rows = [2 * p + k for p in pairs for k in (0, 1)]
            batch = BatchedDataDict(input_ids=train["input_ids"][rows], input_lengths=train["input_lengths"][rows])
            ts = time.perf_counter()
            m = {f"train/{k}": v for k, v in rm.train_pairs(batch).items()}
            m |= {"train/epoch": float(epoch), "timing/train": time.perf_counter() - ts}
            # Held-out pairs every val_period steps and after the last step (inside the loop, so that
            # the last checkpoint holds the final scores and a resumed finished run adds no row).
            if (t.val_period and step % t.val_period == 0) or run.is_last(step):
                last, last_val = evaluate(rm, val), step
                m |= last
            run.logger.log_metrics(m, step=step)
            # Ranked by held-out scores of its own weights only (none if this step was not evaluated).
            run.maybe_save(step, lambda p: rm.save_checkpoint(str(p / "reward_model")),
                           {"first": first, "last": last, "last_val": last_val}, val_metrics=last, val_step=last_val)
        out = Path(cfg.output_dir)
        rm.save(str(out))
        tok.save_pretrained(out)
        return {"first": first, "last": last, "steps": len(batches), "seconds": time.perf_counter() - t0,
                "resumed_at": run.start_step, "output_dir": str(out),
                "truncated_pairs": int(train["truncated"].sum() + val["truncated"].sum()),
                "train_pairs": len(train_pairs), "val_pairs": len(val_pairs)}
