"""Supervised fine-tuning through the same Policy/worker code as GRPO, with an NLL loss on
assistant tokens only. Used to bootstrap the tiny default model's answer format."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from typing import Any

from nemo_like.algorithms.loss_functions import NLLLossFn
from nemo_like.data.sampler import EpochSampler
from nemo_like.experience.rollouts import flatten_message_logs
from nemo_like.utils.progress import progress_bar


def sft_train(policy: Any, dataset: Any, *, num_steps: int, batch_size: int, micro_batch_size: int | None = None,
              pad_id: int, seed: int = 0, log_fn: Callable[[dict, int], None] | None = None,
              desc: str = "SFT", group_by_length: bool = False) -> list[dict[str, float]]:
    """`dataset[i]` is a DatumSpec whose message_log ends with the assistant answer.

    ``group_by_length``: draw 8 batches at once, sort them by length and serve them in random
    order, so a batch pads to its own (similar) lengths; costs some randomness of batch make-up."""
    sampler = EpochSampler(len(dataset), seed=seed)
    batches = _batches(dataset, sampler, batch_size, group_by_length, random.Random(seed))
    loss_fn = NLLLossFn()
    history = []
    for step in progress_bar(range(1, num_steps + 1), desc=desc, unit="step"):
        datums = next(batches)
        data = flatten_message_logs([d["message_log"] for d in datums], pad_id)
        data["sample_mask"] = data["input_lengths"].new_tensor([d["loss_multiplier"] for d in datums]).float()
        metrics = policy.train(data, loss_fn, global_batch_size=batch_size, micro_batch_size=micro_batch_size)
        history.append({"step": step} | metrics)
        if log_fn:
            log_fn(metrics, step)
    return history


def _batches(dataset: Any, sampler: EpochSampler, batch_size: int, group_by_length: bool,
             rng: random.Random) -> Iterator[list[Any]]:
    while True:
        if not group_by_length:
            yield [dataset[i] for i in sampler.next_indices(batch_size)]
            continue
        pool = sorted((dataset[i] for i in sampler.next_indices(8 * batch_size)), key=lambda d: int(d["length"]))
        chunks = [pool[k:k + batch_size] for k in range(0, len(pool), batch_size)]
        rng.shuffle(chunks)
        yield from chunks
