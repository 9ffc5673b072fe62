"""`grpo_train(trainer)`: the CLI's loop over a GRPOTrainer (validation at start, `step()` until the
run's end, validation and a checkpoint at the end); a notebook drives `step()` itself or calls it."""

from __future__ import annotations

import time
from typing import Any

from nemo_like.utils.progress import progress_bar, progress_write

__all__ = ["grpo_train"]


def grpo_train(trainer: Any, max_steps: int | None = None) -> list[dict[str, float]]:
    """The CLI loop: validation at start, `step()` until max_num_steps, validation at the end."""
    cfg = trainer.config.grpo
    total = cfg.max_num_steps if max_steps is None else trainer.step_count + max_steps
    start = trainer.step_count
    began = time.perf_counter()
    if cfg.val_at_start and start == 0:
        trainer.validate(log=True)
        base = trainer.last_val_metrics.get("val/accuracy")
        if base is not None:
            progress_write(f"step 0: val/accuracy = {base:.3f} (base model)")
    results = []
    # A context manager: a run that stops with an error ends the bar's line first, so the error is a line of its own.
    with progress_bar(total=total, initial=start, desc="GRPO", unit="step") as bar:
        while trainer.step_count < total and not trainer.stop_reason:
            if cfg.max_duration_s is not None and time.perf_counter() - began >= cfg.max_duration_s:
                progress_write(f"step {trainer.step_count}: grpo.max_duration_s ({cfg.max_duration_s:g} s) spent, "
                           "no further step")
                break
            if trainer.epochs_trained() >= cfg.max_num_epochs:
                progress_write(f"step {trainer.step_count}: grpo.max_num_epochs ({cfg.max_num_epochs}) passes over the "
                           "training data done, no further step")
                break
            m = trainer.step()
            results.append(m)
            bar.update(1)
            bar.set_postfix(reward=f"{m['train/reward_mean']:.3f}",
                            loss="critic warm-up" if "critic/warmup" in m else f"{m.get('train/loss', float('nan')):.4f}")
    if cfg.val_at_end and not (cfg.val_period and trainer.step_count % cfg.val_period == 0) and results:
        trainer.validate(log=True)
    if (trainer.checkpointer and results and trainer.step_count % trainer.config.checkpointing.save_period
            and not trainer.stop_reason):  # a stopped run saved at its last step already
        trainer.save_checkpoint(results[-1])
    return results
