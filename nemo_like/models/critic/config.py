"""Typed config of the critic (value model) that PPO trains beside the policy."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, field_validator, model_validator

from nemo_like.models.policy.interfaces import (
    DynamicBatchingConfig,
    OptimizerConfig,
    PolicyConfig,
    SchedulerConfig,
    SequencePackingConfig,
    refuse_float16_training,
)


class CriticConfig(BaseModel):
    """The value model: the policy's trunk (or ``model_name``'s) with a fresh one-output head.

    ``None`` for ``model_name`` and ``train_global_batch_size`` means: take the policy's."""

    model_config = ConfigDict(extra="forbid")

    # HF hub id or folder of the value model's trunk (it must tokenize as the policy does); None: the policy's.
    model_name: str | None = None
    # Compute dtype: FSDP2 mixed precision when sharded, else autocast; the weights stay float32
    # (float16 is refused: no loss scaling).
    precision: Literal["float32", "bfloat16", "float16"] = "float32"
    # Samples per optimizer step, over all workers.
    train_global_batch_size: int | None = None
    # Samples per forward/backward pass on a worker (gradients accumulate up to the global batch).
    train_micro_batch_size: int = 16
    # Samples per forward pass when the values of a batch are computed, on a worker.
    forward_micro_batch_size: int = 32
    # The critic's AdamW; lr defaults to 1e-5 here, not to OptimizerConfig's 1e-4.
    optimizer: OptimizerConfig = OptimizerConfig(lr=1e-5)
    # Its own schedule, in critic optimizer steps (total_steps "auto": all of the run's).
    scheduler: SchedulerConfig = SchedulerConfig()
    # Clip the gradient's global L2 norm to this before each optimizer step; None: no clipping.
    max_grad_norm: float | None = 1.0
    # Half-width of the band around the old values the new values are clipped to (None: no clipping).
    cliprange_value: float | None = 0.5
    # Multiplies the value loss before the backward pass (> 0). The critic has its own optimizer, so this
    # scales its gradients (and what max_grad_norm clips) rather than weighing it against the policy loss.
    value_loss_coef: float = 1.0
    # Steps at the start of a run in which only the critic trains (read by the trainer).
    warmup_steps: int = 0
    # Passes over the batch per training step.
    ppo_epochs: int = 1
    # FSDP2 over the critic's workers (with one worker only for a precision other than float32). Off: a
    # whole model per worker, gradients all-reduced over workers.
    fsdp: bool = True
    # Recompute activations in the backward pass instead of keeping them: less memory, more compute.
    activation_checkpointing: bool = False
    # Threads per worker; None = the worker's CPU share from the cluster.
    num_threads: int | None = None
    # The value and training passes on packed rows (policy.sequence_packing's keys); None: as the policy's.
    sequence_packing: SequencePackingConfig | None = None
    # Those passes cut by a token budget (policy.dynamic_batching's keys); None: as the policy's.
    dynamic_batching: DynamicBatchingConfig | None = None

    def passes_config(self, policy: PolicyConfig) -> PolicyConfig:
        """The policy's config with this critic's packing and token-budget settings: what cuts the
        critic's passes into micro-batches (validated: the same rules as the policy's)."""
        sp = self.sequence_packing or policy.sequence_packing
        db = self.dynamic_batching or policy.dynamic_batching
        if sp is policy.sequence_packing and db is policy.dynamic_batching:
            return policy
        try:
            return PolicyConfig.model_validate(policy.model_dump() | {"sequence_packing": sp.model_dump(),
                                                                      "dynamic_batching": db.model_dump()})
        except ValueError as e:
            errs = getattr(e, "errors", lambda: [])()
            msg = "; ".join(str(x.get("msg", x)) for x in errs) or str(e)
            raise ValueError(f"critic.sequence_packing / critic.dynamic_batching: {msg.replace('policy.', 'critic.')}") from None

    _no_float16 = field_validator("precision")(lambda cls, v: refuse_float16_training(v, "critic.precision"))

    @field_validator("model_name")
    @classmethod
    def _model_name(cls, v: str | None) -> str | None:
        if v is not None and not v.strip():
            raise ValueError("critic.model_name is empty: give an HF id or folder, or leave it null for the policy's")
        return v

    @field_validator("train_global_batch_size")
    @classmethod
    def _global_batch(cls, v: int | None) -> int | None:
        if v is not None and v <= 0:
            raise ValueError(f"critic.train_global_batch_size must be positive (or null for the policy's), got {v}")
        return v

    @field_validator("train_micro_batch_size", "forward_micro_batch_size")
    @classmethod
    def _micro_batch(cls, v: int, info) -> int:
        if v <= 0:
            raise ValueError(f"critic.{info.field_name} must be positive, got {v}")
        return v

    @field_validator("max_grad_norm")
    @classmethod
    def _grad_norm(cls, v: float | None) -> float | None:
        if v is not None and not v > 0:
            raise ValueError(f"critic.max_grad_norm must be positive (or null for no clipping), got {v}")
        return v

    @field_validator("cliprange_value")
    @classmethod
    def _cliprange(cls, v: float | None) -> float | None:
        if v is not None and not v > 0:
            raise ValueError(f"critic.cliprange_value must be positive (or null for no clipping), got {v}")
        return v

    @field_validator("value_loss_coef")
    @classmethod
    def _coef(cls, v: float) -> float:
        if not v > 0:
            raise ValueError(f"critic.value_loss_coef must be positive, got {v}")
        return v

    @field_validator("warmup_steps")
    @classmethod
    def _warmup(cls, v: int) -> int:
        if v < 0:
            raise ValueError(f"critic.warmup_steps must be >= 0, got {v}")
        return v

    @field_validator("ppo_epochs")
    @classmethod
    def _epochs(cls, v: int) -> int:
        if v < 1:
            raise ValueError(f"critic.ppo_epochs must be >= 1, got {v}")
        return v

    @field_validator("num_threads")
    @classmethod
    def _threads(cls, v: int | None) -> int | None:
        if v is not None and v < 1:
            raise ValueError(f"critic.num_threads must be >= 1 (or null for the worker's CPU share), got {v}")
        return v

    @model_validator(mode="after")
    def _micro_fits_global(self) -> CriticConfig:
        gbs = self.train_global_batch_size
        if gbs is not None and self.train_micro_batch_size > gbs:
            raise ValueError(f"critic.train_micro_batch_size ({self.train_micro_batch_size}) is larger than "
                             f"critic.train_global_batch_size ({gbs})")
        return self
