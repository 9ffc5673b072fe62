"""Dynamic sampling's group selection and the collapse watch, on hand-made numbers."""

from __future__ import annotations

import math

import pytest
import torch

from nemo_like.algorithms.guards import CollapseWatch, groups_with_spread, inert_samples, merge_rounds
from nemo_like.config_sections import CollapseStopConfig
from nemo_like.distributed.batched_data_dict import BatchedDataDict


def test_groups_with_spread_ignores_unscorable_samples():
    nan = math.nan
    r = torch.tensor([1, 1, 1, 1,  0, 1, 0, 0,  nan, 1, nan, 1,  nan, 0, 1, nan,  nan, nan, nan, 2])
    assert groups_with_spread(r, 4).tolist() == [False, True, False, True, False]


def _round(rewards, tag):
    n = len(rewards)
    return (BatchedDataDict(total_reward=torch.tensor(rewards, dtype=torch.float32),
                            loss_multiplier=torch.ones(n), tag=[f"{tag}{i}" for i in range(n)]),
            {"response_length_mean": float(tag == "b") * 10, "env/math/num_failures": 1.0, "generation_s": 2.0})


def test_merge_rounds_takes_kept_groups_in_order_then_fills_with_no_loss_groups():
    G = 2
    a = _round([1, 1, 0, 1, 0, 0], "a")  # groups: flat, spread, flat
    b = _round([1, 0, 2, 2, 3, 3], "b")  # groups: spread, flat, flat
    batch, ids, m = merge_rounds([a, b], [groups_with_spread(a[0]["total_reward"], G),
                                          groups_with_spread(b[0]["total_reward"], G)], G, num_groups=3)
    # the two kept groups (a's 2nd, b's 1st), then the first dropped one (a's 1st) as a filler
    assert batch["tag"] == ["a2", "a3", "b0", "b1", "a0", "a1"]
    assert batch["loss_multiplier"].tolist() == [1, 1, 1, 1, 0, 0]
    assert ids.tolist() == [0, 0, 1, 1, 2, 2]
    assert m["dynamic_sampling/gen_batches"] == 2.0 and m["dynamic_sampling/kept_group_frac"] == pytest.approx(2 / 6)
    assert m["dynamic_sampling/filled_groups"] == 1.0
    # counters add up over rounds, rates are averaged
    assert m["env/math/num_failures"] == 2.0 and m["generation_s"] == 4.0 and m["response_length_mean"] == 5.0
    full, _, m2 = merge_rounds([b], [torch.tensor([True, False, False])], G, num_groups=1)
    assert full["tag"] == ["b0", "b1"] and m2["dynamic_sampling/filled_groups"] == 0.0


def _cfg(**kw):
    base = dict(enabled=True, patience=3, truncation_rate=0.9, reward_floor=0.0, zero_std_group_frac=0.99)
    return CollapseStopConfig(**(base | kw))


def test_collapse_watch_needs_patience_consecutive_steps_per_signature():
    w = CollapseWatch(_cfg())
    junk = {"train/truncation_rate": 0.95, "train/reward_mean": 0.0, "train/zero_std_group_frac": 0.5}
    flat = {"train/truncation_rate": 0.1, "train/reward_mean": 0.7, "train/zero_std_group_frac": 1.0}
    fine = {"train/truncation_rate": 0.1, "train/reward_mean": 0.7, "train/zero_std_group_frac": 0.5}
    assert w.observe(junk, 1) is None and w.observe(junk, 2) is None
    assert w.observe(fine, 3) is None  # the streak is broken
    assert [w.observe(junk, s) for s in (4, 5)] == [None, None]
    reason = w.observe(junk, 6)
    assert reason == ("generation_collapse at step 6: truncation rate 0.95 >= 0.9 and mean reward 0.000 <= 0.0 "
                      "for 3 consecutive steps (grpo.stop_on_collapse.patience=3)")
    w2 = CollapseWatch(_cfg(patience=2))
    assert w2.observe(flat, 1) is None
    assert w2.observe(flat, 2).startswith("advantage_collapse at step 2: 1.00 of groups have equal rewards (>= 0.99)")
    # counters survive a checkpoint as plain ints
    w3 = CollapseWatch(_cfg(patience=2))
    w3.observe(flat, 1)
    state = w3.state_dict()
    assert state == {"generation_collapse": 0, "advantage_collapse": 1, "reward_hacking": 0, "best_gold": None}
    w4 = CollapseWatch(_cfg(patience=2))
    w4.load_state_dict(state)
    assert w4.observe(flat, 2) is not None
    off = CollapseWatch(_cfg(enabled=False, patience=1))
    assert off.observe(junk, 1) is None


