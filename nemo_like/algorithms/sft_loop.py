"""The supervised step loop, through the same Policy/worker code as GRPO: NLL on the assistant's tokens
only. The SFT trainer (``sft.py``) and the tiny model's bootstrap (``models/bootstrap.py``) both train
with :func:`sft_steps`; this module imports neither, so both can import it."""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from nemo_like.algorithms.loss_functions import NLLLossFn
from nemo_like.data.sampler import EpochSampler
from nemo_like.distributed.batched_data_dict import BatchedDataDict
from nemo_like.experience.rollouts import flatten_message_logs
from nemo_like.utils.progress import progress_bar

__all__ = ["sft_batch", "sft_steps", "sft_train", "validation_loss"]


def sft_batch(datums: list[Any], pad_id: int) -> BatchedDataDict:
    """Datums (``message_log``, ``loss_multiplier``) as one padded batch: ``token_mask`` is 1 on the
    assistant's tokens (every assistant turn), ``sample_mask`` the loss multiplier."""
    data = flatten_message_logs([d["message_log"] for d in datums], pad_id)
    data["sample_mask"] = data["input_lengths"].new_tensor([d["loss_multiplier"] for d in datums]).float()
    return data


def sft_steps(policy: Any, batches: Iterable[tuple[int, list[Any]]], *, pad_id: int, global_batch_size: int,
              micro_batch_size: int | None = None,
              after_step: Callable[[int, dict[str, float]], None] | None = None,
              desc: str = "SFT", total: int | None = None) -> list[dict[str, float]]:
    """One optimizer step per (step, datums) of ``batches``: the step's metrics are the policy's
    (``loss`` the global per-token NLL, ``grad_norm``, ``lr``, ...) plus ``num_tokens`` (assistant tokens
    trained) and ``seconds``; ``after_step(step, metrics)`` runs after each (logging, validation,
    checkpoints; what it adds to ``metrics`` is kept). Returns each step's metrics with its ``step``."""
    loss_fn = NLLLossFn()
    history = []
    for step, datums in progress_bar(batches, desc=desc, unit="step", total=total):
        data = sft_batch(datums, pad_id)
        t0 = time.perf_counter()
        metrics = policy.train(data, loss_fn, global_batch_size=global_batch_size, micro_batch_size=micro_batch_size)
        metrics = dict(metrics) | {"seconds": time.perf_counter() - t0,
                                   "num_tokens": float((data["token_mask"] * data["sample_mask"][:, None]).sum())}
        if after_step is not None:
            after_step(step, metrics)  # may add to the step's metrics (the held-out loss)
        history.append({"step": step} | metrics)
    return history


def sft_train(policy: Any, dataset: Any, *, num_steps: int, batch_size: int, micro_batch_size: int | None = None,
              pad_id: int, seed: int = 0, log_fn: Callable[[dict, int], None] | None = None,
              desc: str = "SFT", group_by_length: bool = False, holdout: BatchedDataDict | None = None,
              stop_at_val_loss: float | None = None, val_every: int = 25) -> list[dict[str, float]]:
    """The bootstrap's run: ``num_steps`` steps of :func:`sft_steps` on batches drawn with an
    :class:`EpochSampler` (``dataset[i]`` a DatumSpec whose message_log ends with the assistant answer).

    ``group_by_length``: draw 8 batches at once, sort them by length and serve them in random
    order, so a batch pads to its own (similar) lengths; costs some randomness of batch make-up.
    ``holdout`` (an :func:`sft_batch` of rows not in ``dataset``): its loss is computed every
    ``val_every`` steps (``val/loss`` in that step's metrics) and the run stops after the first at or
    below ``stop_at_val_loss``."""
    batches = _batches(dataset, EpochSampler(len(dataset), seed=seed), batch_size, group_by_length, random.Random(seed))
    reached = False

    def numbered() -> Iterator[tuple[int, list[Any]]]:
        for step in range(1, num_steps + 1):
            if reached:
                return
            yield step, next(batches)

    def after(step: int, metrics: dict[str, float]) -> None:
        nonlocal reached
        if holdout is not None and (step % val_every == 0 or step == num_steps):
            metrics.update(validation_loss(policy, holdout))
            reached = stop_at_val_loss is not None and metrics["val/loss"] <= stop_at_val_loss
        if log_fn is not None:
            log_fn(metrics, step)
    return sft_steps(policy, numbered(), pad_id=pad_id, global_batch_size=batch_size, micro_batch_size=micro_batch_size,
                     after_step=after, desc=desc, total=num_steps)


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


def validation_loss(policy: Any, data: BatchedDataDict, chunk: int = 1024) -> dict[str, float]:
    """``val/loss``: the per-token NLL of the assistant's tokens of ``data`` (an :func:`sft_batch`),
    from ``policy.get_logprobs`` (no gradient, dropout off), in chunks of ``chunk`` conversations."""
    total, tokens = 0.0, 0.0
    for s in range(0, data.size, chunk):
        part = data.slice(s, min(s + chunk, data.size))
        lp = policy.get_logprobs(part)["logprobs"]
        mask = (part["token_mask"] * part["sample_mask"][:, None]).to(lp.dtype)[:, : lp.shape[1]]
        total += float(-(lp * mask).sum())
        tokens += float(mask.sum())
    return {"val/loss": total / tokens if tokens else float("nan"), "val/num_tokens": tokens}

