"""Contracts of the policy: its typed config and the interface the GRPO loop codes against."""

from __future__ import annotations

import abc
import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from nemo_like.data.chat_templates import resolve_chat_template
from nemo_like.distributed.batched_data_dict import BatchedDataDict
from nemo_like.models.generation.interfaces import GenerationConfig


class OptimizerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    # The optimizer; AdamW (torch.optim.AdamW) is the only one.
    name: Literal["adamw"] = "adamw"
    # Peak learning rate (the scheduler's warmup and decay scale it).
    lr: float = Field(1e-4, gt=0)
    # AdamW's decoupled weight decay, on every trainable parameter (norms and biases included).
    weight_decay: float = Field(0.0, ge=0)
    # Adam's (beta1, beta2): decay rates of the running means of the gradient and of its square.
    betas: tuple[float, float] = (0.9, 0.999)
    # Added to Adam's denominator for numerical stability.
    eps: float = Field(1e-8, gt=0)


def refuse_float16_training(precision: str, key: str) -> str:
    """``precision``, unless it is float16 where a model trains (``key``: policy.precision,
    critic.precision): nothing here scales the loss, so float16 gradients would underflow."""
    if precision == "float16":
        raise ValueError(f"{key}=float16: training in float16 needs loss scaling, which the training workers do "
                         "not do (small gradients would underflow to 0); use bfloat16, or float32 on a GPU "
                         "without bfloat16")
    return precision


class SchedulerConfig(BaseModel):
    """Linear warmup to ``optimizer.lr``, then ``decay``: ``constant`` (the default), or
    ``cosine``/``linear`` down to ``min_lr_ratio * lr`` at ``total_steps`` optimizer steps (then held
    there). In a GRPO config ``total_steps: auto`` means the whole run."""

    model_config = ConfigDict(extra="forbid")
    # Optimizer steps of linear warmup from lr / warmup_steps up to lr (0: none).
    warmup_steps: int = Field(0, ge=0)
    # After warmup: "constant" lr, or "cosine"/"linear" decay to min_lr_ratio x lr at total_steps.
    decay: Literal["constant", "cosine", "linear"] = "constant"
    # Optimizer step at which the decay ends, warmup included (needed by cosine and linear).
    # policy.scheduler and critic.scheduler: "auto" is the whole GRPO run.
    total_steps: int | None = Field(None, gt=0)
    # The learning rate the decay ends at, as a fraction of lr.
    min_lr_ratio: float = Field(0.0, ge=0, le=1)

    @model_validator(mode="after")
    def _decay_needs_total(self) -> SchedulerConfig:
        if self.decay != "constant":
            if self.total_steps is None:
                raise ValueError(f"scheduler.decay={self.decay!r} needs scheduler.total_steps (optimizer steps)")
            if self.total_steps <= self.warmup_steps:
                raise ValueError(f"scheduler.total_steps ({self.total_steps}) must be larger than "
                                 f"scheduler.warmup_steps ({self.warmup_steps})")
        return self

    def lr_factor(self, step: int) -> float:
        """Multiplier of ``optimizer.lr`` after ``step`` optimizer steps (LambdaLR's convention)."""
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if self.decay == "constant":
            return 1.0
        assert self.total_steps is not None
        frac = min(1.0, (step - self.warmup_steps) / (self.total_steps - self.warmup_steps))
        shape = 0.5 * (1.0 + math.cos(math.pi * frac)) if self.decay == "cosine" else 1.0 - frac
        return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * shape


class SequencePackingConfig(BaseModel):
    """Training and log-prob passes on packed rows (samples end to end, attention confined to each)
    instead of right-padded micro-batches of a fixed sample count."""

    model_config = ConfigDict(extra="forbid")
    # Pack the training and log-prob passes (HF backend); replaces train_micro_batch_size and
    # logprob_batch_size. Not with dynamic_batching.
    enabled: bool = False
    # Tokens computed per forward pass (rows x row width, padding included).
    max_tokens_per_microbatch: int = Field(4096, gt=0)
    # Tokens per packed row. None: chosen per micro-batch plan, up to min(max_tokens_per_microbatch,
    # 4 x max_total_sequence_length), by the least estimated compute. A custom mask costs attention
    # over the whole row (no varlen kernel on CPU), so rows about as long as a prompt's group of
    # completions beat the longest rows (measured on the multi-env default: 640-token rows took
    # 1.24x the training time of the 320-token ones chosen).
    row_length: int | None = Field(None, gt=0)
    # The G completions of a prompt share its tokens: the prompt is computed once per row, each
    # completion attending to it (same log-probs and gradients, fewer tokens).
    share_prompt_prefix: bool = True


