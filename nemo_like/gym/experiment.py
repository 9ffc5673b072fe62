"""`GymGRPOExperiment`: trajectory-level GRPO on a step environment, driven from a notebook.

    exp = GymGRPOExperiment.from_config("examples/configs/grpo_cartpole.yaml", overrides=["grpo.group_size=16"])
    exp.validate(); exp.train(steps=20); exp.step()
    exp.metrics; exp.plot(["train/return_mean", "val/return_mean"]); exp.rollout(seed=3)
    exp.save(); exp2 = GymGRPOExperiment.resume(exp.checkpoint_dir)
    exp.close()   # or `with GymGRPOExperiment(...) as exp:`

The same shape as `GRPOExperiment` for language models: it wraps the `GymGRPOTrainer` the CLI uses,
keeps Ray and the collector actors alive between calls and frees them on `close()`. Building a new
experiment closes any gym experiment still open in this process first (re-running a notebook cell
neither leaks actors nor waits for the CPUs the old collectors hold; a language-model
experiment is closed too, and the other way round).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from nemo_like.config import apply_overrides
from nemo_like.experiment import LiveExperiment, close_open_experiments, track_open_experiment
from nemo_like.gym.agent import obs_to_tensor
from nemo_like.gym.config import GYM_SELECTING, GymMasterConfig, load_gym_config, validate_gym_config
from nemo_like.gym.setup import setup_gym
from nemo_like.gym.trainer import GymGRPOTrainer, gym_grpo_train
from nemo_like.utils.plotting import plot_metrics, save_training_curves

__all__ = ["GymGRPOExperiment", "GYM_CURVES"]

GYM_CURVES = ("train/return_mean", "val/return_mean", "train/episode_length_mean")


def _to_config(config: GymMasterConfig | str | Path | dict, overrides: Sequence[str] | None) -> GymMasterConfig:
    overrides = list(overrides or [])
    if isinstance(config, (str, Path)):
        return load_gym_config(config, overrides)
    if isinstance(config, GymMasterConfig):
        if not overrides:
            return config.model_copy(deep=True)
        config = config.model_dump(mode="json")
    if isinstance(config, dict):
        return validate_gym_config(apply_overrides(dict(config), overrides, schema=GymMasterConfig,
                                                   selecting=GYM_SELECTING))
    raise TypeError(f"config must be a YAML path, a dict or a GymMasterConfig, got {type(config).__name__}")


class GymGRPOExperiment(LiveExperiment):
    """A live trajectory-level GRPO run: Ray and the collector actors stay up between calls."""

    def __init__(self, config: GymMasterConfig | str | Path | dict, overrides: Sequence[str] | None = None, *,
                 resume: bool | None = None) -> None:
        cfg = _to_config(config, overrides)
        close_open_experiments()  # of either kind: the old one's collectors or workers hold the CPUs
        self.closed = False
        self.trainer: GymGRPOTrainer = setup_gym(cfg, resume=resume)
        track_open_experiment(self)

    # ---- training ----------------------------------------------------------------------------------
    def step(self) -> dict[str, float]:
        """One update (collect groups, train); its metrics, validation included on ``val_period``."""
        self._check_open()
        return self.trainer.step()

    def train(self, steps: int | None = None) -> list[dict[str, float]]:
        """Until ``grpo.max_num_steps`` (or ``steps`` more updates), the target return or a stop."""
        self._check_open()
        return gym_grpo_train(self.trainer, max_steps=steps)

    def validate(self) -> dict[str, float]:
        """Greedy episodes on the held-out seeds now (logged at the current step)."""
        self._check_open()
        return self.trainer.validate(log=True)

    @torch.no_grad()
    def act(self, observations: Sequence[Any], greedy: bool = True) -> list[int]:
        """The policy's actions for a list of observations (as the environment returns them)."""
        logits, _ = self.trainer.net(obs_to_tensor(list(observations)))
        if greedy:
            return logits.argmax(-1).tolist()
        return torch.distributions.Categorical(logits=logits).sample().tolist()

    def rollout(self, seed: int = 0, greedy: bool = True) -> dict[str, Any]:
        """One episode from ``seed`` on a collector with the current weights: return, length, actions,
        rewards (for a look at what the agent does)."""
        self._check_open()
        tr = self.trainer
        tr.sync_weights()
        (t,) = tr.collectors.collect([{"group_id": 0, "seed": int(seed), "count": 1, "sample_seed": int(seed)}],
                                     greedy=greedy)
        return {"return": t.ret, "length": t.length, "actions": t.actions.tolist(),
                "rewards": t.rewards.tolist(), "terminated": t.terminated, "truncated": t.truncated,
                "failed": t.failed}

    # ---- looking at the run ------------------------------------------------------------------------
    @property
    def config(self) -> GymMasterConfig:
        return self.trainer.config

    @property
    def step_count(self) -> int:
        return self.trainer.step_count

    @property
    def stop_reason(self) -> str | None:
        """Why the run cannot learn (no complete group for grpo.max_empty_steps updates), or None."""
        return self.trainer.stop_reason

    @property
    def reached_target(self) -> bool:
        return self.trainer.reached_target

    @property
    def checkpoint_dir(self) -> str:
        return self.config.checkpointing.checkpoint_dir

    @property
    def metrics(self):
        """Every logged step as a pandas DataFrame (one row per step, NaN where not logged)."""
        import pandas as pd

        df = pd.DataFrame(self.trainer.history)
        if df.empty:
            return df
        df = df.groupby("step", as_index=False).last()  # validation rows merge with their step's row
        return df.set_index("step", drop=False)

    def plot(self, keys: Sequence[str] | str = GYM_CURVES):
        return plot_metrics(self.trainer.history, [keys] if isinstance(keys, str) else list(keys))

    def save_plot(self, path: str | Path | None = None) -> Path:
        return save_training_curves(self.trainer.history, path or Path(self.config.logger.log_dir) / "curves.png",
                                    GYM_CURVES)

    def save(self) -> Path:
        """Write a checkpoint now (network, optimizer, reference, step); returns its folder."""
        self._check_open()
        if self.trainer.checkpointer is None:
            raise RuntimeError("checkpointing is disabled (checkpointing.enabled=false)")
        path = self.trainer.save_checkpoint(self.trainer.history[-1] if self.trainer.history else None)
        assert path is not None
        return path

    def returns(self) -> np.ndarray:
        """val/return_mean at every validation so far."""
        return np.array([h["val/return_mean"] for h in self.trainer.history if "val/return_mean" in h])
