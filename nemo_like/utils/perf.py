"""Throughput, memory and MFU figures for a GRPO step.

MFU follows the usual convention (PaLM appendix B): a token costs ``6 N`` FLOPs to train (forward
``2 N``, backward ``4 N``, N the non-embedding parameters) plus attention, ``12 L h s`` per token
for L layers, hidden size h and an attended context of s tokens; divided by the time and by the
device's dense bf16 peak. It is an estimate: recomputation under activation checkpointing is not
counted (that is what MFU means, as opposed to hardware FLOPs utilisation).
"""

from __future__ import annotations

import resource
import sys
from typing import Any

import torch

# Dense (no sparsity) bf16 tensor-core peaks, FLOP/s, from the vendors' data sheets.
_PEAK_BF16 = (("H200", 989e12), ("H100", 989e12), ("A100", 312e12), ("L40S", 362e12), ("A10G", 125e12),
              ("L4", 121e12), ("4090", 165e12), ("3090", 71e12))


def device_peak_flops(device_name: str) -> float | None:
    """bf16 peak of a CUDA device by name (``torch.cuda.get_device_name()``); None if unknown."""
    for key, peak in _PEAK_BF16:
        if key in device_name:
            return peak
    return None


def training_flops_per_token(config: Any, n_params: int, context: float) -> float:
    """Model FLOPs to train on one token that attends to ``context`` tokens on average."""
    emb = int(getattr(config, "vocab_size", 0)) * int(getattr(config, "hidden_size", 0))
    tied = bool(getattr(config, "tie_word_embeddings", False))
    # The lm_head matmul is real work; the embedding lookup is not. Tied: the one matrix is counted once.
    dense = n_params - (0 if tied else emb)
    layers = int(getattr(config, "num_hidden_layers", 0))
    hidden = int(getattr(config, "hidden_size", 0))
    return 6.0 * dense + 12.0 * layers * hidden * context


def peak_memory_gb(device: torch.device) -> float:
    """Peak memory of this process: CUDA allocator peak on a GPU, max resident set size on a CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return rss / (2**30 if sys.platform == "darwin" else 2**20)


def throughput_metrics(timings: dict[str, float], train_data: Any, rollout: Any,
                       train_metrics: dict[str, float], train_passes: int = 1) -> dict[str, float]:
    """``perf/*`` of one GRPO step: tokens per second of each phase, peak memory, MFU (GPU).
    ``train_passes``: passes over the batch the train timing covers (grpo.ppo_epochs)."""
    out: dict[str, float] = {}
    gen_tokens = float(rollout["generation_lengths"].sum()) if "generation_lengths" in rollout else 0.0
    seq_tokens = float(train_data["input_lengths"].sum())
    if timings.get("generation", 0) > 0:
        out["perf/generation_tokens_per_s"] = gen_tokens / timings["generation"]
    if timings.get("logprobs", 0) > 0:
        out["perf/logprob_tokens_per_s"] = seq_tokens / timings["logprobs"]
    if timings.get("train", 0) > 0:  # the tokens trained (inert samples skipped are not)
        out["perf/train_tokens_per_s"] = (train_metrics.get("trained_tokens", seq_tokens) * train_passes
                                          / timings["train"])
    for k in ("peak_memory_gb", "mfu"):
        if k in train_metrics:
            out[f"perf/{k}"] = train_metrics[k]
    return out
