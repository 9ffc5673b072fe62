"""Batching DatumSpecs and flattening message logs into padded token tensors."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from nemo_like.data.interfaces import DatumSpec, LLMMessageLogType
from nemo_like.distributed.batched_data_dict import BatchedDataDict


def rl_collate_fn(batch: list[DatumSpec]) -> BatchedDataDict:
    """Stack DatumSpecs into a BatchedDataDict; message logs stay per-sample lists (ragged)."""
    if not batch:
        raise ValueError("rl_collate_fn got an empty batch")
    missing = [
        (i, key)
        for i, datum in enumerate(batch)
        for key in ("message_log", "length", "loss_multiplier", "extra_env_info", "idx", "task_name")
        if key not in datum
    ]
    if missing:
        i, key = missing[0]
        raise KeyError(f"rl_collate_fn: sample {i} of the batch has no '{key}'")
    return BatchedDataDict(
        message_log=[datum["message_log"] for datum in batch],
        length=torch.tensor([int(datum["length"]) for datum in batch], dtype=torch.long),
        loss_multiplier=torch.tensor([float(datum["loss_multiplier"]) for datum in batch], dtype=torch.float32),
        extra_env_info=[datum["extra_env_info"] for datum in batch],
        task_name=[datum["task_name"] for datum in batch],
        idx=[datum["idx"] for datum in batch],
        stop_strings=[datum.get("stop_strings") for datum in batch],
    )


def _carries_loss(message: Mapping) -> bool:
    return message.get("role") == "assistant" and message.get("loss", True) is not False


def batched_message_log_to_flat_message(
    message_logs: Sequence[LLMMessageLogType],
    pad_value_dict: Mapping[str, int | float] | None = None,
) -> tuple[BatchedDataDict, torch.Tensor]:
    """Concatenate each sample's messages and right-pad the batch.

    Returns ``(flat, input_lengths)``: ``flat["token_ids"]`` is ``[B, T]`` (padded with
    ``pad_value_dict["token_ids"]``, default 0), ``flat["token_loss_mask"]`` is ``[B, T]`` long, 1 exactly on
    tokens of assistant messages not marked ``"loss": False``; ``input_lengths`` is ``[B]`` long.
    Any other 1-D per-token tensor carried by messages (e.g. ``"generation_logprobs"``) is flattened the
    same way; messages lacking it (the prompt) contribute zeros, so it stays aligned with ``token_ids``.
    """
    pad_value_dict = dict(pad_value_dict or {})
    if not message_logs:
        raise ValueError("batched_message_log_to_flat_message got an empty batch")
    token_keys: dict[str, torch.dtype] = {}  # per-token keys in first-seen order, with their dtype
    for b, log in enumerate(message_logs):
        for m, message in enumerate(log):
            ids = message.get("token_ids")
            if not isinstance(ids, torch.Tensor) or ids.dim() != 1:
                got = f"shape {tuple(ids.shape)}" if isinstance(ids, torch.Tensor) else type(ids).__name__
                raise ValueError(
                    f"sample {b}, message {m} (role {message.get('role')!r}): 'token_ids' must be a 1-D "
                    f"tensor, got {got}"
                )
            for key, value in message.items():
                if not isinstance(value, torch.Tensor) or key == "token_loss_mask":
                    continue
                if value.shape != ids.shape:
                    raise ValueError(
                        f"sample {b}, message {m}: '{key}' has shape {tuple(value.shape)} but 'token_ids' has "
                        f"{tuple(ids.shape)}; per-token values must align with the tokens"
                    )
                token_keys.setdefault(key, value.dtype)

    rows: dict[str, list[torch.Tensor]] = {key: [] for key in token_keys}
    masks: list[torch.Tensor] = []
    for log in message_logs:
        for key, dtype in token_keys.items():
            parts = [
                message[key].to(dtype) if key in message else torch.zeros(message["token_ids"].numel(), dtype=dtype)
                for message in log
            ]
            rows[key].append(torch.cat(parts) if parts else torch.zeros(0, dtype=dtype))
        mask_parts = [
            torch.full((message["token_ids"].numel(),), int(_carries_loss(message)), dtype=torch.long)
            for message in log
        ]
        masks.append(torch.cat(mask_parts) if mask_parts else torch.zeros(0, dtype=torch.long))
    if "token_ids" not in rows:  # every log empty
        rows["token_ids"] = [torch.zeros(0, dtype=torch.long) for _ in message_logs]

    input_lengths = torch.tensor([mask.numel() for mask in masks], dtype=torch.long)
    max_len = int(input_lengths.max())

    def pad(seqs: list[torch.Tensor], value: int | float) -> torch.Tensor:
        out = torch.full((len(seqs), max_len), value, dtype=seqs[0].dtype)
        for i, seq in enumerate(seqs):
            out[i, : seq.numel()] = seq
        return out

    flat = BatchedDataDict()
    for key, seqs in rows.items():
        flat[key] = pad(seqs, pad_value_dict.get(key, 0))
    flat["token_loss_mask"] = pad(masks, 0)
    return flat, input_lengths