class DynamicBatchingConfig(BaseModel):
    """Micro-batches cut by a token budget (samples x their longest) instead of a sample count."""

    model_config = ConfigDict(extra="forbid")
    # Cut the training and log-prob passes by tokens; replaces train_micro_batch_size and
    # logprob_batch_size. Not with sequence_packing.
    enabled: bool = False
    # Tokens per forward pass: samples x the longest of them (padding included); at least
    # policy.max_total_sequence_length.
    max_tokens_per_microbatch: int = Field(4096, gt=0)


# The attention and MLP projections of Llama/Qwen/Mistral-style decoders: the usual LoRA targets.
DEFAULT_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoraConfig(BaseModel):
    """Low-rank adapters (peft) on ``target_modules``: only the adapters train, the base weights stay
    frozen and, with the adapter disabled, are the reference policy. ``target_modules`` are module
    names matched as the last parts of a module's path (``q_proj`` matches ``model.layers.0.self_attn.q_proj``),
    or ``all-linear``: every linear layer but the output head."""

    model_config = ConfigDict(extra="forbid")
    # Train LoRA adapters instead of the whole model (HF backend only).
    enabled: bool = False
    # Rank of each adapter: the inner dimension of its low-rank update.
    rank: int = Field(8, gt=0)
    # Scale of the update: it is multiplied by alpha / rank.
    alpha: float = Field(16, gt=0)
    # Dropout on the adapters' input while training (0: none).
    dropout: float = Field(0.0, ge=0, lt=1)
    # Module names to adapt (q_proj matches model.layers.0.self_attn.q_proj), or "all-linear": every
    # linear layer but the output head.
    target_modules: list[str] | Literal["all-linear"] = Field(default_factory=lambda: list(DEFAULT_LORA_TARGETS))

    @field_validator("target_modules", mode="before")
    @classmethod
    def _names_or_all_linear(cls, value: Any) -> Any:
        # A single name would otherwise fail with pydantic's union error, which names neither form.
        if isinstance(value, str) and value != "all-linear":
            raise ValueError(f"policy.lora.target_modules must be a list of module names or 'all-linear', got {value!r}")
        if isinstance(value, (list, tuple)):
            if not value:
                raise ValueError("policy.lora.target_modules is empty: name the modules to adapt, or 'all-linear'")
            if bad := [v for v in value if not isinstance(v, str) or not v.strip(".")]:
                raise ValueError(f"policy.lora.target_modules: {bad!r} are not module names")
            if len(set(value)) != len(value):
                raise ValueError(f"policy.lora.target_modules lists a module twice: {value!r}")
        return value


class PolicyConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model_name: str = Field(..., description="HF hub id or local folder (save_pretrained layout)")
    # HF hub id or local folder of the tokenizer; None: model_name's.
    tokenizer_name: str | None = None
    # How prompts become text: "default" (the tokenizer's own chat template; a tokenizer without one is
    # refused), "chatml", a jinja template (a string with {% or {{, or the path of a .jinja file), or
    # "raw" / null: no template, the messages' text as it is (a base model reading plain prompts).
    chat_template: str | None = "default"
    # The training worker (models/policy/backends.py): "hf" (transformers, FSDP2) or "megatron"
    # (Megatron-core GPTModel; pip install 'nemo_like[megatron]'), or a registered name.
    backend: str = "hf"
    # Compute dtype. HF backend: weights stay float32, a lower precision is FSDP2 mixed precision (with
    # fsdp: false, autocast). Megatron: the parameters' dtype. Rollout workers on a GPU generate in it.
    # float16 is refused: training in it needs loss scaling, which no worker here does.
    precision: Literal["float32", "bfloat16", "float16"] = "float32"
    # Let transformers run the model's own code from the hub (models it does not ship); passed to from_pretrained.
    trust_remote_code: bool = False
    # Samples per optimizer step, over all workers.
    train_global_batch_size: int = Field(64, gt=0)
    # Samples per forward/backward pass on a worker (gradients accumulate up to the global batch).
    train_micro_batch_size: int = Field(16, gt=0)
    # Samples per forward pass of the log-prob passes (old and reference policy) on a worker.
    logprob_batch_size: int = Field(32, gt=0)
    # Samples per generate call on a worker ("generate" engine), or rows decoded together ("continuous"
    # engine, unless generation.max_num_seqs is set).
    generation_batch_size: int = Field(64, gt=0)
    # Longest sample in tokens: prompt, every turn and environment reply; generation stops there (truncated).
    max_total_sequence_length: int = Field(128, gt=1)
    # Clip the gradient's global L2 norm to this before each optimizer step; None: no clipping.
    max_grad_norm: float | None = 1.0
    # HF backend: FSDP2 over the workers (sharded weights, gradients and optimizer state; with one worker
    # only for a precision other than float32). Off: every worker holds the whole model and the workers
    # average their gradients (plain data parallel, as DDP): at float32 the same update, more memory.
    fsdp: bool = True
    # Several workers: reorder each global batch so that every worker gets about the same tokens (a
    # group of samples sharing a prompt kept together), for the training and log-prob passes (the
    # critic's too); the update is the same (verl's balance_batch). train/dp_token_imbalance: the
    # busiest worker's tokens / the mean.
    balance_batch: bool = True
    # Recompute activations in the backward pass instead of keeping them: less memory, more compute
    # (not on the Megatron backend).
    activation_checkpointing: bool = False
    # Threads per worker for intra-op parallelism; None = the worker's CPU share from the cluster.
    num_threads: int | None = None
    optimizer: OptimizerConfig = OptimizerConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    generation: GenerationConfig = GenerationConfig()
    sequence_packing: SequencePackingConfig = SequencePackingConfig()
    dynamic_batching: DynamicBatchingConfig = DynamicBatchingConfig()
    lora: LoraConfig = LoraConfig()

    @property
    def packing_row_length(self) -> int:
        """The row length set, or the longest a chosen one may be."""
        sp = self.sequence_packing
        return sp.row_length or min(sp.max_tokens_per_microbatch, 4 * self.max_total_sequence_length)

    @model_validator(mode="after")
    def _token_budgets_fit(self) -> PolicyConfig:
        sp, db, longest = self.sequence_packing, self.dynamic_batching, self.max_total_sequence_length
        if sp.enabled and db.enabled:
            raise ValueError("policy.sequence_packing.enabled and policy.dynamic_batching.enabled are both true; "
                             "packing already cuts micro-batches by tokens: enable one of them")
        for key, on, budget in (("sequence_packing.max_tokens_per_microbatch", sp.enabled, sp.max_tokens_per_microbatch),
                                ("sequence_packing.row_length", sp.enabled, sp.row_length),
                                ("dynamic_batching.max_tokens_per_microbatch", db.enabled, db.max_tokens_per_microbatch)):
            if on and budget is not None and budget < longest:
                raise ValueError(f"policy.{key} ({budget}) is smaller than the longest sample, "
                                 f"policy.max_total_sequence_length ({longest}); raise it to at least {longest}")
        if sp.enabled and sp.row_length and sp.row_length > sp.max_tokens_per_microbatch:
            raise ValueError(f"policy.sequence_packing.row_length ({sp.row_length}) is larger than "
                             f"policy.sequence_packing.max_tokens_per_microbatch ({sp.max_tokens_per_microbatch})")
        return self

    @field_validator("chat_template")
    @classmethod
    def _template_readable(cls, value: str | None) -> str | None:
        resolve_chat_template(value)  # a missing file or a syntax error now, not after Ray started
        return value

    _no_float16 = field_validator("precision")(lambda cls, v: refuse_float16_training(v, "policy.precision"))

    @model_validator(mode="after")
    def _micro_fits_global(self) -> PolicyConfig:
        if self.train_micro_batch_size > self.train_global_batch_size:
            raise ValueError(
                f"policy.train_micro_batch_size ({self.train_micro_batch_size}) is larger than "
                f"policy.train_global_batch_size ({self.train_global_batch_size})"
            )
        return self


class PolicyInterface(abc.ABC):
    """What an RL algorithm needs from a trainable policy."""

    @abc.abstractmethod
    def get_logprobs(self, data: BatchedDataDict) -> BatchedDataDict:
        """`data` has input_ids [B,T] (right padded) and input_lengths [B]; returns logprobs [B,T]
        where logprobs[:, t] = log p(input_ids[:, t] | input_ids[:, :t]) and logprobs[:, 0] = 0."""

    @abc.abstractmethod
    def get_reference_policy_logprobs(self, data: BatchedDataDict) -> BatchedDataDict:
        """Same as get_logprobs under the frozen reference (initial) weights: key reference_logprobs."""

    @abc.abstractmethod
    def train(self, data: BatchedDataDict, loss_fn: Any) -> dict[str, float]:
        """One pass over `data` in global batches of train_global_batch_size; returns metrics."""

    @abc.abstractmethod
    def save_checkpoint(self, path: str) -> None: ...

    @abc.abstractmethod
    def load_checkpoint(self, path: str) -> None: ...

    # Hooks for colocated GPU set-ups (free generation memory before training, etc.).
    # On CPU with the in-worker HF generation backend there is nothing to move, so they do nothing.
    def prepare_for_training(self) -> None:
        return None

    def finish_training(self) -> None:
        return None

    def offload_before_refit(self) -> None:
        return None

    def offload_after_refit(self) -> None:
        return None

    @abc.abstractmethod
    def shutdown(self) -> None: ...
