"""Generation backends by name: the built-in HF worker, a user's worker class in one registration,
and clear errors for a name nobody registered or a class that is not a rollout worker."""

from __future__ import annotations

import pytest
from pydantic import BaseModel, ConfigDict, Field

from nemo_like.config import ConfigError, load_config
from nemo_like.models.generation.backends import (
    GENERATION_BACKENDS,
    GenerationWorker,
    backend_capabilities,
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
    def release_generation_memory(self): ...


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


def test_the_contract_includes_memory_release_and_the_hf_worker_meets_it() -> None:
    class NoRelease(EchoWorker):
        release_generation_memory = None

    assert isinstance(RolloutWorker.__new__(RolloutWorker), GenerationWorker)
    with GENERATION_BACKENDS.isolated():
        with pytest.raises(TypeError, match=r"lacks \['release_generation_memory'\]"):
            register_generation_backend("no_release", NoRelease)


def test_capabilities_are_declared_checked_and_used_by_the_config() -> None:
    assert backend_capabilities("hf") == {"streaming", "collective_refit", "trainer_logprobs"}

    class ClaimsStreaming(EchoWorker):
        capabilities = frozenset({"streaming"})

    class ClaimsNonsense(EchoWorker):
        capabilities = frozenset({"teleport"})

    with GENERATION_BACKENDS.isolated():
        with pytest.raises(TypeError, match=r"capability 'streaming' needs \['generate_episodes'\]"):
            register_generation_backend("claims", ClaimsStreaming)
        with pytest.raises(TypeError, match=r"unknown capability 'teleport'"):
            register_generation_backend("nonsense", ClaimsNonsense)
        register_generation_backend("echo", EchoWorker)  # declares nothing
        assert backend_capabilities("echo") == frozenset()
        apart = ["policy.generation.colocated=false", "policy.generation.backend=echo"]
        with pytest.raises(ConfigError, match=r"refit_transport=collective: backend 'echo' does not take a broadcast"):
            load_config(CONFIG, apart + ["policy.generation.refit_transport=collective"])
        with pytest.raises(ConfigError, match=r"stream_episodes: backend 'echo' cannot stream episodes"):
            load_config(CONFIG, apart + ["policy.generation.stream_episodes=true"])


class EchoOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    max_batch_tokens: int = Field(4096, gt=0)


def test_a_backend_declares_typed_options_under_policy_generation() -> None:
    with GENERATION_BACKENDS.isolated():
        register_generation_backend("echo", EchoWorker, options=EchoOptions)
        apart = ["policy.generation.colocated=false", "policy.generation.backend=echo"]
        cfg = load_config(CONFIG, apart + ["policy.generation.max_batch_tokens=512"])
        assert cfg.policy.generation.max_batch_tokens == 512
        assert load_config(CONFIG, apart).policy.generation.max_batch_tokens == 4096  # the default, filled in
        with pytest.raises(ConfigError, match=r"policy\.generation\.max_batch_tokens: Input should be greater than 0"):
            load_config(CONFIG, apart + ["policy.generation.max_batch_tokens=0"])
        with pytest.raises(ConfigError, match=r"policy\.generation\.max_batch_token: unknown config key "
                                              r"\(did you mean policy\.generation\.max_batch_tokens\?\)"):
            load_config(CONFIG, apart + ["policy.generation.max_batch_token=5"])
    # The hf backend declares no options: an unknown key under policy.generation is still an error.
    with pytest.raises(ConfigError, match=r"policy\.generation\.max_new_token: unknown config key "
                                          r"\(did you mean policy\.generation\.max_new_tokens\?\)"):
        load_config(CONFIG, ["policy.generation.max_new_token=5"])
