"""Packing and dynamic batching through the real Policy: two FSDP2/gloo ranks in a local Ray
cluster must make the same update as the right-padded path, also when token budgets give the
ranks different numbers of micro-batches (they must still run in lock step)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer

from nemo_like.algorithms.guards import inert_samples
from nemo_like.algorithms.loss_functions import ClippedPGLossFn
from nemo_like.distributed.batched_data_dict import BatchedDataDict
from nemo_like.distributed.ray_cluster import RayVirtualCluster
from nemo_like.models.policy import PolicyConfig
from nemo_like.models.policy.lm_policy import Policy


@pytest.fixture(scope="module")
def cluster(ray_session):
    c = RayVirtualCluster(2, cpus_per_worker=1, name="pack")
    yield c
    c.shutdown()


def _batch(tok) -> BatchedDataDict:
    """4 prompts x 4 completions. Rank 0's half (the first 8) is long, rank 1's short, so token
    budgets cut rank 0's shard into more micro-batches than rank 1's."""
    prompts = ["What is 12+34? ", "Add 40 and 2: ", "Sum 5+5 then ", "9+9 equals "]
    tails = [["46, since 12+34=46 exactly", "46 (twelve plus 34)", "forty six: 46 ok", "it is 46 46 46"],
             ["42 is the answer here", "42, forty-two indeed", "it makes 42 of them", "42 42 and 42 42"],
             ["10", "ten", "1+9", "10!"], ["18", "19", "x", "18."]]
    texts = [(p, t) for p, ts in zip(prompts, tails) for t in ts]
    rows = [tok(p + t, add_special_tokens=False)["input_ids"] for p, t in texts]
    plen = [len(tok(p, add_special_tokens=False)["input_ids"]) for p, _ in texts]
    T = max(len(r) for r in rows)
    ids = torch.full((16, T), tok.pad_token_id)
    mask = torch.zeros(16, T, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r)
        mask[i, plen[i] : len(r)] = 1
    lengths = torch.tensor([len(r) for r in rows])
    g = torch.Generator().manual_seed(0)
    data = BatchedDataDict(input_ids=ids, input_lengths=lengths, token_mask=mask, sample_mask=torch.ones(16),
                           advantages=torch.randn(16, generator=g))
    return data


def _run(cluster, model_dir, data, name, skip=False, **kw):
    # Unbalanced unless asked: the uneven halves are what makes the ranks' micro-batch counts differ.
    kw = {"balance_batch": False} | kw
    cfg = PolicyConfig(model_name=model_dir, train_global_batch_size=16, train_micro_batch_size=2,
                       logprob_batch_size=3, max_total_sequence_length=48, optimizer={"lr": 1e-2},
                       generation={"max_new_tokens": 4}, **kw)
    p = Policy(cluster, cfg, seed=0, init_reference_model=False, name_prefix=name)
    try:
        before = p.get_logprobs(data)
        d = data.copy()
        d["prev_logprobs"] = d["generation_logprobs"] = d["reference_policy_logprobs"] = before["logprobs"]
        loss_fn = ClippedPGLossFn({"reference_policy_kl_penalty": 0.0})
        if skip:
            d["skip_pass"] = inert_samples(d, loss_fn)
        metrics = p.train(d, loss_fn)
        after = p.get_logprobs(data)
    finally:
        p.shutdown()
    return before, metrics, after


@pytest.mark.slow  # over 15 s: run by `uv run pytest -m slow` (CI runs it after the default suite)
def test_packed_and_dynamic_batches_make_the_same_update_on_two_ranks(cluster, model_dir):
    tok = AutoTokenizer.from_pretrained(model_dir)
    data = _batch(tok)
    am = data["token_mask"].bool()
    ref_before, ref_m, ref_after = _run(cluster, model_dir, data, "padded")
    variants = {
        "packed": {"sequence_packing": {"enabled": True, "max_tokens_per_microbatch": 96, "row_length": 48}},
        "packed-noshare": {"sequence_packing": {"enabled": True, "max_tokens_per_microbatch": 96, "row_length": 48,
                                                "share_prompt_prefix": False}},
        "dynamic": {"dynamic_batching": {"enabled": True, "max_tokens_per_microbatch": 64}},
    }
    ratio = {}
    for name, kw in variants.items():
        before, m, after = _run(cluster, model_dir, data, name, **kw)
        ratio[name] = m["computed_tokens_ratio"]
        assert torch.allclose(before["logprobs"][am], ref_before["logprobs"][am], atol=1e-5), name
        assert m["loss"] == pytest.approx(ref_m["loss"], rel=1e-5, abs=1e-7), name
        assert m["grad_norm"] == pytest.approx(ref_m["grad_norm"], rel=1e-4), name
        assert torch.allclose(after["logprobs"][am], ref_after["logprobs"][am], atol=1e-4), name
        assert 0.9 < m["padding_efficiency"] <= 1.0, name
        assert 0 < float(before["padding_efficiency"].mean()) <= 1.0
    assert ref_m["peak_memory_gb"] > 0
    # Each prompt computed once for its four completions: fewer positions than the samples hold.
    assert ratio["packed"] < 0.9 * ratio["packed-noshare"] and ratio["packed-noshare"] >= 1.0


def test_balanced_batches_make_the_same_update_with_even_tokens(cluster, model_dir):
    """policy.balance_batch: each prompt's group of four stays whole and the long groups are split
    over the ranks; the log-probs come back in the caller's order and the update is the same."""
    tok = AutoTokenizer.from_pretrained(model_dir)
    data = _batch(tok)
    am = data["token_mask"].bool()
    before0, m0, after0 = _run(cluster, model_dir, data, "unbalanced")
    before1, m1, after1 = _run(cluster, model_dir, data, "balanced", balance_batch=True)
    assert m0["dp_token_imbalance"] > 1.2 and m1["dp_token_imbalance"] < 1.05
    assert torch.allclose(before1["logprobs"][am], before0["logprobs"][am], atol=1e-5)
    assert m1["loss"] == pytest.approx(m0["loss"], rel=1e-5, abs=1e-7)
    assert m1["grad_norm"] == pytest.approx(m0["grad_norm"], rel=1e-4)
    assert torch.allclose(after1["logprobs"][am], after0["logprobs"][am], atol=1e-4)


