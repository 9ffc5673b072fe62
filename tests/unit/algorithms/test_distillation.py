"""On-policy distillation's arithmetic: the top-k KL against the exact one, the top-k log-probs the
worker computes (padded and packed) against a plain log-softmax, the per-token advantages, the loss
and the config's refusals."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from nemo_like.algorithms.distillation import DistillStage, TeacherConfig, TopKDistillLossFn, topk_kl
from nemo_like.algorithms.loss_functions import ClippedPGLossFn
from nemo_like.config import ConfigError, load_config
from nemo_like.models.policy.hf_worker import _attention_mask, token_logprobs
from nemo_like.models.policy.packing import build_packed, packed_token_logprobs, plan_rows, shared_prefix_lengths

CONFIG = "examples/configs/grpo_math_tiny.yaml"


def _dists(B=2, T=5, V=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, T, V, generator=g).log_softmax(-1), torch.randn(B, T, V, generator=g).log_softmax(-1))


def test_topk_kl_over_the_whole_vocabulary_is_the_exact_kl():
    s, t = _dists()
    fwd = (t.exp() * (t - s)).sum(-1)
    rev = (s.exp() * (s - t)).sum(-1)
    assert torch.allclose(topk_kl(s, t, "forward"), fwd, atol=1e-4)
    assert torch.allclose(topk_kl(s, t, "reverse"), rev, atol=1e-4)
    assert torch.allclose(topk_kl(s, t, "mixed", 0.25), 0.25 * fwd + 0.75 * rev, atol=1e-4)


def test_topk_kl_with_the_rest_as_one_bucket():
    s, t = _dists()
    ids = t.topk(3, -1).indices
    got = topk_kl(s.gather(-1, ids), t.gather(-1, ids), "forward")
    # By hand: the 3 tokens and the remaining mass of each model as a fourth outcome.
    ps, pt = s.exp().gather(-1, ids), t.exp().gather(-1, ids)
    ps4 = torch.cat([ps, 1 - ps.sum(-1, keepdim=True)], -1)
    pt4 = torch.cat([pt, 1 - pt.sum(-1, keepdim=True)], -1)
    assert torch.allclose(got, (pt4 * (pt4.log() - ps4.log())).sum(-1), atol=1e-4)
    assert (got >= -1e-6).all() and (got <= (t.exp() * (t - s)).sum(-1) + 1e-5).all()  # a coarser KL is smaller
    assert topk_kl(t.gather(-1, ids), t.gather(-1, ids)).abs().max() < 1e-6


def _lm():
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                        num_attention_heads=4, num_key_value_heads=2)).float().eval()


def test_topk_logprobs_padded_and_packed_equal_a_plain_log_softmax():
    model = _lm()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 40, (4, 12), generator=g)
    ids[1] = ids[0]  # a shared prompt for the packed layout
    lengths = torch.tensor([12, 9, 7, 12])
    mask = torch.zeros(4, 12, dtype=torch.long)
    for i, n in enumerate(lengths.tolist()):
        mask[i, 4:n] = 1
    with torch.no_grad():
        full = torch.zeros(4, 12, 40)
        for i, n in enumerate(lengths.tolist()):
            full[i, 1:n] = model(input_ids=ids[i:i + 1, :n]).logits[0, :-1].float().log_softmax(-1)
        lp, top_ids, top_lp = token_logprobs(model, ids, _attention_mask(ids, lengths), 1.0, 5)
        want_ids = full.topk(5, -1).indices
        for i, n in enumerate(lengths.tolist()):
            assert torch.equal(top_ids[i, 1:n], want_ids[i, 1:n])
            assert torch.allclose(top_lp[i, 1:n], full[i, 1:n].gather(-1, want_ids[i, 1:n]), atol=1e-5)
        # The student's side: the log-probs of given ids.
        _, got = token_logprobs(model, ids, _attention_mask(ids, lengths), 1.0, top_ids)
        assert torch.allclose(got[:, 1:][mask[:, 1:].bool()], top_lp[:, 1:][mask[:, 1:].bool()], atol=1e-5)
        packed = build_packed(ids, lengths, plan_rows(ids, lengths, 64, shared_prefix_lengths(ids, mask, lengths)))
        assert packed.tokens_real < int(lengths.sum())  # the prompt computed once
        order = packed.sample_idx
        p_lp, p_ids, p_top = packed_token_logprobs(model, packed, 1.0, 5)
        _, p_got = packed_token_logprobs(model, packed, 1.0, top_ids[order])
        for k, i in enumerate(order):
            n = int(lengths[i])
            assert torch.allclose(p_lp[k, :n], lp[i, :n], atol=1e-5)
            assert torch.equal(p_ids[k, 1:n], top_ids[i, 1:n])
            assert torch.allclose(p_top[k, 1:n], top_lp[i, 1:n], atol=1e-5)
            assert torch.allclose(p_got[k, 1:n], top_lp[i, 1:n], atol=1e-5)


class _Teacher:
    """Stands in for the teacher's worker group: fixed log-probs (the stage's arithmetic is tested)."""

    def __init__(self, lp):
        self.lp = lp

    def get_logprobs(self, data):
        return {"logprobs": self.lp}


def test_reverse_kl_advantages_are_the_per_token_gap_plus_the_weighted_env_advantage():
    student = torch.tensor([[0.0, -1.0, -2.0, -0.5], [0.0, -0.2, -0.3, 0.0]])
    teacher = torch.tensor([[0.0, -0.5, -3.0, -0.1], [0.0, -0.2, -1.3, 0.0]])
    data = {"token_mask": torch.tensor([[0, 1, 1, 0], [0, 1, 1, 0]]), "sample_mask": torch.tensor([1.0, 1.0]),
            "generation_logprobs": student}
    stage = DistillStage(TeacherConfig(model_name="t", kl_coef=2.0, reward_weight=0.5), _Teacher(teacher))
    adv, m = stage.apply(data, torch.tensor([1.0, -1.0]))
    want = torch.tensor([[0.0, 2 * 0.5 + 0.5, 2 * -1.0 + 0.5, 0.0], [0.0, 0.0 - 0.5, 2 * -1.0 - 0.5, 0.0]])
    assert torch.allclose(adv, want)
    assert m["distill/reverse_kl"] == pytest.approx((-0.5 + 1.0 + 0.0 + 1.0) / 4)
    assert m["distill/teacher_logprob_mean"] == pytest.approx((-0.5 - 3.0 - 0.2 - 1.3) / 4)
    # A sample the loss masks adds nothing, to the advantages or the metrics.
    data["sample_mask"] = torch.tensor([1.0, 0.0])
    adv, m = stage.apply(data, torch.tensor([1.0, -1.0]))
    assert adv[1].abs().sum() == 0 and m["distill/reverse_kl"] == pytest.approx(0.25)


def test_topk_loss_adds_the_kl_normalised_by_the_global_tokens_and_has_its_gradient():
    s, t = _dists(B=2, T=4, V=6)
    ids = t.topk(2, -1).indices
    curr = torch.zeros(2, 4, requires_grad=True)
    s_k = s.gather(-1, ids).clone().requires_grad_(True)
    data = {"token_mask": torch.tensor([[0, 1, 1, 0], [0, 1, 1, 1]]), "sample_mask": torch.ones(2),
            "advantages": torch.zeros(2, 4), "generation_logprobs": torch.zeros(2, 4),
            "prev_logprobs": torch.zeros(2, 4), "reference_policy_logprobs": torch.zeros(2, 4),
            "curr_topk_logprobs": s_k, "teacher_topk_logprobs": t.gather(-1, ids)}
    cfg = TeacherConfig(model_name="t", objective="topk", kl_coef=3.0, topk_k=2)
    loss_fn = TopKDistillLossFn(ClippedPGLossFn(), cfg)
    loss, m = loss_fn(curr, data, 2.0, 10.0)  # 10 tokens in the whole global batch, 5 here
    kl = topk_kl(s_k.detach(), t.gather(-1, ids))
    mask = data["token_mask"].float()
    assert float(loss.detach()) == pytest.approx(3.0 * float((kl * mask).sum()) / 10.0, rel=1e-5)
    assert m["distill_topk_kl"] == pytest.approx(float((kl * mask).sum()) / 5, rel=1e-5)
    loss.backward()
    assert s_k.grad[0, 0].abs().sum() == 0 and s_k.grad[0, 1].abs().sum() > 0  # only loss tokens pull
    assert loss_fn.zero_advantage_is_inert is False


def test_config_refuses_a_missing_teacher_and_a_run_that_trains_nothing(tmp_path):
    with pytest.raises(ConfigError, match="teacher.model_name.*(not|no )"):
        load_config(CONFIG, [f"teacher.model_name={tmp_path / 'nope'}"])
    with pytest.raises(ConfigError, match="teacher: kl_coef and reward_weight are both 0"):
        load_config(CONFIG, ["teacher.model_name=some/hub-id", "teacher.kl_coef=0", "grpo.dynamic_sampling.enabled=false"])
    with pytest.raises(ConfigError, match="set grpo.dynamic_sampling.enabled=false"):  # the recipe's DAPO, inherited
        load_config(CONFIG, ["teacher.model_name=some/hub-id"])
    with pytest.raises(ConfigError, match="teacher.objective"):
        load_config(CONFIG, ["teacher.model_name=some/hub-id", "teacher.objective=forward"])
    cfg = load_config(CONFIG, ["teacher.model_name=some/hub-id", "grpo.dynamic_sampling.enabled=false"])
    assert cfg.run_roles()["teacher"] and cfg.teacher.objective == "reverse_kl"
    # One sample a prompt: only for distillation without rewards (a group of one has no advantage).
    one = ["grpo.num_prompts_per_step=128", "grpo.num_generations_per_prompt=1", "grpo.dynamic_sampling.enabled=false"]
    with pytest.raises(ConfigError, match="grpo.num_generations_per_prompt=1: .*teacher.reward_weight=0"):
        load_config(CONFIG, one)
    with pytest.raises(ConfigError, match="grpo.num_generations_per_prompt=1"):
        load_config(CONFIG, [*one, "teacher.model_name=some/hub-id", "teacher.reward_weight=0.5"])
    with pytest.raises(ConfigError, match="grpo.num_generations_per_prompt"):
        load_config(CONFIG, ["grpo.num_generations_per_prompt=0"])
    assert load_config(CONFIG, [*one, "teacher.model_name=some/hub-id"]).grpo.num_generations_per_prompt == 1


def test_without_rewards_a_non_finite_group_advantage_is_left_out():
    data = {"token_mask": torch.tensor([[0, 1, 1]]), "sample_mask": torch.tensor([1.0]),
            "generation_logprobs": torch.tensor([[0.0, -1.0, -2.0]])}
    stage = DistillStage(TeacherConfig(model_name="t", reward_weight=0.0), _Teacher(torch.tensor([[0.0, -0.5, -2.5]])))
    adv, _ = stage.apply(data, torch.tensor([float("nan")]))
    assert torch.allclose(adv, torch.tensor([[0.0, 0.5, -0.5]]))
