"""Actor-critic networks for step-environment agents: shapes per observation kind, the near-uniform
first policy, the registry and its config validation, the observation-batch helpers, and a CNN that
learns a tiny Catch task."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from nemo_like.gym.agent import (
    AGENT_NETWORKS,
    AgentPolicyConfig,
    CNNActorCritic,
    MLPActorCritic,
    build_network,
    obs_cat,
    obs_index,
    obs_to_tensor,
    register_agent_network,
)
from nemo_like.gym.catch import CatchEnvironment
from nemo_like.gym.step_env import ObsSpec

VECTOR = ObsSpec(num_actions=3, vector_dim=4)
IMAGE = ObsSpec(num_actions=3, image_shape=(1, 10, 5))
IMAGE_VECTOR = ObsSpec(num_actions=3, vector_dim=2, image_shape=(1, 10, 5))


def test_mlp_on_vectors_gives_logits_and_values():
    net = build_network(VECTOR, AgentPolicyConfig(), seed=0)
    assert isinstance(net, MLPActorCritic)
    logits, value = net(torch.randn(7, 4))
    assert logits.shape == (7, 3) and value.shape == (7,)
    assert logits.dtype == torch.float32
    # hidden sizes are honoured: a [8] trunk has one Linear(4, 8)
    small = build_network(VECTOR, AgentPolicyConfig(hidden_sizes=[8]), seed=0)
    assert [m.out_features for m in small.trunk if isinstance(m, nn.Linear)] == [8]
    assert small(torch.randn(2, 4))[0].shape == (2, 3)


@pytest.mark.parametrize("network, spec, obs", [
    ("mlp", VECTOR, lambda g: torch.randn(256, 4, generator=g) * 3),
    ("cnn", IMAGE, lambda g: torch.rand(256, 1, 10, 5, generator=g)),
])
def test_initial_policy_is_near_uniform(network, spec, obs):
    net = build_network(spec, AgentPolicyConfig(network=network), seed=1)
    logits, _ = net(obs(torch.Generator().manual_seed(0)))
    assert logits.abs().max() < 0.1
    probs = torch.softmax(logits, dim=-1)
    torch.testing.assert_close(probs, torch.full_like(probs, 1 / 3), atol=0.05, rtol=0)
    assert float(net.heads.policy.bias.detach().abs().max()) == 0.0


def test_cnn_on_images_and_on_image_plus_vector():
    net = build_network(IMAGE, AgentPolicyConfig(network="cnn", cnn_channels=[4, 8], hidden_sizes=[16]), seed=0)
    assert isinstance(net, CNNActorCritic)
    logits, value = net(torch.rand(5, 1, 10, 5))
    assert logits.shape == (5, 3) and value.shape == (5,)

    net2 = build_network(IMAGE_VECTOR, AgentPolicyConfig(network="cnn", cnn_channels=[4], hidden_sizes=[16]), seed=0)
    obs = {"image": torch.rand(6, 1, 10, 5), "vector": torch.rand(6, 2)}
    logits, value = net2(obs)
    assert logits.shape == (6, 3) and value.shape == (6,)
    # the vector reaches the heads: changing it changes the output
    value2 = net2({"image": obs["image"], "vector": obs["vector"] + 1.0})[1]
    assert not torch.allclose(value, value2)
    # first MLP layer takes the flattened conv features (4 channels * 10 * 5) plus the 2-vector
    first = next(m for m in net2.mlp if isinstance(m, nn.Linear))
    assert first.in_features == 4 * 10 * 5 + 2


def test_mlp_refuses_images_and_cnn_refuses_vectors():
    with pytest.raises(ValueError, match="policy.network=cnn"):
        build_network(IMAGE, AgentPolicyConfig(network="mlp"))
    with pytest.raises(ValueError, match="policy.network=cnn"):
        build_network(IMAGE_VECTOR, AgentPolicyConfig(network="mlp"))
    with pytest.raises(ValueError, match="policy.network=mlp"):
        build_network(VECTOR, AgentPolicyConfig(network="cnn"))


def test_build_network_is_seeded():
    def weights(seed, network="mlp", spec=VECTOR):
        return build_network(spec, AgentPolicyConfig(network=network), seed=seed).state_dict()

    a, b, c = weights(3), weights(3), weights(4)
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0)
    assert any(not torch.equal(a[k], c[k]) for k in a)
    ca, cb = weights(5, "cnn", IMAGE), weights(5, "cnn", IMAGE)
    assert all(torch.equal(ca[k], cb[k]) for k in ca)


def test_config_validation():
    with pytest.raises(ValueError, match="'mlp'"):
        AgentPolicyConfig(network="mpl")
    with pytest.raises(ValueError, match="hidden_size"):
        AgentPolicyConfig(hidden_size=[3])  # extra keys are refused
    with pytest.raises(ValueError):
        AgentPolicyConfig(learning_rate=0)
    with pytest.raises(ValueError):
        AgentPolicyConfig(activation="gelu")
    assert AgentPolicyConfig(max_grad_norm=None).max_grad_norm is None


def test_user_network_registered_in_isolation_is_built():
    class Linear(nn.Module):
        def __init__(self, spec, config):
            super().__init__()
            self.spec = spec
            self.config = config
            self.pi = nn.Linear(spec.vector_dim, spec.num_actions)

        def forward(self, obs):
            return self.pi(obs), obs.sum(-1)

    with AGENT_NETWORKS.isolated():
        register_agent_network("linear-test", Linear)
        config = AgentPolicyConfig(network="linear-test")
        net = build_network(VECTOR, config, seed=0)
        assert isinstance(net, Linear) and net.spec == VECTOR and net.config is config
        logits, value = net(torch.ones(2, 4))
        assert logits.shape == (2, 3)
        torch.testing.assert_close(value, torch.tensor([4.0, 4.0]))
        with pytest.raises(TypeError, match="nn.Module"):
            register_agent_network("not-callable", 3)
    assert "linear-test" not in AGENT_NETWORKS
    with pytest.raises(ValueError, match="linear-test"):
        AgentPolicyConfig(network="linear-test")


def test_register_agent_network_as_decorator():
    with AGENT_NETWORKS.isolated():
        @register_agent_network("decorated-test")
        class Net(MLPActorCritic):
            pass

        assert isinstance(build_network(VECTOR, AgentPolicyConfig(network="decorated-test")), Net)


# ---- observation batches ------------------------------------------------------------------------------
def test_obs_to_tensor_stacks_arrays_and_dicts():
    arrays = [np.full(3, i, dtype=np.float64) for i in range(4)]
    batch = obs_to_tensor(arrays)
    assert isinstance(batch, torch.Tensor) and batch.shape == (4, 3) and batch.dtype == torch.float32
    torch.testing.assert_close(batch[:, 0], torch.arange(4, dtype=torch.float32))

    dicts = [{"image": np.full((1, 2, 2), i, dtype=np.float32), "vector": np.array([i, -i], dtype=np.float32)}
             for i in range(3)]
    batch = obs_to_tensor(dicts)
    assert set(batch) == {"image", "vector"}
    assert batch["image"].shape == (3, 1, 2, 2) and batch["vector"].shape == (3, 2)
    assert batch["image"].dtype == batch["vector"].dtype == torch.float32
    torch.testing.assert_close(batch["vector"], torch.tensor([[0.0, 0.0], [1.0, -1.0], [2.0, -2.0]]))
    torch.testing.assert_close(batch["image"][:, 0, 1, 1], torch.tensor([0.0, 1.0, 2.0]))


def test_obs_index_and_cat_on_tensors_and_dicts():
    x = torch.arange(12.0).reshape(6, 2)
    idx = torch.tensor([4, 0])
    torch.testing.assert_close(obs_index(x, idx), torch.tensor([[8.0, 9.0], [0.0, 1.0]]))
    torch.testing.assert_close(obs_index(x, slice(1, 3)), x[1:3])
    torch.testing.assert_close(obs_cat([x[:2], x[2:]]), x)

    d = {"image": torch.arange(6.0).reshape(6, 1, 1, 1), "vector": torch.arange(12.0).reshape(6, 2)}
    picked = obs_index(d, idx)
    assert set(picked) == {"image", "vector"}
    torch.testing.assert_close(picked["image"].flatten(), torch.tensor([4.0, 0.0]))
    torch.testing.assert_close(picked["vector"], torch.tensor([[8.0, 9.0], [0.0, 1.0]]))
    joined = obs_cat([obs_index(d, slice(0, 1)), obs_index(d, slice(1, 6))])
    assert set(joined) == {"image", "vector"}
    torch.testing.assert_close(joined["image"], d["image"])
    torch.testing.assert_close(joined["vector"], d["vector"])


# ---- learning ---------------------------------------------------------------------------------------
def test_cnn_learns_the_first_catch_move():
    """Supervised check that gradients flow through conv trunk and policy head: from the first Catch
    frame, predict the move toward the ball (left / stay / right of the middle column)."""
    obs, targets = [], []
    for seed in range(64):
        frame = CatchEnvironment().reset(seed=seed)
        ball = int(np.argmax(frame[0, 0]))
        obs.append(frame)
        targets.append(0 if ball < 2 else 1 if ball == 2 else 2)
    x, y = obs_to_tensor(obs), torch.tensor(targets)
    assert len(set(targets)) == 3

    config = AgentPolicyConfig(network="cnn", cnn_channels=[8], hidden_sizes=[32], learning_rate=2e-2)
    net = build_network(IMAGE, config, seed=0)
    opt = torch.optim.Adam(net.parameters(), lr=config.learning_rate)

    def loss_now():
        return nn.functional.cross_entropy(net(x)[0], y)

    with torch.no_grad():
        initial = float(loss_now())
    assert abs(initial - np.log(3)) < 0.05  # uniform start
    for _ in range(15):
        opt.zero_grad()
        loss = loss_now()
        loss.backward()
        opt.step()
    with torch.no_grad():
        final = float(loss_now())
        accuracy = float((net(x)[0].argmax(-1) == y).float().mean())
    assert final < 0.5 * initial
    assert accuracy > 0.9
