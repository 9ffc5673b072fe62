"""Policy (training) backends by name: the built-in HF and Megatron-core workers resolved by import
path, a user's worker class in one registration, a worker's own refusals as config errors, and clear
errors for a name nobody registered or a class that is not a policy worker."""

from __future__ import annotations

import pytest

from nemo_like.config import ConfigError, load_config
from nemo_like.models.policy.backends import POLICY_BACKENDS, policy_worker_cls, register_policy_backend
from nemo_like.models.policy.hf_worker import HFPolicyWorker

CONFIG = "examples/configs/grpo_math_tiny.yaml"


class RecordingWorker(HFPolicyWorker):
    """A user's backend: the HF worker's methods, and settings of its own that it refuses."""

    @staticmethod
    def check_config(policy) -> None:
        if policy.precision != "float32":
            raise ValueError(f"the recording backend runs in float32 only, not policy.precision={policy.precision!r}")


def test_the_default_backend_is_the_hf_worker() -> None:
    assert load_config(CONFIG, []).policy.backend == "hf"
    assert policy_worker_cls("hf") is HFPolicyWorker
    assert "megatron" in POLICY_BACKENDS.names()


def test_a_backend_is_one_registration_and_its_own_check_runs_before_ray() -> None:
    with POLICY_BACKENDS.isolated():
        register_policy_backend("recording", RecordingWorker)
        assert load_config(CONFIG, ["policy.backend=recording"]).policy.backend == "recording"
        with pytest.raises(ConfigError, match=r"float32 only, not policy.precision='bfloat16'"):
            load_config(CONFIG, ["policy.backend=recording", "policy.precision=bfloat16"])


def test_unknown_backend_is_a_config_error_with_a_suggestion() -> None:
    with pytest.raises(ConfigError, match=r"policy\.backend: unknown policy backend 'megatorn' \(did you mean 'megatron'\?\)"):
        load_config(CONFIG, ["policy.backend=megatorn"])


def test_a_class_that_is_not_a_policy_worker_is_refused_naming_what_it_lacks() -> None:
    class LogprobsOnly:
        def get_logprobs(self, data): ...

    with POLICY_BACKENDS.isolated():
        with pytest.raises(TypeError, match=r"policy backend 'bad': class .*LogprobsOnly lacks \['get_reference_policy_logprobs'"):
            register_policy_backend("bad", LogprobsOnly)
        with pytest.raises(TypeError, match=r"not a class"):
            register_policy_backend("fn", lambda: None)


def test_the_megatron_backend_refuses_what_it_does_not_implement_before_ray() -> None:
    pytest.importorskip("megatron.core", reason="megatron-core (the megatron extra) is not installed")
    with pytest.raises(ConfigError, match=r"policy.backend=megatron trains only .* policy.generation.colocated=false"):
        load_config(CONFIG, ["policy.backend=megatron"])
    with pytest.raises(ConfigError, match=r"does not support: policy.lora.enabled"):
        load_config(CONFIG, ["policy.backend=megatron", "policy.generation.colocated=false", "policy.lora.enabled=true"])
    cfg = load_config(CONFIG, ["policy.backend=megatron", "policy.generation.colocated=false",
                               "policy.sequence_packing.enabled=false"])
    assert policy_worker_cls(cfg.policy.backend).__name__ == "MegatronPolicyWorker"
