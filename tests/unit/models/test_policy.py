"""The Policy facade over 2 real FSDP2/gloo HF workers in a real local Ray cluster."""

from __future__ import annotations

import pytest
import torch
from _nl_model_test_helpers import tokenized
from transformers import AutoModelForCausalLM

from nemo_like.algorithms.loss_functions import NLLLossFn
from nemo_like.distributed.batched_data_dict import BatchedDataDict
from nemo_like.distributed.ray_cluster import RayVirtualCluster
from nemo_like.models.policy import PolicyConfig, SchedulerConfig
from nemo_like.models.policy.hf_worker import token_logprobs
from nemo_like.models.policy.lm_policy import Policy


@pytest.fixture(scope="module")
def cluster(ray_session):
    # The two-rank cluster; the single-worker tests build a third worker beside it.
    c = RayVirtualCluster(2, cpus_per_worker=1)
    yield c
    c.shutdown()


def _cfg(model_dir, **kw) -> PolicyConfig:
    base = dict(model_name=model_dir, train_global_batch_size=8, train_micro_batch_size=2, logprob_batch_size=3,
                generation_batch_size=4, max_total_sequence_length=40, optimizer={"lr": 1e-2},
                generation={"max_new_tokens": 6, "temperature": 1.0})
    return PolicyConfig(**(base | kw))


def _prompts(tok, texts):
    return tokenized(tok, texts)


@pytest.fixture(scope="module")
def policy(cluster, model_dir):
    p = Policy(cluster, _cfg(model_dir), seed=0)
    yield p
    p.shutdown()


