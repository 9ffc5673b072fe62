"""Generation backends by name: the built-in HF worker, a user's worker class in one registration,
and clear errors for a name nobody registered or a class that is not a rollout worker."""

from __future__ import annotations

import pytest

from nemo_like.config import ConfigError, load_config
from nemo_like.models.generation.backends import (
    GENERATION_BACKENDS,
    generation_worker_cls,
    register_generation_backend,
)
from nemo_like.models.generation.rollout_worker import RolloutWorker

CONFIG = "examples/configs/grpo_math_tiny.yaml"


class EchoWorker:
    """The shape of a backend (a real one would wrap an inference engine)."""

    def __init__(self, config, *, seed=0): ...
    def generate(self, data, greedy=False): ...
    def update_weights(self, chunk_refs, version): ...
    def weights_checksum(self): ...
    def policy_version(self): ...
    def pad_token_id(self): ...


def test_the_hf_backend_is_the_rollout_worker() -> None:
    assert generation_worker_cls("hf") is RolloutWorker


def test_a_backend_is_one_registration_and_the_config_accepts_it() -> None:
    with GENERATION_BACKENDS.isolated():
        register_generation_backend("echo", EchoWorker)
        assert generation_worker_cls("echo") is EchoWorker
        cfg = load_config(CONFIG, ["policy.generation.colocated=false", "policy.generation.backend=echo"])
        assert cfg.policy.generation.backend == "echo"


def test_unknown_backend_and_colocated_non_hf_are_config_errors() -> None:
    with pytest.raises(ConfigError, match=r"policy\.generation\.backend: unknown generation backend 'vllm'.*"
                                          r"registered: \['hf'\]"):
        load_config(CONFIG, ["policy.generation.colocated=false", "policy.generation.backend=vllm"])
    with pytest.raises(ConfigError, match=r"unknown generation backend .hff. \(did you mean .hf.\?\)"):
        load_config(CONFIG, ["policy.generation.colocated=false", "policy.generation.backend=hff"])
    with GENERATION_BACKENDS.isolated():
        register_generation_backend("echo", EchoWorker)
        with pytest.raises(ConfigError, match=r"generates in a rollout group of its own: set "
                                              r"policy\.generation\.colocated=false"):
            load_config(CONFIG, ["policy.generation.backend=echo"])


def test_a_class_that_is_not_a_worker_is_refused_naming_what_it_lacks() -> None:
    class NoRefit:
        def generate(self, data, greedy=False): ...

    with GENERATION_BACKENDS.isolated():
        with pytest.raises(TypeError, match=r"generation backend 'bad': class .*NoRefit lacks \['update_weights'"):
            register_generation_backend("bad", NoRefit)
