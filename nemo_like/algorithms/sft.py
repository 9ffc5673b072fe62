"""Supervised fine-tuning on chat data, a trainer of its own over the same Policy facade and workers as GRPO.

    uv run examples/run_sft.py [--config examples/configs/sft_math_tiny.yaml] [key=value ...]

Conversations (JSON Lines or an ``hf:`` dataset, ``nemo_like/data/sft_data.py``) are rendered by the
policy's chat template as GRPO renders prompts; the loss is the NLL of every assistant turn's tokens
(``NLLLossFn`` through ``policy.train``). Each step trains one global batch (``policy.train_global_batch_size``)
of an epoch's shuffle; every ``trainer.val_period`` steps and at the end the held-out conversations' per-token
NLL is ``val/loss``. Packing and LoRA are the policy's (``policy.sequence_packing``, ``policy.lora``). With
``checkpointing.enabled`` the run saves step checkpoints and resumes exactly from the newest one; the result
is saved to ``output_dir`` as a plain HF folder (LoRA merged). The tiny model's bootstrap trains with the same
step loop (``sft_loop.sft_steps``).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, model_validator

from nemo_like.algorithms.rm import BOOTSTRAP_PREFIX, resolve_model
from nemo_like.algorithms.sft_loop import sft_batch, sft_steps, validation_loss
from nemo_like.algorithms.trainer_base import (
    OfflineRun,
    OfflineTrainerConfig,
    check_policy_only_cluster,
    epoch_batches,
    load_trainer_config,
)
from nemo_like.config_sections import ClusterConfig
from nemo_like.data.errors import DataError
from nemo_like.data.sft_data import SFTDataConfig, read_conversations, tokenize_conversations
from nemo_like.models.policy.interfaces import PolicyConfig
from nemo_like.utils.checkpoint import CheckpointingConfig
from nemo_like.utils.logger import LoggerConfig

__all__ = ["SFTConfig", "SFTTrainerConfig", "load_sft_config", "train_sft"]


class SFTTrainerConfig(OfflineTrainerConfig):
    """How long SFT trains and how often it measures the held-out loss."""


SFT_ROLES = {"policy": "the model trained"}
_OTHER_ROLES = {"generation": "nothing generates in SFT; remove the key",
                "critic": "there is no value model here; remove the key",
                "reference": "SFT has no reference model; remove the key",
                "reward_model": "SFT scores nothing; remove the key"}


class SFTConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    # The model trained: model_name an HF id or folder, or "bootstrap:<GRPO config>" (that config's
    # bootstrapped tiny base model, built if not cached); batch sizes, optimizer, scheduler, packing, LoRA
    # and chat_template as in a GRPO run.
    policy: PolicyConfig
    # The conversations: chat JSONL files or hf: datasets (docs/guides/sft.md).
    data: SFTDataConfig
    trainer: SFTTrainerConfig = SFTTrainerConfig()
    # The language-model run's cluster section: the model trained is the policy role.
    cluster: ClusterConfig = ClusterConfig()
    logger: LoggerConfig = LoggerConfig(log_dir="logs/sft")
    # step_<N> checkpoints every save_period steps and at the end; ranked by the held-out loss.
    checkpointing: CheckpointingConfig = CheckpointingConfig(enabled=False, checkpoint_dir="results/sft/checkpoints",
                                                             save_period=50, metric_name="val/loss",
                                                             higher_is_better=False)
    # Where the trained model is saved: a plain HF folder (with LoRA, the adapter merged).
    output_dir: str = "results/sft"

    @model_validator(mode="after")
    def _checks(self) -> SFTConfig:
        """Before Ray starts: lengths that fit, the roles this run has, a batch its workers split."""
        longest = self.policy.max_total_sequence_length
        if self.data.max_length is not None and self.data.max_length > longest:
            raise ValueError(f"data.max_length ({self.data.max_length}) is longer than policy.max_total_sequence_length "
                             f"({longest}), which sizes the packing budgets; raise that or lower data.max_length")
        c = self.cluster
        check_policy_only_cluster(c, "SFT", SFT_ROLES, _OTHER_ROLES)
        gbs = self.policy.train_global_batch_size
        if gbs % c.num_workers:
            raise ValueError(f"policy.train_global_batch_size={gbs} does not divide over cluster.num_workers="
                             f"{c.num_workers} workers; use a multiple of {c.num_workers}")
        return self


def load_sft_config(path: str | Path, overrides: list[str] | None = None) -> SFTConfig:
    """The YAML (with its ``defaults:``) and ``key=value`` overrides, checked: ConfigError naming the key."""
    return load_trainer_config(SFTConfig, path, overrides)


def resolve_policy_model(name: str) -> str:
    if name.startswith(BOOTSTRAP_PREFIX):
        return resolve_model(name)
    from nemo_like.models.pretrained import resolve_model_source

    return resolve_model_source(name, key="policy.model_name")


def load_sft_tokenizer(cfg: SFTConfig, model_dir: str) -> Any:
    from nemo_like.config import ConfigError
    from nemo_like.models.tokenizers import load_tokenizer

    try:  # the template the policy's workers put on their tokenizer: what the model sees at RL time
        return load_tokenizer(cfg.policy.tokenizer_name or model_dir, chat_template=cfg.policy.chat_template,
                              trust_remote_code=cfg.policy.trust_remote_code)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def train_sft(cfg: SFTConfig) -> dict[str, Any]:
    """The whole run; returns the first and last held-out losses, the steps, the counts and the saved folder."""
    # Data errors (file:line) before Ray starts; tokenizing waits for the model (maybe bootstrapped).
    train_convs = read_conversations(cfg.data.train, cfg.data.messages_key, "data.train")
    val_convs = (read_conversations(cfg.data.validation, cfg.data.messages_key, "data.validation")
                 if cfg.data.validation is not None else [])
    gbs = cfg.policy.train_global_batch_size
    if len(train_convs) < gbs:
        raise DataError(f"{cfg.data.train.path}: {len(train_convs)} conversations are fewer than one global batch "
                        f"(policy.train_global_batch_size={gbs})")
    t = cfg.trainer
    batches = epoch_batches(len(train_convs), gbs, t.num_epochs, t.seed, t.max_steps)
    # What fixes the batches: a resumed run must go on with the same ones.
    plan = {"conversations": len(train_convs), "train_global_batch_size": gbs, "seed": t.seed,
            "max_length": cfg.data.max_length or cfg.policy.max_total_sequence_length}
    with OfflineRun(cfg.cluster, cfg.checkpointing, cfg.logger, plan, len(batches)) as run:
        from nemo_like.models.policy.lm_policy import Policy

        model_dir = resolve_policy_model(cfg.policy.model_name)  # may build the bootstrapped base (needs the CPUs)
        tok = load_sft_tokenizer(cfg, model_dir)
        max_len = plan["max_length"]
        train, train_counts = tokenize_conversations(tok, train_convs, max_len, cfg.data.train.path)
        val, val_counts = (tokenize_conversations(tok, val_convs, max_len, cfg.data.validation.path)
                           if cfg.data.validation is not None else ([], {"truncated": 0, "no_loss": 0}))
        val_data = sft_batch(val, tok.pad_token_id) if val else None
        policy_cfg = cfg.policy.model_copy(update={"model_name": model_dir})
        policy = Policy(run.place(SFT_ROLES), policy_cfg, seed=t.seed, init_reference_model=False, name_prefix="policy")
        run.own(policy.shutdown)

        def evaluate() -> dict[str, float]:
            if val_data is None:
                return {}
            t0 = time.perf_counter()
            return validation_loss(policy, val_data) | {"timing/validation": time.perf_counter() - t0}

        state = run.open(cfg, load_weights=lambda p: policy.load_checkpoint(str(p / "policy")))
        if state is None:
            first = evaluate()
            state = {"first": first, "last": first, "last_val": 0}
            run.logger.log_metrics(first | {"data/truncated": float(train_counts["truncated"])}, step=0)

        def after_step(step: int, m: dict[str, float]) -> None:
            epoch = batches[step - 1][0]
            row = {f"train/{k}": v for k, v in m.items() if k != "seconds"}
            row |= {"train/epoch": float(epoch), "timing/train": m["seconds"]}
            # Held-out loss every val_period steps and after the last step (inside the loop, so the
            # last checkpoint holds the final loss and a resumed finished run adds no row).
            if (t.val_period and step % t.val_period == 0) or run.is_last(step):
                state["last"], state["last_val"] = evaluate(), step
                row |= state["last"]
            run.logger.log_metrics(row, step=step)
            run.maybe_save(step, lambda p: policy.save_checkpoint(str(p / "policy")), state,
                           val_metrics=state["last"], val_step=state["last_val"])

        todo = [(step, [train[i] for i in idx]) for step, (_, idx) in run.steps(batches)]
        t0 = time.perf_counter()
        history = sft_steps(policy, todo, pad_id=tok.pad_token_id, global_batch_size=gbs,
                            micro_batch_size=cfg.policy.train_micro_batch_size, after_step=after_step,
                            total=len(todo))
        seconds = time.perf_counter() - t0
        out = Path(cfg.output_dir)
        policy.export_merged(str(out))
        return {"first": state["first"], "last": state["last"], "steps": len(batches), "resumed_at": run.start_step,
                "seconds": seconds, "history": history, "output_dir": str(out),
                "train_conversations": len(train), "val_conversations": len(val),
                "truncated": train_counts["truncated"] + val_counts["truncated"],
                "no_loss": train_counts["no_loss"] + val_counts["no_loss"]}
