from nemo_like.models.policy.interfaces import (
    LoraConfig,
    OptimizerConfig,
    PolicyConfig,
    PolicyInterface,
    SchedulerConfig,
)

__all__ = ["LoraConfig", "OptimizerConfig", "PolicyConfig", "PolicyInterface", "SchedulerConfig", "Policy"]


def __getattr__(name):
    # Policy pulls in Ray; keep `import nemo_like.models.policy` light for config validation.
    if name == "Policy":
        from nemo_like.models.policy.lm_policy import Policy

        return Policy
    raise AttributeError(name)
