"""The CUDA path, where a GPU is: the continuous engine, a training step and a refit on the device.

Skipped without CUDA (CI never has one); ``benchmarks/device/acceptance.sh`` runs this module on the
lent GPU machine. The trainer and the rollout worker share the one GPU there (half each, as Ray
counts it): the object-store refit then goes device -> host -> device, as it would between GPUs.
"""

from __future__ import annotations

import pytest
import torch
from _nl_model_test_helpers import tokenized
from transformers import AutoModelForCausalLM, AutoTokenizer

from nemo_like.algorithms.loss_functions import NLLLossFn
from nemo_like.config_sections import GenerationClusterConfig
from nemo_like.distributed.ray_cluster import RayVirtualCluster
from nemo_like.models.generation.hf_generation import hf_generate
from nemo_like.models.generation.interfaces import GenerationConfig
from nemo_like.models.generation.rollout_group import RolloutGroup
from nemo_like.models.policy import PolicyConfig
from nemo_like.models.policy.lm_policy import Policy

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

PROMPTS = ["12+34=", "1+1=", "999+1=", "7+8=", "5+5=", "40+2="]
TRAIN_TEXTS = ["12+34=46", "1+1=2", "3+4=7", "40+2=42", "5+5=10", "9+9=18", "2+2=4", "6+1=7"]


def test_continuous_engine_equals_generate_on_cuda(model_dir):
    """Greedy tokens equal HF ``generate``'s on the GPU too (float32: bfloat16 would flip near ties)."""
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).to("cuda").eval()
    data = tokenized(tok, PROMPTS)
    outs = {engine: hf_generate(model, tok, data, GenerationConfig(max_new_tokens=8, engine=engine), greedy=True,
                                max_total_length=40, micro_batch_size=4, synced=False, device=torch.device("cuda"))
            for engine in ("generate", "continuous")}
    assert torch.equal(outs["continuous"]["output_ids"], outs["generate"]["output_ids"])
    assert torch.equal(outs["continuous"]["generation_lengths"], outs["generate"]["generation_lengths"])
    torch.testing.assert_close(outs["continuous"]["logprobs"], outs["generate"]["logprobs"], atol=1e-3, rtol=0)


def test_training_step_and_refit_on_one_gpu(ray_session, model_dir):
    """A policy worker trains a step on the GPU; a rollout worker on the same GPU is refit from it:
    checksums equal, greedy outputs equal the policy's own, and the samples carry the version."""
    tok = AutoTokenizer.from_pretrained(model_dir)
    cfg = PolicyConfig(model_name=model_dir, train_global_batch_size=8, train_micro_batch_size=4,
                       logprob_batch_size=4, generation_batch_size=8, max_total_sequence_length=40,
                       optimizer={"lr": 1e-2}, generation={"max_new_tokens": 6, "colocated": False})
    cluster = RayVirtualCluster(1, cpus_per_worker=1, gpus_per_worker=0.5, name="cuda-policy")
    policy = group = None
    try:
        policy = Policy(cluster, cfg, seed=0, init_reference_model=False, name_prefix="cuda-policy")
        data = tokenized(tok, TRAIN_TEXTS)
        data["token_mask"] = (torch.arange(data["input_ids"].shape[1])[None] < data["input_lengths"][:, None]).long()
        data["sample_mask"] = torch.ones(len(TRAIN_TEXTS))
        first = policy.train(data, NLLLossFn())
        second = policy.train(data, NLLLossFn())
        assert second["loss"] < first["loss"]  # lr 1e-2 on the same batch: it must go down
        group = RolloutGroup(cfg, GenerationClusterConfig(num_workers=1, cpus_per_worker=1, gpus_per_worker=0.5),
                             seed=0, name_prefix="cuda-rollout")
        assert group.weights_checksums() != [policy.weights_checksum()]
        metrics = group.update_weights_from(policy, version=2)
        assert metrics["refit/bytes"] > 0
        assert group.weights_checksums() == [policy.weights_checksum()]
        prompts = tokenized(tok, PROMPTS)
        ours, theirs = group.generate(prompts, greedy=True), policy.generate(prompts, greedy=True)
        assert torch.equal(ours["output_ids"], theirs["output_ids"])
        assert ours["policy_version"].tolist() == [2] * len(PROMPTS)
    finally:
        if group is not None:
            group.shutdown()
        if policy is not None:
            policy.shutdown()
        cluster.shutdown()
