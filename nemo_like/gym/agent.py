"""Discrete actor-critic networks for step-environment agents, selected by ``policy.network``.

Every registered network is built as ``cls(spec: ObsSpec, config: AgentPolicyConfig)`` and called as

    net(obs) -> (logits: Tensor[N, num_actions], value: Tensor[N])

where ``obs`` is a batch: ``Tensor[N, D]`` (vector), ``Tensor[N, C, H, W]`` (image) or
``{"image": Tensor[N, C, H, W], "vector": Tensor[N, D]}``. Built-ins: ``mlp`` (vector observations)
and ``cnn`` (a small conv trunk for images, with the float vector concatenated after it when there is
one). The value head is trained only with ``grpo.advantage_estimator: gae`` (the value term of
``loss_fn``); the group-relative estimators do not use it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator
from torch import nn

from nemo_like.gym.step_env import ObsSpec
from nemo_like.utils.registry import Registry

__all__ = ["AGENT_NETWORKS", "AgentPolicyConfig", "CNNActorCritic", "MLPActorCritic", "ObsBatch", "build_network",
           "obs_index", "obs_to_tensor", "register_agent_network"]

ObsBatch = torch.Tensor | dict[str, torch.Tensor]


class AgentPolicyConfig(BaseModel):
    """``policy:`` of a gym GRPO config: the network and its optimizer (Adam)."""

    model_config = ConfigDict(extra="forbid")

    # A registered network: mlp (vector observations), cnn (image observations), or one of yours
    # (register_agent_network).
    network: str = "mlp"
    # Widths of the hidden layers of the MLP trunk (for cnn: the MLP after the convolutions); [] puts
    # the policy and value heads straight on the input features.
    hidden_sizes: list[int] = Field(default_factory=lambda: [64, 64])
    # Activation after each hidden layer of the MLP (the cnn's convolutions always use ReLU).
    activation: Literal["tanh", "relu"] = "tanh"
    # cnn only: output channels of each convolution layer (stride 1, no pooling).
    cnn_channels: list[int] = Field(default_factory=lambda: [16, 32])
    # cnn only: square kernel size of every convolution (padded by kernel_size // 2).
    cnn_kernel_size: int = Field(3, ge=1)
    # Adam's learning rate (constant; the optimizer is Adam, without weight decay).
    learning_rate: float = Field(1e-3, gt=0)
    # Added to Adam's denominator for numerical stability.
    adam_eps: float = Field(1e-8, gt=0)
    max_grad_norm: float | None = Field(1.0, gt=0)  # None: no clipping
    torch_threads: int = Field(1, ge=1)  # per process (learner and each collector)

    @field_validator("network")
    @classmethod
    def _registered(cls, value: str) -> str:
        try:
            AGENT_NETWORKS.get(value)
        except KeyError as e:  # names the registered networks and the closest one
            raise ValueError(e.args[0]) from None
        return value


def _activation(name: str) -> type[nn.Module]:
    return {"tanh": nn.Tanh, "relu": nn.ReLU}[name]


def _mlp(sizes: Sequence[int], act: type[nn.Module]) -> nn.Sequential:
    layers: list[nn.Module] = []
    for a, b in zip(sizes[:-1], sizes[1:], strict=True):
        layers += [nn.Linear(a, b), act()]
    return nn.Sequential(*layers)


class _Heads(nn.Module):
    """Policy and value heads. The policy head starts near zero so the first policy is close to
    uniform (every action gets tried), the usual PPO initialisation."""

    def __init__(self, width: int, num_actions: int) -> None:
        super().__init__()
        self.policy = nn.Linear(width, num_actions)
        self.value = nn.Linear(width, 1)
        nn.init.orthogonal_(self.policy.weight, gain=0.01)
        nn.init.zeros_(self.policy.bias)

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.policy(h), self.value(h).squeeze(-1)


class MLPActorCritic(nn.Module):
    def __init__(self, spec: ObsSpec, config: AgentPolicyConfig) -> None:
        super().__init__()
        if spec.image_shape is not None:
            raise ValueError(f"policy.network 'mlp' takes vector observations; this environment gives "
                             f"{spec.kind} observations: set policy.network=cnn")
        self.trunk = _mlp([spec.vector_dim, *config.hidden_sizes], _activation(config.activation))
        self.heads = _Heads(config.hidden_sizes[-1] if config.hidden_sizes else spec.vector_dim, spec.num_actions)

    def forward(self, obs: ObsBatch) -> tuple[torch.Tensor, torch.Tensor]:
        return self.heads(self.trunk(obs))


class CNNActorCritic(nn.Module):
    def __init__(self, spec: ObsSpec, config: AgentPolicyConfig) -> None:
        super().__init__()
        if spec.image_shape is None:
            raise ValueError("policy.network 'cnn' takes image observations; this environment gives vectors: "
                             "set policy.network=mlp")
        c, h, w = spec.image_shape
        k = config.cnn_kernel_size
        convs: list[nn.Module] = []
        for out in config.cnn_channels:
            convs += [nn.Conv2d(c, out, k, padding=k // 2), nn.ReLU()]
            c = out
        self.conv = nn.Sequential(*convs, nn.Flatten())
        with torch.no_grad():
            flat = self.conv(torch.zeros(1, *spec.image_shape)).shape[1]
        self.vector_dim = spec.vector_dim
        act = _activation(config.activation)
        self.mlp = _mlp([flat + spec.vector_dim, *config.hidden_sizes], act)
        width = config.hidden_sizes[-1] if config.hidden_sizes else flat + spec.vector_dim
        self.heads = _Heads(width, spec.num_actions)

    def forward(self, obs: ObsBatch) -> tuple[torch.Tensor, torch.Tensor]:
        if isinstance(obs, dict):
            h = torch.cat([self.conv(obs["image"]), obs["vector"]], dim=-1)
        else:
            h = self.conv(obs)
        return self.heads(self.mlp(h))


def _check_network(name: str, obj: Any) -> None:
    if not callable(obj):
        raise TypeError(f"agent network {name!r} must be an nn.Module class built as cls(spec, config)")


# Tests keep their registrations local with ``with AGENT_NETWORKS.isolated(): ...``.
AGENT_NETWORKS: Registry[Any] = Registry("agent network", check=_check_network,
                                         builtins={"mlp": MLPActorCritic, "cnn": CNNActorCritic})


def register_agent_network(name: str, cls: Any = None, *, overwrite: bool = False) -> Any:
    """``@register_agent_network("x")`` on an nn.Module built as ``cls(spec, config)``."""
    return AGENT_NETWORKS.register(name, cls, overwrite=overwrite)


def build_network(spec: ObsSpec, config: AgentPolicyConfig, seed: int | None = None) -> nn.Module:
    if seed is not None:
        torch.manual_seed(seed)
    return AGENT_NETWORKS.get(config.network)(spec, config)


# ---- observation batches ---------------------------------------------------------------------------
def obs_to_tensor(observations: Sequence[Any]) -> ObsBatch:
    """A list of single observations (arrays, or {"image", "vector"} dicts) -> one batch."""
    first = observations[0]
    if isinstance(first, dict):
        return {k: torch.from_numpy(np.stack([o[k] for o in observations]).astype(np.float32, copy=False))
                for k in first}
    return torch.from_numpy(np.stack(observations).astype(np.float32, copy=False))


def obs_index(obs: ObsBatch, index: torch.Tensor | slice) -> ObsBatch:
    if isinstance(obs, dict):
        return {k: v[index] for k, v in obs.items()}
    return obs[index]


def obs_cat(batches: Sequence[ObsBatch]) -> ObsBatch:
    if isinstance(batches[0], dict):
        return {k: torch.cat([b[k] for b in batches]) for k in batches[0]}
    return torch.cat(list(batches))
