"""The reward model over real gloo workers: the score is the HF sequence-classification head at each
sequence's last token, Bradley-Terry training moves it the right way, one and two ranks make the same
update, and the saved folder is a plain HF model."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from nemo_like.data.preferences import math_preference_pairs, tokenize_pairs
from nemo_like.distributed.batched_data_dict import BatchedDataDict
from nemo_like.distributed.ray_cluster import RayVirtualCluster
from nemo_like.models.reward_model import (
    LastTokenScore,
    RewardModel,
    RewardModelConfig,
    bradley_terry,
    pack_for_scores,
)


def test_bradley_terry_values():
    got = bradley_terry(torch.tensor([2.0, 0.0, -1.0]), torch.tensor([0.0, 0.0, 1.0]))
    want = [-math.log(1 / (1 + math.exp(-2))), math.log(2), -math.log(1 / (1 + math.exp(2)))]
    assert torch.allclose(got, torch.tensor(want), atol=1e-6)


@pytest.fixture(scope="module")
def pairs(model_dir):
    tok = AutoTokenizer.from_pretrained(model_dir)
    rows = [{"problem": f"{a}+{b}=", "expected_answer": str(a + b)} for a in range(3, 11) for b in (1, 7)]
    data = tokenize_pairs(math_preference_pairs(rows, seed=0), tok, max_length=40)  # 16 pairs
    return BatchedDataDict(input_ids=data["input_ids"], input_lengths=data["input_lengths"])


def _cfg(model_dir, **kw) -> RewardModelConfig:
    return RewardModelConfig(**({"model_name": model_dir, "train_global_batch_size": 8, "train_micro_batch_size": 4,
                                 "forward_micro_batch_size": 5, "optimizer": {"lr": 3e-3}} | kw))


@pytest.mark.slow  # over 15 s: run by `uv run pytest -m slow` (CI runs it after the default suite)
def test_score_train_save_and_two_ranks(ray_session, model_dir, pairs, tmp_path):
    one_cluster = RayVirtualCluster(1, cpus_per_worker=1)
    rm = RewardModel(one_cluster, _cfg(model_dir), seed=0)
    try:
        before = rm.score(pairs)
        rm.save(str(tmp_path / "start"))
        first = rm.train_pairs(pairs)  # 16 pairs: two optimizer steps
        assert first["num_optimizer_steps"] == 2
        m = [rm.train_pairs(pairs) for _ in range(15)][-1]
        after = rm.score(pairs)
        rm.save(str(tmp_path / "trained"))
    finally:
        rm.shutdown()
        one_cluster.shutdown()
    # Training on the pairs moves their margins the right way (they are the training data).
    assert m["loss"] < first["loss"] - 0.1 and m["accuracy"] > first["accuracy"]
    assert float((after[0::2] - after[1::2]).mean()) > float((before[0::2] - before[1::2]).mean())
    # The saved folder is a plain HF sequence-classification model with the same scores.
    hf = AutoModelForSequenceClassification.from_pretrained(tmp_path / "trained").eval()
    with torch.no_grad():
        mine = LastTokenScore(hf)(pairs["input_ids"], pairs["input_lengths"])
        # HF's own forward, one unpadded sequence at a time (its "last token" is then unambiguous).
        n = int(pairs["input_lengths"][3])
        own = hf(input_ids=pairs["input_ids"][3:4, :n]).logits[0, 0]
    assert torch.allclose(mine, after, atol=1e-5) and abs(float(own) - float(after[3])) < 1e-5

    # Two ranks (FSDP2 over gloo), each with half of every global batch, padded rows, against one rank
    # on packed rows (a pair's prompt once): the same update.
    two_cluster = RayVirtualCluster(2, cpus_per_worker=1)
    two = RewardModel(two_cluster, _cfg(str(tmp_path / "start"), train_micro_batch_size=2), seed=1,
                      name_prefix="rm2")
    one_cluster = RayVirtualCluster(1, cpus_per_worker=1)
    ref = RewardModel(one_cluster, _cfg(str(tmp_path / "start"), sequence_packing=True, packing_row_length=64),
                      seed=2, name_prefix="rm1")
    try:
        assert torch.allclose(two.score(pairs), before, atol=1e-5)
        m2, m1 = two.train_pairs(pairs), ref.train_pairs(pairs)
        assert torch.allclose(two.score(pairs), ref.score(pairs), atol=1e-5)
    finally:
        for x in (two, ref):
            x.shutdown()
        two_cluster.shutdown()
        one_cluster.shutdown()
    for k in ("loss", "accuracy", "margin", "grad_norm"):
        assert m2[k] == pytest.approx(m1[k], rel=1e-4, abs=1e-6), k
    assert m1["loss"] == pytest.approx(first["loss"], rel=1e-5)  # from the same start, the same first step


def test_balanced_batches_make_the_same_scores_and_update_on_two_workers(ray_session, model_dir, tmp_path):
    """reward_model.balance_batch: whole pairs moved inside each global batch so that both workers get
    about the same tokens; the scores and the optimizer step are those of the unbalanced pass."""
    tok = AutoTokenizer.from_pretrained(model_dir)
    rows = [{"problem": "x" * k + f"{a}+{b}=", "expected_answer": str(a + b)}
            for k in (0, 24) for a in (3, 4, 5, 6) for b in (1, 7)]
    data = tokenize_pairs(math_preference_pairs(rows, seed=0), tok, max_length=60)  # 16 pairs, two lengths
    assert not data["truncated"].any()
    # Each global batch of 8 pairs: its long pairs first, so that unbalanced rank 0 gets all of them.
    by_len = torch.argsort(data["input_lengths"].view(-1, 2).sum(dim=1), descending=True, stable=True).tolist()
    order = by_len[0:4] + by_len[12:16] + by_len[4:8] + by_len[8:12]
    rows_idx = torch.tensor([2 * p + k for p in order for k in (0, 1)])
    batch = BatchedDataDict(input_ids=data["input_ids"][rows_idx], input_lengths=data["input_lengths"][rows_idx])
    cluster = RayVirtualCluster(2, cpus_per_worker=1)
    rm = RewardModel(cluster, _cfg(model_dir, train_micro_batch_size=2, balance_batch=False), seed=0)
    got = {}
    try:
        rm.save_checkpoint(str(tmp_path / "start"))
        for balance in (False, True):  # the same workers, from the same weights and optimizer state
            rm.cfg = rm.cfg.model_copy(update={"balance_batch": balance})
            rm.load_checkpoint(str(tmp_path / "start"))
            got[balance] = (rm.score(batch), rm.train_pairs(batch), rm.score(batch))
    finally:
        rm.shutdown()
        cluster.shutdown()
    (s0, m0, a0), (s1, m1, a1) = got[False], got[True]
    assert torch.allclose(s0, s1, atol=1e-5) and torch.allclose(a0, a1, atol=1e-5)
    assert not torch.allclose(a0, s0, atol=1e-3)  # it trained
    for k in ("loss", "accuracy", "margin", "grad_norm"):
        assert m1[k] == pytest.approx(m0[k], rel=1e-4, abs=1e-6), k
    assert m0["dp_token_imbalance"] > 1.2 and m1["dp_token_imbalance"] < 1.02, (m0, m1)


def test_bad_batches_are_refused(ray_session, model_dir, pairs):
    two_cluster = RayVirtualCluster(2, cpus_per_worker=1)
    try:  # refused before any worker starts
        with pytest.raises(ValueError, match=r"train_global_batch_size \(3\) is not divisible by the 2 workers"):
            RewardModel(two_cluster, _cfg(model_dir, train_global_batch_size=3, train_micro_batch_size=3))
    finally:
        two_cluster.shutdown()
    cluster = RayVirtualCluster(1, cpus_per_worker=1)
    rm = RewardModel(cluster, _cfg(model_dir), seed=0)
    try:
        with pytest.raises(ValueError, match=r"15 pairs are not whole global batches of 8"):
            rm.train_pairs(pairs.slice(0, 30))
    finally:
        rm.shutdown()
        cluster.shutdown()


def test_a_pair_is_packed_with_its_prompt_once():
    ids = torch.tensor([[5, 6, 7, 8, 9], [5, 6, 7, 3, 0], [1, 2, 3, 0, 0], [4, 2, 3, 0, 0]])
    lengths = torch.tensor([5, 4, 3, 3])
    packed, order = pack_for_scores(ids, lengths, row_length=64)
    assert sorted(order.tolist()) == [0, 1, 2, 3]
    # Pair 0 shares "5 6 7": laid out once; pair 1 shares nothing. One extra token a sequence.
    assert packed.tokens_real == (3 + 3 + 2) + (4 + 4)
    # The score is read where each sequence's last real token sits in the packed rows.
    k = torch.arange(4)
    rows, cols = packed.src_row[k, lengths[order]], packed.src_col[k, lengths[order]]
    assert packed.input_ids[rows, cols].tolist() == [int(ids[i, lengths[i] - 1]) for i in order.tolist()]
    assert packed.position_ids[rows, cols].tolist() == [int(lengths[i]) - 1 for i in order.tolist()]


def test_lora_trains_adapters_and_head_and_saves_a_merged_plain_model(ray_session, model_dir, pairs, tmp_path):
    cluster = RayVirtualCluster(1, cpus_per_worker=1)
    cfg = _cfg(model_dir, lora={"enabled": True, "rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]})
    rm = RewardModel(cluster, cfg, seed=0, name_prefix="rm-lora")
    try:
        before = rm.score(pairs)
        rm.save_checkpoint(str(tmp_path / "ckpt"))
        first = rm.train_pairs(pairs)
        m = [rm.train_pairs(pairs) for _ in range(7)][-1]
        after = rm.score(pairs)
        rm.save(str(tmp_path / "merged"))
        rm.load_checkpoint(str(tmp_path / "ckpt"))  # back to the start: adapters, head and optimizer
        assert torch.allclose(rm.score(pairs), before, atol=1e-6)
    finally:
        rm.shutdown()
        cluster.shutdown()
    assert m["loss"] < first["loss"] and not torch.allclose(after, before, atol=1e-3)
    # A plain HF folder: no adapter tensors, the trunk's untargeted weights are the base model's, and
    # its scores are the trained model's.
    merged = AutoModelForSequenceClassification.from_pretrained(tmp_path / "merged").eval()
    names = [n for n, _ in merged.named_parameters()]
    assert not any("lora" in n or "modules_to_save" in n or "base_layer" in n for n in names)
    base = AutoModelForSequenceClassification.from_pretrained(model_dir, num_labels=1)
    for k in ("model.layers.0.self_attn.k_proj.weight", "model.layers.0.mlp.up_proj.weight"):
        assert torch.equal(merged.state_dict()[k], base.state_dict()[k]), k
    assert not torch.equal(merged.state_dict()["model.layers.0.self_attn.q_proj.weight"],
                           base.state_dict()["model.layers.0.self_attn.q_proj.weight"])
    with torch.no_grad():
        assert torch.allclose(LastTokenScore(merged)(pairs["input_ids"], pairs["input_lengths"]), after, atol=1e-4)


def test_a_lora_target_that_is_not_there_names_the_key(ray_session, model_dir):
    cluster = RayVirtualCluster(1, cpus_per_worker=1)
    try:
        with pytest.raises(RuntimeError, match=r"reward_model.lora.target_modules: \['qq_proj'\] not found"):
            RewardModel(cluster, _cfg(model_dir, lora={"enabled": True, "target_modules": ["qq_proj"]}),
                        name_prefix="rm-badlora")
    finally:
        cluster.shutdown()
