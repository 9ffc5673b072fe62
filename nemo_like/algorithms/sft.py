"""Supervised fine-tuning through the same Policy/worker code as GRPO, with an NLL loss on
assistant tokens only. Used to bootstrap the tiny default model's answer format."""

from __future__ import annotations

from typing import Any, Callable

from tqdm.auto import tqdm

from nemo_like.utils.logger import progress_interval

from nemo_like.algorithms.loss_functions import NLLLossFn
from nemo_like.data.sampler import EpochSampler
from nemo_like.experience.rollouts import flatten_message_logs


def sft_train(policy: Any, dataset: Any, *, num_steps: int, batch_size: int, micro_batch_size: int | None = None,
              pad_id: int, seed: int = 0, log_fn: Callable[[dict, int], None] | None = None,
              desc: str = "SFT") -> list[dict[str, float]]:
    """`dataset[i]` is a DatumSpec whose message_log ends with the assistant answer."""
    sampler = EpochSampler(len(dataset), seed=seed)
    loss_fn = NLLLossFn()
    history = []
    for step in tqdm(range(1, num_steps + 1), desc=desc, unit="step", dynamic_ncols=True,
                     mininterval=progress_interval()):
        datums = [dataset[i] for i in sampler.next_indices(batch_size)]
        data = flatten_message_logs([d["message_log"] for d in datums], pad_id)
        data["sample_mask"] = data["input_lengths"].new_tensor([d["loss_multiplier"] for d in datums]).float()
        metrics = policy.train(data, loss_fn, global_batch_size=batch_size, micro_batch_size=micro_batch_size)
        history.append({"step": step} | metrics)
        if log_fn:
            log_fn(metrics, step)
    return history
