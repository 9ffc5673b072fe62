"""perf/* metrics: FLOPs per token against a hand count, device peaks, tokens per second."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from nemo_like.distributed.batched_data_dict import BatchedDataDict
from nemo_like.utils.perf import device_peak_flops, peak_memory_gb, throughput_metrics, training_flops_per_token


def test_training_flops_per_token_counts_dense_weights_and_attention():
    cfg = LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=False)
    n = sum(p.numel() for p in LlamaForCausalLM(cfg).parameters())
    # Untied: the input embedding (100 x 32) is a lookup, not a matmul; the lm_head is.
    assert training_flops_per_token(cfg, n, context=10) == 6 * (n - 3200) + 12 * 2 * 32 * 10
    tied = LlamaConfig(**(cfg.to_dict() | {"tie_word_embeddings": True}))
    n_tied = sum(p.numel() for p in LlamaForCausalLM(tied).parameters())
    assert n_tied == n - 3200
    assert training_flops_per_token(tied, n_tied, context=0) == 6 * n_tied


def test_device_peaks_by_name():
    assert device_peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert device_peak_flops("NVIDIA A100-SXM4-40GB") == 312e12
    assert device_peak_flops("Some Future GPU") is None


def test_throughput_metrics_per_phase():
    train_data = BatchedDataDict(input_lengths=torch.tensor([10, 30]))
    rollout = BatchedDataDict(generation_lengths=torch.tensor([4, 6]))
    out = throughput_metrics({"generation": 0.5, "logprobs": 0.0, "train": 2.0}, train_data, rollout,
                             {"peak_memory_gb": 1.5, "loss": 0.1})
    assert out == {"perf/generation_tokens_per_s": 20.0, "perf/train_tokens_per_s": 20.0,
                   "perf/peak_memory_gb": 1.5}
    assert peak_memory_gb(torch.device("cpu")) > 0.01  # this process holds torch: tens of MB at least
    assert "perf/mfu" not in out and pytest.approx(out["perf/train_tokens_per_s"]) == 20.0