def test_skipping_inert_samples_makes_the_same_update(cluster, model_dir):
    # Two groups with equal rewards (advantage 0) and one sample out of the loss: with no KL
    # penalty they add nothing to the gradient. Rank 1's whole shard (samples 8-15) is inert, so
    # that rank trains one masked stand-in, in lock step with rank 0's micro-batches.
    tok = AutoTokenizer.from_pretrained(model_dir)
    data = _batch(tok)
    data["advantages"][8:] = 0.0
    data["sample_mask"][0] = 0.0
    am = data["token_mask"].bool()
    flags = inert_samples(data, ClippedPGLossFn({"reference_policy_kl_penalty": 0.0}))
    assert flags.tolist() == [True] + [False] * 7 + [True] * 8
    assert not inert_samples(data, ClippedPGLossFn({"reference_policy_kl_penalty": 0.1}))[8:].any()
    packed = {"sequence_packing": {"enabled": True, "max_tokens_per_microbatch": 96, "row_length": 48}}
    _, ref_m, ref_after = _run(cluster, model_dir, data, "all", **packed)
    _, m, after = _run(cluster, model_dir, data, "skip", skip=True, **packed)
    assert m["loss"] == pytest.approx(ref_m["loss"], rel=1e-5, abs=1e-7)
    assert m["grad_norm"] == pytest.approx(ref_m["grad_norm"], rel=1e-4)
    assert torch.allclose(after["logprobs"][am], ref_after["logprobs"][am], atol=1e-5)
    # Rank 0 trained its 7 live samples; rank 1 ran a masked stand-in, which trains nothing.
    assert (ref_m["trained_samples"], m["trained_samples"]) == (16.0, 7.0)
    lengths = data["input_lengths"]
    assert (ref_m["trained_tokens"], m["trained_tokens"]) == (float(lengths.sum()), float(lengths[1:8].sum()))
    # The loss's means are over the samples trained: the ratio metrics stay ratios (1 at the start).
    assert m["probs_ratio"] == pytest.approx(1.0, abs=1e-5)


def test_a_pass_with_no_loss_reports_undefined_means_not_zeros():
    # Every sample of an optimizer batch skipped (or masked): means over zero tokens do not exist;
    # a 0.0 "probs_ratio" would read as a collapsed policy. NaN (logged as null), keys kept.
    import math
    from types import SimpleNamespace

    from nemo_like.models.policy.hf_worker import HFPolicyWorker, _mean_dicts

    one_rank = SimpleNamespace(world_size=1, device=torch.device("cpu"))
    one_rank._reduce = HFPolicyWorker._reduce.__get__(one_rank)  # the real one: a no-op on one rank
    empty = HFPolicyWorker._reduce_metrics(one_rank, {"loss": 0.0, "probs_ratio": 0.0}, 0.0)
    assert empty["loss"] == 0.0 and math.isnan(empty["probs_ratio"])
    full = HFPolicyWorker._reduce_metrics(one_rank, {"loss": 0.5, "probs_ratio": 4.0}, 4.0)
    assert full == {"loss": 0.5, "probs_ratio": 1.0}
    # Over the optimizer steps of a GRPO step, a step with nothing to average is left out.
    assert _mean_dicts([empty, full]) == {"loss": 0.25, "probs_ratio": 1.0}
    assert math.isnan(_mean_dicts([empty])["probs_ratio"])