def test_generate_logprobs_match_training_logprobs(policy, model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    data = _prompts(tok, ["12+34=", "1+1=", "999+1=", "7+8=", "5+5="])  # 5 rows: padded to 6 over 2 workers
    out = policy.generate(data)
    assert out.size == 5
    assert torch.equal(out["unpadded_sequence_lengths"], data["input_lengths"] + out["generation_lengths"])
    for i in range(5):
        n = int(data["input_lengths"][i])
        assert torch.equal(out["output_ids"][i, :n], data["input_ids"][i, :n])  # prompt kept
        assert (out["logprobs"][i, :n] == 0).all() and (out["logprobs"][i, n:int(out["unpadded_sequence_lengths"][i])] < 0).all()
    # The sampler's log-probs equal a fresh forward pass over the full sequence (the
    # token_mult_prob_error GRPO tracks would be ~1.0).
    lp = policy.get_logprobs(BatchedDataDict(input_ids=out["output_ids"], input_lengths=out["unpadded_sequence_lengths"]))["logprobs"]
    mask = out["logprobs"] != 0
    assert torch.allclose(lp[mask], out["logprobs"][mask], atol=1e-4)
    # ... and equal the plain HF model computed in this process (FSDP sharding is transparent).
    ref = AutoModelForCausalLM.from_pretrained(model_dir)
    ids = out["output_ids"]
    am = (torch.arange(ids.shape[1])[None] < out["unpadded_sequence_lengths"][:, None]).long()
    with torch.no_grad():
        local = token_logprobs(ref, ids, am, 1.0)
    assert torch.allclose(local * am, lp * am, atol=1e-4)
    ref_lp = policy.get_reference_policy_logprobs(BatchedDataDict(input_ids=ids, input_lengths=out["unpadded_sequence_lengths"]))
    assert torch.allclose(ref_lp["reference_logprobs"] * am, lp * am, atol=1e-5)  # no training yet


def test_greedy_is_deterministic(policy, model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    data = _prompts(tok, ["12+34=", "1+1=", "3+4=", "40+2="])
    a, b = policy.generate(data, greedy=True), policy.generate(data, greedy=True)
    assert torch.equal(a["output_ids"], b["output_ids"])


def test_train_rejects_bad_batch(policy):
    data = BatchedDataDict(input_ids=torch.zeros(6, 4, dtype=torch.long), input_lengths=torch.full((6,), 4),
                           token_mask=torch.ones(6, 4), sample_mask=torch.ones(6))
    with pytest.raises(ValueError, match=r"train batch of 6 samples is not a multiple of the global batch size 8"):
        policy.train(data, NLLLossFn())


def test_second_group_on_held_cluster_fails_fast(policy, cluster, model_dir):
    with pytest.raises(RuntimeError, match="bundles are held by worker group 'policy'"):
        Policy(cluster, _cfg(model_dir), seed=0, name_prefix="second")


def test_train_lowers_nll_and_checkpoint_round_trips(policy, cluster, model_dir, tmp_path):
    from transformers import AutoTokenizer

    # The module's policy: the tests before this one only generate and compute log-probs, so its
    # weights, optimizer and reference are still the initial ones (a fresh two-rank group cost ~5 s).
    tok = AutoTokenizer.from_pretrained(model_dir)
    p = policy
    try:
        data = _prompts(tok, ["12+34=46", "1+1=2", "3+4=7", "40+2=42", "5+5=10", "9+9=18", "2+2=4", "6+1=7"])
        data["token_mask"] = (torch.arange(data["input_ids"].shape[1])[None] < data["input_lengths"][:, None]).long()
        data["sample_mask"] = torch.ones(8)
        before = p.train(data, NLLLossFn())
        for _ in range(15):
            after = p.train(data, NLLLossFn())
        assert after["loss"] < before["loss"] * 0.8
        assert before["num_optimizer_steps"] == 1.0 and before["grad_norm"] > 0
        lp = p.get_logprobs(data)["logprobs"]
        ref = p.get_reference_policy_logprobs(data)["reference_logprobs"]
        assert not torch.allclose(lp, ref)  # the reference stays the initial weights
        # ... and is swapped out again entirely: FSDP2 leaves the root's gathered parameters (the
        # embeddings, the final norm) behind after a forward, holding the reference's values.
        assert torch.allclose(p.get_logprobs(data)["logprobs"], lp, atol=1e-6)
        p.save_checkpoint(str(tmp_path / "ckpt"))
        # The checkpoint is a plain HF folder.
        hf = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt")
        am = data["token_mask"]
        with torch.no_grad():
            assert torch.allclose(token_logprobs(hf, data["input_ids"], am, 1.0) * am, lp * am, atol=1e-4)
        assert (tmp_path / "ckpt" / "optimizer.pt").exists()
    finally:
        p.shutdown()  # frees the bundles: one worker group per cluster at a time
    q = Policy(cluster, _cfg(model_dir), seed=0, name_prefix="load", weights_path=str(tmp_path / "ckpt"))
    try:
        assert torch.allclose(q.get_logprobs(data)["logprobs"], lp, atol=1e-5)
        # The optimizer state came back too: the next step matches the original policy's next step.
    finally:
        q.shutdown()


def test_scheduler_factors():
    assert [SchedulerConfig(warmup_steps=2).lr_factor(s) for s in range(4)] == [0.5, 1.0, 1.0, 1.0]
    cos = SchedulerConfig(warmup_steps=2, decay="cosine", total_steps=6, min_lr_ratio=0.1)
    assert cos.lr_factor(2) == pytest.approx(1.0)
    assert cos.lr_factor(4) == pytest.approx(0.55)  # halfway: min + (1 - min) / 2
    assert cos.lr_factor(6) == pytest.approx(0.1) and cos.lr_factor(60) == pytest.approx(0.1)
    lin = SchedulerConfig(decay="linear", total_steps=4)
    assert [lin.lr_factor(s) for s in range(5)] == pytest.approx([1.0, 0.75, 0.5, 0.25, 0.0])
    with pytest.raises(ValueError, match="needs scheduler.total_steps"):
        SchedulerConfig(decay="cosine")
    with pytest.raises(ValueError, match="must be larger than scheduler.warmup_steps"):
        SchedulerConfig(decay="linear", warmup_steps=5, total_steps=5)


def test_single_worker_trains_on_decayed_lr_and_round_trips(ray_session, model_dir, tmp_path):
    """One rank trains without FSDP (it would shard nothing); the lr follows the schedule and a
    checkpoint of the unsharded model loads back into the same logprobs."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    sched = {"warmup_steps": 1, "decay": "cosine", "total_steps": 5}
    one = RayVirtualCluster(1, cpus_per_worker=1, name="single")
    try:
        p = Policy(one, _cfg(model_dir, scheduler=sched), seed=0, init_reference_model=False, name_prefix="one")
        try:
            data = _prompts(tok, ["12+34=46", "1+1=2", "3+4=7", "40+2=42", "5+5=10", "9+9=18", "2+2=4", "6+1=7"])
            data["token_mask"] = (torch.arange(data["input_ids"].shape[1])[None] < data["input_lengths"][:, None]).long()
            data["sample_mask"] = torch.ones(8)
            history = [p.train(data, NLLLossFn()) for _ in range(6)]
            expected = [1e-2 * SchedulerConfig(**sched).lr_factor(k) for k in range(1, 7)]
            assert [h["lr"] for h in history] == pytest.approx(expected)
            assert history[-1]["loss"] < history[0]["loss"]
            lp = p.get_logprobs(data)["logprobs"]
            p.save_checkpoint(str(tmp_path / "one"))
        finally:
            p.shutdown()
        q = Policy(one, _cfg(model_dir), seed=0, init_reference_model=False, name_prefix="one-load",
                   weights_path=str(tmp_path / "one"))
        try:
            assert torch.allclose(q.get_logprobs(data)["logprobs"], lp, atol=1e-5)
        finally:
            q.shutdown()
    finally:
        one.shutdown()


def test_length_sorted_micro_batches_give_the_same_update_as_one_batch(ray_session, model_dir, tmp_path):
    """Several micro-batches are regrouped by length and cut to their own longest sample; the
    update must equal that of the whole batch in one pass (same start, same data)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    texts = ["1+1=2", "12+34=46 because 12+34 is 46", "3+4=7", "40+2=42, forty-two", "5+5=10", "9+9=18",
             "2+2=4 and 2*2=4 and 2^2=4", "6+1=7"]
    data = _prompts(tok, texts)
    data["token_mask"] = (torch.arange(data["input_ids"].shape[1])[None] < data["input_lengths"][:, None]).long()
    data["sample_mask"] = torch.tensor([1.0, 1.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    one = RayVirtualCluster(1, cpus_per_worker=1, name="sorted")
    results = []
    try:
        # One worker for both updates: each starts from the same checkpoint (weights, optimizer,
        # scheduler, RNG), as a fresh worker each did (~3 s a worker).
        p = Policy(one, _cfg(model_dir), seed=0, init_reference_model=False, name_prefix="mbs")
        try:
            p.save_checkpoint(str(tmp_path / "start"))
            for mbs in (8, 2):  # 8: one pass over the batch as given; 2: four length-sorted passes
                p.load_checkpoint(str(tmp_path / "start"))
                m = p.train(data, NLLLossFn(), micro_batch_size=mbs)
                results.append((m, p.get_logprobs(data)["logprobs"]))
        finally:
            p.shutdown()
    finally:
        one.shutdown()
    (m8, lp8), (m2, lp2) = results
    assert m2["loss"] == pytest.approx(m8["loss"], rel=1e-5) and m2["grad_norm"] == pytest.approx(m8["grad_norm"], rel=1e-4)
    am = data["token_mask"].bool()
    assert torch.allclose(lp2[am], lp8[am], atol=1e-5)


def test_the_trajectory_pg_loss_of_the_gym_side_trains_the_language_model(model_dir, ray_session, tmp_path):
    """Registry losses cross sides: ``trajectory_pg`` (REINFORCE on whole sequences, made for step-
    environment agents) trains the LM policy; micro-batches sum to the whole batch's update, and the
    sequence log-likelihood moves with the sign of each advantage."""
    from transformers import AutoTokenizer

    from nemo_like.algorithms.loss_functions import get_loss_fn

    tok = AutoTokenizer.from_pretrained(model_dir)
    data = _prompts(tok, ["1+1=2", "12+34=46", "3+4=7", "40+2=42", "5+5=10", "9+9=18", "2+2=4", "6+1=7"])
    data["token_mask"] = (torch.arange(data["input_ids"].shape[1])[None] < data["input_lengths"][:, None]).long()
    data["sample_mask"] = torch.ones(8)
    data["advantages"] = torch.tensor([1.0, -1.0] * 4)
    one = RayVirtualCluster(1, cpus_per_worker=1, name="trajpg")
    try:
        results = []
        # One worker; each update starts from the same checkpoint (see the test above).
        p = Policy(one, _cfg(model_dir, optimizer={"lr": 1e-3}), seed=0, init_reference_model=False,
                   name_prefix="trajpg")
        try:
            p.save_checkpoint(str(tmp_path / "start"))
            for mbs in (8, 2):
                p.load_checkpoint(str(tmp_path / "start"))
                before = p.get_logprobs(data)["logprobs"]
                m = p.train(data, get_loss_fn("trajectory_pg", {}), micro_batch_size=mbs)
                results.append((m, before, p.get_logprobs(data)["logprobs"]))
        finally:
            p.shutdown()
    finally:
        one.shutdown()
    (m8, before, after8), (m2, _, after2) = results
    assert m2["loss"] == pytest.approx(m8["loss"], rel=1e-5) and m2["grad_norm"] == pytest.approx(m8["grad_norm"], rel=1e-4)
    mask = data["token_mask"].float()
    change = ((after8 - before) * mask).sum(-1)  # the change of each sequence's log-likelihood
    assert torch.all(change[0::2] > 0) and torch.all(change[1::2] < 0), change
    torch.testing.assert_close(after2 * mask, after8 * mask, atol=1e-5, rtol=0)


def test_replicas_without_fsdp_make_the_one_rank_update(ray_session, model_dir):
    """``policy.fsdp: false`` on two ranks: each holds the whole model, the ranks start from rank 0's
    random LoRA adapters and average their gradients, so two steps give the one-rank update (each
    rank trains on its half of every batch, and get_logprobs reads half the rows from each rank)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    texts = ["1+1=2", "12+34=46 because 12+34 is 46", "3+4=7", "40+2=42, forty-two", "5+5=10", "9+9=18",
             "2+2=4 and 2*2=4", "6+1=7"]
    data = _prompts(tok, texts)
    data["token_mask"] = (torch.arange(data["input_ids"].shape[1])[None] < data["input_lengths"][:, None]).long()
    data["sample_mask"] = torch.ones(8)
    lora = {"enabled": True, "rank": 4, "alpha": 8, "target_modules": "all-linear"}
    results = {}
    for workers, fsdp in ((1, True), (2, False)):  # one rank never shards (float32)
        c = RayVirtualCluster(workers, cpus_per_worker=1, name=f"replicas{workers}")
        try:
            p = Policy(c, _cfg(model_dir, lora=lora, fsdp=fsdp), seed=0, init_reference_model=False,
                       name_prefix=f"replicas{workers}")
            try:
                ms = [p.train(data, NLLLossFn()) for _ in range(2)]
                results[workers] = ms, p.get_logprobs(data)["logprobs"]
            finally:
                p.shutdown()
        finally:
            c.shutdown()
    (m1, lp1), (m2, lp2) = results[1], results[2]
    am = data["token_mask"].bool()
    assert (lp2[am] - lp1[am]).abs().max() < 1e-5
    for a, b in zip(m1, m2):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5) and b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)
    assert m2[1]["loss"] < m2[0]["loss"]
