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


@pytest.mark.parametrize("mode", ["static", "graphs"])
def test_fixed_shape_decode_steps_equal_generate_on_cuda(model_dir, mode):
    """``policy.generation.decode_mode`` static (fixed shapes, eager) and graphs (those compiled and
    replayed as CUDA graphs): greedy tokens equal HF ``generate``'s, on a second call too (replayed)."""
    from nemo_like.models.generation.static_decode import static_decoder

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).to("cuda").eval()
    data = tokenized(tok, PROMPTS)

    def run(engine, decode_mode="dynamic"):
        cfg = GenerationConfig(max_new_tokens=8, engine=engine, decode_mode=decode_mode)
        return hf_generate(model, tok, data, cfg, greedy=True, max_total_length=40, micro_batch_size=4,
                           synced=False, device=torch.device("cuda"))

    from torch._dynamo.utils import counters

    ref = run("generate")
    skips = counters["inductor"]["cudagraph_skips"]
    for _ in range(2):
        out = run("continuous", mode)
        assert torch.equal(out["output_ids"], ref["output_ids"])
        assert torch.equal(out["generation_lengths"], ref["generation_lengths"])
        torch.testing.assert_close(out["logprobs"], ref["logprobs"], atol=1e-3, rtol=0)
    assert static_decoder(model, mode).steps >= 14
    assert counters["inductor"]["cudagraph_skips"] == skips  # replayed as CUDA graphs, not quietly eager


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


def critic_and_reward_model_check(model_dir, tmp_path, gpus: float) -> None:
    """The critic and the reward model on the device of ``gpus`` against float32 on the CPU: the
    critic (bf16 mixed precision on the device) gives the CPU's values within bf16 rounding, trains
    (value loss down, finite), and its checkpoint loads on the CPU into the device's values; the reward
    model scores as on the CPU and takes a finite training step. ``gpus=0`` runs the same on the CPU."""
    from nemo_like.distributed.batched_data_dict import BatchedDataDict
    from nemo_like.models.critic import CriticConfig
    from nemo_like.models.critic.critic import Critic
    from nemo_like.models.reward_model import RewardModel, RewardModelConfig

    tok = AutoTokenizer.from_pretrained(model_dir)
    data = tokenized(tok, TRAIN_TEXTS)
    ar = torch.arange(data["input_ids"].shape[1])
    data["token_mask"] = ((ar[None] >= 2) & (ar[None] < data["input_lengths"][:, None])).float()
    pcfg = PolicyConfig(model_name=model_dir, train_global_batch_size=8, train_micro_batch_size=4)
    ccfg = dict(optimizer={"lr": 1e-3}, train_global_batch_size=8, train_micro_batch_size=4, forward_micro_batch_size=4)
    values: dict[str, torch.Tensor] = {}
    for where, g, precision in (("cpu", 0.0, "float32"), ("device", gpus, "bfloat16")):
        cluster = RayVirtualCluster(1, cpus_per_worker=1, gpus_per_worker=g, name=f"critic-{where}")
        try:
            c = Critic(cluster, CriticConfig(**ccfg, precision=precision), pcfg, seed=0, name_prefix=f"critic-{where}")
            try:
                values[where] = c.compute_values(data)["values"]
                if where == "cpu":
                    continue
                returns = torch.where(data["token_mask"] > 0, torch.full_like(values[where], 0.7), torch.zeros_like(values[where]))
                train = BatchedDataDict(input_ids=data["input_ids"], input_lengths=data["input_lengths"],
                                        token_mask=data["token_mask"], values=values[where], returns=returns)
                losses = [c.train(train)["value_loss"] for _ in range(4)]
                assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0], losses
                values["trained"] = c.compute_values(data)["values"]
                c.save_checkpoint(str(tmp_path / "critic"))
            finally:
                c.shutdown()
        finally:
            cluster.shutdown()
    on = data["token_mask"] > 0
    assert (values["device"] - values["cpu"])[on].abs().max() < 0.05  # bf16 compute against float32
    cluster = RayVirtualCluster(1, cpus_per_worker=1, name="critic-reload")
    try:
        c = Critic(cluster, CriticConfig(**ccfg), pcfg, seed=0, name_prefix="critic-reload")
        try:
            c.load_checkpoint(str(tmp_path / "critic"))
            assert (c.compute_values(data)["values"] - values["trained"])[on].abs().max() < 0.05
        finally:
            c.shutdown()
    finally:
        cluster.shutdown()

    scores = {}
    pairs = BatchedDataDict(input_ids=data["input_ids"], input_lengths=data["input_lengths"])  # rows 2i, 2i+1: a pair
    for where, g in (("cpu", 0.0), ("device", gpus)):
        cluster = RayVirtualCluster(1, cpus_per_worker=1, gpus_per_worker=g, name=f"rm-{where}")
        try:
            rm = RewardModel(cluster, RewardModelConfig(model_name=model_dir, train_global_batch_size=4,
                                                        train_micro_batch_size=2), seed=0, name_prefix=f"rm-{where}")
            try:
                scores[where] = rm.score(pairs)
                m = rm.train_pairs(pairs)
                assert m["num_optimizer_steps"] == 1 and torch.isfinite(torch.tensor(m["loss"]))
            finally:
                rm.shutdown()
        finally:
            cluster.shutdown()
    assert (scores["device"] - scores["cpu"]).abs().max() < 1e-3  # float32 on both


def test_critic_and_reward_model_on_one_gpu(ray_session, model_dir, tmp_path):
    critic_and_reward_model_check(model_dir, tmp_path, gpus=0.5)