def test_inert_samples_are_those_that_cannot_move_the_weights():
    from nemo_like.algorithms.loss_functions import ClippedPGLossFn

    token_mask = torch.tensor([[0, 1, 1], [0, 1, 1], [0, 1, 1], [0, 0, 0], [0, 1, 1]])
    data = BatchedDataDict(token_mask=token_mask, sample_mask=torch.tensor([1.0, 1.0, 0.0, 1.0, 1.0]),
                           advantages=torch.tensor([0.5, 0.0, 0.7, 0.3, -0.0]))
    no_kl, kl = ClippedPGLossFn({"reference_policy_kl_penalty": 0.0}), ClippedPGLossFn({"reference_policy_kl_penalty": 0.1})
    # Advantage 0 (either sign), no loss (sample mask 0), no loss token: inert.
    assert inert_samples(data, no_kl).tolist() == [False, True, True, True, True]
    # The KL penalty pulls on every sample with loss tokens, whatever its advantage.
    assert inert_samples(data, kl).tolist() == [False, False, True, True, False]
    # A loss that does not say (a custom one): only samples with no loss at all.
    assert inert_samples(data, object()).tolist() == [False, False, True, True, False]
    # Per-token advantages: inert only where every loss token's is 0 (the prompt's does not count).
    data["advantages"] = torch.tensor([[9.0, 0.0, 0.1], [9.0, 0.0, 0.0], [0, 0, 0], [1, 1, 1], [0, 0, 0.0]])
    assert inert_samples(data, no_kl).tolist() == [False, True, True, True, True]


def test_reward_hacking_is_gold_falling_while_the_reward_models_score_rises():
    """The over-optimisation run's shape (docs/performance.md): the verifier's reward falls from its
    best while the reward model's score climbs; a dip with the score not above its value then, a gold
    that never was above 0, and runs without a reward model are not it."""
    def m(gold, score):
        return {"rm/env_reward_mean": gold, "rm/score_mean": score, "train/zero_std_group_frac": 0.5}

    w = CollapseWatch(_cfg(patience=3))
    assert w.observe(m(0.60, -0.2), 1) is None and w.observe(m(0.62, 0.1), 2) is None  # best: 0.62 at step 2
    assert w.observe(m(0.30, 0.0), 3) is None  # half of the best, but the score is below its value then
    assert w.observe(m(0.31, 0.9), 4) is None and w.observe(m(0.20, 1.4), 5) is None
    state = w.state_dict()
    assert state["reward_hacking"] == 2 and state["best_gold"] == [0.62, 0.1, 2]
    resumed = CollapseWatch(_cfg(patience=3))
    resumed.load_state_dict(state)  # counters and the best gold come back with a checkpoint
    reason = resumed.observe(m(0.13, 1.41), 6)
    assert reason == ("reward_hacking at step 6: the environments' reward (rm/env_reward_mean) is 0.130, at most 0.5 "
                      "of its best 0.620 (step 2), while the reward model's score (rm/score_mean) rose from 0.100 "
                      "to 1.410 for 3 consecutive steps (grpo.stop_on_collapse.patience=3, gold_drop=0.5; null turns "
                      "this check off)")
    never = CollapseWatch(_cfg(patience=1))
    assert [never.observe(m(0.0, s), i) for i, s in enumerate((0.0, 1.0, 2.0))] == [None] * 3  # no gold to lose
    assert never.observe({"train/zero_std_group_frac": 0.5}, 4) is None  # no reward model
    assert never.observe(m(float("nan"), 3.0), 5) is None  # nothing scorable this step
    off = CollapseWatch(_cfg(patience=1, gold_drop=None))
    assert off.observe(m(0.6, 0.0), 1) is None and off.observe(m(0.0, 5.0), 2) is None
    old = CollapseWatch(_cfg())
    old.load_state_dict({"generation_collapse": 1, "advantage_collapse": 0})  # a checkpoint from before
    assert old.best_gold is None and old.counts["reward_hacking"] == 0
