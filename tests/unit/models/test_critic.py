"""The PPO critic (value model) over real gloo workers in the session's local Ray, on the tiny Llama."""

from __future__ import annotations

import pytest
import torch
from _nl_model_test_helpers import tokenized
from pydantic import ValidationError

from nemo_like.algorithms.ppo_terms import clipped_value_loss_terms
from nemo_like.distributed.batched_data_dict import BatchedDataDict
from nemo_like.distributed.ray_cluster import RayVirtualCluster
from nemo_like.gym.loss import ValueLossConfig, value_loss_term
from nemo_like.models.critic import CriticConfig
from nemo_like.models.critic.critic import Critic
from nemo_like.models.policy import PolicyConfig

CLIP = 0.05


def _policy_cfg(model_dir) -> PolicyConfig:
    return PolicyConfig(model_name=model_dir, train_global_batch_size=4, train_micro_batch_size=2)


def _critic_cfg(**kw) -> CriticConfig:
    base = dict(optimizer={"lr": 1e-3}, cliprange_value=CLIP, train_global_batch_size=4, train_micro_batch_size=2,
                forward_micro_batch_size=2)
    return CriticConfig(**(base | kw))


@pytest.fixture(scope="module")
def cluster(ray_session):
    c = RayVirtualCluster(1, cpus_per_worker=1)
    yield c
    c.shutdown()


@pytest.fixture(scope="module")
def critic(cluster, model_dir):
    c = Critic(cluster, _critic_cfg(), _policy_cfg(model_dir), seed=0)
    yield c
    c.shutdown()


