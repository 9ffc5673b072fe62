"""DPO's split loss (dpo_loss.py): the weights the driver computes and the workers' surrogate give
the gradient of a DPO loss computed directly with autograd, on a tiny model in one process, with the
two sides of every pair in different micro-batches; a bad beta is a one-line error naming the key."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from nemo_like.algorithms.dpo import load_dpo_config
from nemo_like.algorithms.dpo_loss import DPOLossConfig, DPOLossFn, DPOPairLossFn, dpo_terms, sequence_logprobs
from nemo_like.algorithms.policy_losses import get_loss_fn
from nemo_like.config import ConfigError
from nemo_like.models.policy.hf_worker import token_logprobs
from nemo_like.models.tiny import build_char_tokenizer, build_tiny_llama


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny_dpo")
    tok = build_char_tokenizer(d)
    return build_tiny_llama(tok, hidden_size=32, num_layers=2, num_heads=4, max_position_embeddings=32, seed=0)


def _pairs(vocab: int):
    """4 pairs: a shared prompt of 3-5 tokens, responses of 2-6 tokens per side, right-padded."""
    g = torch.Generator().manual_seed(0)
    rows, masks = [], []
    for _ in range(4):
        prompt = torch.randint(3, vocab, (int(torch.randint(3, 6, (1,), generator=g)),), generator=g)
        for _side in range(2):
            resp = torch.randint(3, vocab, (int(torch.randint(2, 7, (1,), generator=g)),), generator=g)
            rows.append(torch.cat([prompt, resp]))
            masks.append(torch.cat([torch.zeros(len(prompt)), torch.ones(len(resp))]))
    width = max(len(r) for r in rows)
    ids = torch.zeros((len(rows), width), dtype=torch.long)
    mask = torch.zeros((len(rows), width))
    for i, (r, m) in enumerate(zip(rows, masks)):
        ids[i, :len(r)], mask[i, :len(m)] = r, m
    return ids, torch.tensor([len(r) for r in rows]), mask


def _lp(model, ids, lengths):
    att = (torch.arange(ids.shape[1])[None] < lengths[:, None]).long()
    return token_logprobs(model, ids, att, 1.0)


def _direct(s, ref, n, cfg: DPOLossConfig) -> torch.Tensor:
    """DPO and IPO written out as TRL does, to differentiate through."""
    if cfg.loss_type == "ipo":
        h = (s[0::2] - ref[0::2]) / n[0::2] - (s[1::2] - ref[1::2]) / n[1::2]
        loss = (h - 1 / (2 * cfg.beta)) ** 2
    else:
        h = (s[0::2] - ref[0::2]) - (s[1::2] - ref[1::2])
        eps = cfg.label_smoothing
        loss = -(1 - eps) * F.logsigmoid(cfg.beta * h) - eps * F.logsigmoid(-cfg.beta * h)
    return (loss - cfg.sft_weight * s[0::2] / n[0::2]).mean()


@pytest.mark.parametrize("cfg", [DPOLossConfig(beta=0.5), DPOLossConfig(beta=2.0, label_smoothing=0.2, sft_weight=0.3),
                                 DPOLossConfig(beta=0.3, loss_type="ipo")], ids=["sigmoid", "sigmoid_smooth_sft", "ipo"])
def test_the_surrogate_gradient_is_dpos_gradient(tiny, cfg):
    model = tiny
    ids, lengths, mask = _pairs(model.config.vocab_size)
    n = mask.sum(1)
    ref = torch.randn(len(ids), generator=torch.Generator().manual_seed(1)) * 2 - 10  # a reference away from the policy
    params = [p for p in model.parameters()]

    model.zero_grad()
    s = sequence_logprobs(_lp(model, ids, lengths), mask)
    direct = _direct(s, ref, n, cfg)
    direct.backward()
    want = [p.grad.clone() for p in params]

    with torch.no_grad():
        s0 = sequence_logprobs(_lp(model, ids, lengths), mask)
    weights, metrics = dpo_terms(s0, ref, n, cfg)
    assert metrics["loss"] == pytest.approx(float(direct.detach()), rel=1e-5)
    chosen, rejected = cfg.beta * (s0[0::2] - ref[0::2]), cfg.beta * (s0[1::2] - ref[1::2])
    if cfg.loss_type == "ipo":
        chosen, rejected = chosen / n[0::2], rejected / n[1::2]
    assert metrics["reward_margin"] == pytest.approx(float((chosen - rejected).mean()), rel=1e-5)
    assert metrics["reward_accuracy"] == float((chosen > rejected).float().mean())  # no ties here
    assert dpo_terms(ref, ref, n, cfg)[1]["reward_accuracy"] == 0.5  # at the reference: all ties, chance

    # Every pair's sides in different micro-batches, as a length-sorted or packed plan may put them.
    loss_fn = get_loss_fn("dpo")
    assert isinstance(loss_fn, DPOLossFn) and loss_fn.loss_type == "sequence"
    model.zero_grad()
    for part in ([0, 3, 5, 6], [1, 2, 4, 7]):
        data = {"token_mask": mask[part], "sample_mask": torch.ones(len(part)), "dpo_weight": weights[part]}
        loss, _ = loss_fn(_lp(model, ids[part], lengths[part]), data, float(len(ids)), float(n.sum()))
        loss.backward()
    got = [p.grad for p in params]
    scale = max(float(w.abs().max()) for w in want)
    assert scale > 1e-4  # the comparison means something
    for w, g in zip(want, got):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6 * scale)


def test_the_one_pass_loss_is_dpo_with_the_pairs_in_any_order(tiny):
    cfg = DPOLossConfig(beta=0.5, sft_weight=0.5)
    ids, lengths, mask = _pairs(tiny.config.vocab_size)
    n = mask.sum(1)
    ref = torch.randn(len(ids), generator=torch.Generator().manual_seed(2)) - 10
    tiny.zero_grad()
    direct = _direct(sequence_logprobs(_lp(tiny, ids, lengths), mask), ref, n, cfg)
    direct.backward()
    want = [p.grad.clone() for p in tiny.parameters()]
    tiny.zero_grad()
    perm = torch.tensor([5, 0, 3, 6, 1, 7, 2, 4])  # sides apart and out of order
    data = {"token_mask": mask[perm], "pair_index": perm // 2, "pair_side": perm % 2,
            "reference_seq_logprobs": ref[perm], "response_tokens": n[perm]}
    loss, metrics = DPOPairLossFn(cfg)(_lp(tiny, ids[perm], lengths[perm]), data, float(len(ids)), float(n.sum()))
    loss.backward()
    assert float(loss.detach()) == pytest.approx(float(direct.detach()), rel=1e-5)
    assert metrics["dpo_loss"] == pytest.approx(float(direct.detach()), rel=1e-5)
    for w, g in zip(want, (p.grad for p in tiny.parameters())):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-7)
    split = {k: v[:3] for k, v in data.items()}  # pair 0's rejected side is elsewhere
    with pytest.raises(ValueError, match="both sides of every pair in one micro-batch"):
        DPOPairLossFn(cfg)(_lp(tiny, ids[perm[:3]], lengths[perm[:3]]), split, 8.0, 40.0)


def test_a_masked_sample_adds_nothing():
    curr = torch.randn(2, 5, requires_grad=True)
    data = {"token_mask": torch.ones(2, 5), "sample_mask": torch.tensor([1.0, 0.0]), "dpo_weight": torch.tensor([2.0, 3.0])}
    loss, _ = DPOLossFn()(curr, data, 2.0, 10.0)
    loss.backward()
    assert curr.grad[1].abs().sum() == 0 and torch.allclose(curr.grad[0], torch.full((5,), 2.0))


@pytest.mark.parametrize("override, key", [("dpo.beta=0", "dpo.beta"), ("dpo.beta=-1", "dpo.beta"),
                                           ("dpo.loss_type=hinge", "dpo.loss_type")])
def test_a_bad_setting_is_one_line_naming_the_key(override, key):
    with pytest.raises(ConfigError) as e:
        load_dpo_config("examples/configs/dpo_math_tiny.yaml", [override])
    assert key in str(e.value) and "\n" not in str(e.value).strip(), str(e.value)