@pytest.fixture(scope="module")
def batch(model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    data = tokenized(tok, ["12+34=46", "1+1=2", "999+1=1000 ok", "7+8=15!"])
    ar = torch.arange(data["input_ids"].shape[1])
    # Loss on every token from the third on (a stand-in for the response).
    data["token_mask"] = ((ar[None] >= 2) & (ar[None] < data["input_lengths"][:, None])).float()
    return data


def _train_data(batch, values, returns) -> BatchedDataDict:
    return BatchedDataDict(input_ids=batch["input_ids"], input_lengths=batch["input_lengths"],
                           token_mask=batch["token_mask"], values=values, returns=returns)


def test_config_validation_names_the_key():
    with pytest.raises(ValidationError, match="critic.cliprange_value"):
        CriticConfig(cliprange_value=0)
    with pytest.raises(ValidationError, match="critic.ppo_epochs"):
        CriticConfig(ppo_epochs=0)
    with pytest.raises(ValidationError, match="critic.train_micro_batch_size"):
        CriticConfig(train_micro_batch_size=8, train_global_batch_size=4)
    with pytest.raises(ValidationError):
        CriticConfig(unknown_key=1)
    # No loss scaling anywhere: float16 training is refused, for the critic and the policy alike.
    with pytest.raises(ValidationError, match="critic.precision=float16: training in float16 needs loss scaling"):
        CriticConfig(precision="float16")
    with pytest.raises(ValidationError, match="policy.precision=float16: .* use bfloat16"):
        PolicyConfig(model_name="m", precision="float16")
    assert CriticConfig().optimizer.lr == 1e-5


def test_values_are_shifted_and_zero_on_padding(critic, batch, tmp_path):
    from transformers import AutoModelForTokenClassification

    values = critic.compute_values(batch)["values"]
    assert values.shape == batch["input_ids"].shape and values.dtype == torch.float32
    # The worker's weights, in this process: the checkpoint is a plain HF token-classification folder.
    critic.save_checkpoint(str(tmp_path / "ckpt"))
    ref = AutoModelForTokenClassification.from_pretrained(str(tmp_path / "ckpt"), num_labels=1).eval()
    lengths = batch["input_lengths"]
    for i in range(batch.size):
        n = int(lengths[i])
        with torch.no_grad():
            head = ref(input_ids=batch["input_ids"][i : i + 1, :n]).logits[0, :, 0]
        assert torch.allclose(values[i, 1:n], head[: n - 1], atol=1e-5)
        assert values[i, 0] == 0 and (values[i, n:] == 0).all()
    # Row i's values do not depend on its batch mates (micro-batching, padding).
    alone = critic.compute_values(batch.select_indices([1]))["values"]
    assert torch.allclose(alone[0, : int(lengths[1])], values[1, : int(lengths[1])], atol=1e-5)


def test_clipped_value_loss_through_the_worker(critic, batch):
    v = critic.compute_values(batch)["values"]
    mask = batch["token_mask"]
    # Rows 0-1: old values 1 above the current ones, returns 1 below: the clipped value (old - CLIP)
    # is farther from the return than the unclipped one, so the clipped term wins. Rows 2-3: old = v,
    # the two terms are equal (not counted as clipped).
    old = v.clone()
    old[:2] += 1.0
    returns = v - 1.0
    m = critic.train(_train_data(batch, old, returns))
    rows01 = mask[:2].sum()
    assert m["num_optimizer_steps"] == 1
    assert m["vf_clipfrac"] == pytest.approx(float(rows01 / mask.sum()), abs=1e-6)
    expected = (0.5 * (1.0 + 1.0 - CLIP) ** 2 * rows01 + 0.5 * 1.0 * mask[2:].sum()) / mask.sum()
    assert m["value_loss"] == pytest.approx(float(expected), rel=1e-4)
    terms, clipped = clipped_value_loss_terms(v, old, returns, mask, cliprange_value=CLIP)
    assert m["value_loss"] == pytest.approx(float(terms.sum() / mask.sum()), rel=1e-4)
    # The gym trainer's value term on the same inputs: the same loss and clip fraction.
    _, gym = value_loss_term(v, old, returns, mask, ValueLossConfig(vf_coef=1.0, cliprange_value=CLIP))
    assert m["value_loss"] == pytest.approx(gym["value_loss"], rel=1e-4)
    assert m["vf_clipfrac"] == pytest.approx(gym["vf_clipfrac"], abs=1e-6)
    assert m["values_mean"] == pytest.approx(float((v * mask).sum() / mask.sum()), abs=1e-5)
    assert m["lr"] == pytest.approx(1e-3) and m["grad_norm"] > 0


def test_training_on_a_fixed_target_lowers_the_loss(critic, batch):
    returns = torch.ones_like(batch["token_mask"])
    losses = []
    for _ in range(6):
        v = critic.compute_values(batch)["values"]
        losses.append(critic.train(_train_data(batch, v, returns))["value_loss"])
    assert losses[-1] < 0.5 * losses[0], losses


def test_non_finite_returns_raise_and_leave_the_weights(critic, batch):
    before = critic.weights_checksum()
    v = critic.compute_values(batch)["values"]
    returns = torch.zeros_like(v)
    returns[1, 3] = float("nan")  # a loss-carrying token
    with pytest.raises(RuntimeError, match="critic") as e:
        critic.train(_train_data(batch, v, returns))
    assert "non-finite" in str(e.value) and "returns" in str(e.value)
    assert critic.weights_checksum() == before
    # NaN where no loss is carried (padding) is ignored.
    returns = torch.zeros_like(v)
    returns[batch["token_mask"] == 0] = float("nan")
    assert torch.isfinite(torch.tensor(critic.train(_train_data(batch, v, returns))["value_loss"]))


def test_checkpoint_round_trip_resumes_exactly(critic, batch, tmp_path):
    v0 = critic.compute_values(batch)["values"]
    data = _train_data(batch, v0, v0 + 0.3)
    critic.save_checkpoint(str(tmp_path / "c"))
    saved = critic.weights_checksum()
    critic.train(data)
    after_one = critic.weights_checksum()
    critic.train(data)
    assert critic.weights_checksum() != after_one
    critic.load_checkpoint(str(tmp_path / "c"))
    assert critic.weights_checksum() == saved
    # Optimizer moments and scheduler resume too: the same step lands on the same weights.
    critic.train(data)
    assert critic.weights_checksum() == after_one


def _trained_copy(workers, cfg, model_dir, start, data, v0, train_data, name):
    """A critic of ``workers`` ranks loaded from the checkpoint ``start`` (its values checked against
    ``v0``), trained once on ``train_data``: its metrics and its values after."""
    cluster = RayVirtualCluster(workers, cpus_per_worker=1)
    try:
        c = Critic(cluster, cfg, _policy_cfg(model_dir), seed=1, name_prefix=name)
        try:
            c.load_checkpoint(str(start))
            assert (c.compute_values(data)["values"] - v0).abs().max() < 1e-5
            return c.train(train_data), c.compute_values(data)["values"]
        finally:
            c.shutdown()
    finally:
        cluster.shutdown()


@pytest.mark.parametrize("fsdp", [True, False], ids=["fsdp2", "allreduce"])
def test_two_rank_update_equals_one_rank_update(critic, batch, model_dir, tmp_path, fsdp):
    """FSDP2's reduce-scatter or, with fsdp off, the worker's own gradient all-reduce."""
    critic.save_checkpoint(str(tmp_path / "start"))
    data = BatchedDataDict.from_batches([batch, batch.select_indices([3, 2, 1, 0])])  # 8 rows: 2 global batches
    v0 = critic.compute_values(data)["values"]
    train_data = _train_data(data, v0, v0 * 0.5 + torch.linspace(-1, 1, data["input_ids"].shape[1]))
    one = critic.train(train_data)
    one_values = critic.compute_values(data)["values"]
    assert one["num_optimizer_steps"] == 2

    # Different micro-batches (1 per rank) than the one-rank run (2): the update must not change.
    two, two_values = _trained_copy(2, _critic_cfg(train_micro_batch_size=1, fsdp=fsdp), model_dir,
                                    tmp_path / "start", data, v0, train_data, "critic2")
    assert (two_values - one_values).abs().max() < 1e-5
    for k in ("value_loss", "vf_clipfrac", "values_mean", "grad_norm", "num_optimizer_steps"):
        assert two[k] == pytest.approx(one[k], rel=1e-4, abs=1e-6), k


@pytest.mark.parametrize("model_type", ["qwen2", "granite"])
def test_value_model_loads_without_dropout(model_type, tmp_path):
    """Qwen2 has a token-classification class; Granite has none and gets the trunk + linear head."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from nemo_like.models.critic.worker import TrunkWithValueHead, load_value_model

    cfg = AutoConfig.for_model(model_type, vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                               num_key_value_heads=1, intermediate_size=64, attention_dropout=0.1)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path)
    model, new = load_value_model(str(tmp_path))
    assert {"score.weight", "score.bias"} <= set(new)
    assert isinstance(model, TrunkWithValueHead) == (model_type == "granite")
    assert all(m.p == 0 for m in model.modules() if isinstance(m, torch.nn.Dropout))
    assert model.config.attention_dropout == 0
    out = model(input_ids=torch.tensor([[1, 2, 3, 4]]), attention_mask=torch.ones(1, 4, dtype=torch.long)).logits
    assert out.shape == (1, 4, 1)


def test_packed_passes_give_the_unpacked_values_and_update(critic, batch, model_dir, tmp_path):
    """Packing (each prompt once for its samples, rows under a token budget) changes how the passes
    are cut, not what they compute: values and the update equal the right-padded ones."""
    critic.save_checkpoint(str(tmp_path / "start"))
    # Rows 0 and 4 share their first two tokens (the "prompt" before the loss tokens) with row 0.
    data = BatchedDataDict.from_batches([batch, batch.select_indices([0, 2, 1, 3])])
    data["input_ids"][4, 2:] = data["input_ids"][3, 2:]
    data["input_lengths"][4] = data["input_lengths"][3]
    ar = torch.arange(data["input_ids"].shape[1])
    data["token_mask"] = ((ar[None] >= 2) & (ar[None] < data["input_lengths"][:, None])).float()
    v0 = critic.compute_values(data)["values"]
    train_data = _train_data(data, v0, v0 * 0.5 + 0.25)
    one = critic.train(train_data)
    after = critic.compute_values(data)["values"]

    packing = {"enabled": True, "max_tokens_per_microbatch": 256, "row_length": 128}
    m, packed_after = _trained_copy(1, _critic_cfg(sequence_packing=packing), model_dir, tmp_path / "start", data, v0,
                                    train_data, "cpk")
    assert (packed_after - after).abs().max() < 1e-5
    for k in ("value_loss", "vf_clipfrac", "values_mean", "grad_norm"):
        assert m[k] == pytest.approx(one[k], rel=1e-4, abs=1e-6), k
    assert m["padding_efficiency"] > one["padding_efficiency"]  # the shared prompt is computed once


def test_critic_packing_follows_the_policy_rules():
    policy = PolicyConfig(model_name="m", max_total_sequence_length=64)
    assert _critic_cfg().passes_config(policy) is policy  # nothing of its own: the policy's settings
    with pytest.raises(ValueError, match="critic.sequence_packing"):
        _critic_cfg(sequence_packing={"enabled": True, "max_tokens_per_microbatch": 32}).passes_config(policy)
