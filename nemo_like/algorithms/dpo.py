"""DPO: direct preference optimisation of a policy on preference pairs, on the policy's own workers.

    uv run examples/run_dpo.py [--config examples/configs/dpo_math_tiny.yaml] [key=value ...]

Each step takes ``policy.train_global_batch_size / 2`` pairs (both sides of a pair are sequences of
the global batch): one log-prob pass at the weights the step trains gives DPO's loss, metrics and
per-sequence weights (``dpo_loss.dpo_terms``), then one training pass with the weighted-likelihood
surrogate (``dpo_loss.DPOLossFn``), whose gradient is DPO's exactly however the worker cuts the batch.

The reference log-probs are those of the starting weights (the reference model; with
``policy.lora`` the adapter starts at zero, so the frozen base): computed once for every pair before
the first step, kept on the driver and saved with each checkpoint, so a resumed run uses the very
same numbers. A sequence's log-prob is the sum over its response tokens (the prompt masked); IPO
divides it by the response's token count (TRL's convention). With ``policy.sequence_packing.enabled``
and ``share_prompt_prefix`` the two sides of a pair share their prompt, which packing computes once.

Held out: every ``trainer.val_period`` steps and at the end, the held-out pairs' preference accuracy
and reward margin (``val/pair_accuracy``, ``val/reward_margin``); before the first step and after the
last, greedy accuracy on ``validation.math_problems`` arithmetic problems (``val/math_accuracy``),
compared problem by problem (McNemar) in the end-of-run line GRPO prints.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from nemo_like.algorithms.dpo_loss import DPOLossConfig, DPOLossFn, DPOPairLossFn, dpo_terms, sequence_logprobs
from nemo_like.algorithms.rm import RMDataConfig, load_pairs, resolve_model
from nemo_like.algorithms.trainer_base import (
    OfflineRun,
    OfflineTrainerConfig,
    check_policy_only_cluster,
    epoch_batches,
    load_trainer_config,
)
from nemo_like.config_sections import ClusterConfig
from nemo_like.data.errors import DataError
from nemo_like.data.preferences import PreferencePair
from nemo_like.data.processors import render_chat, tokenize_text
from nemo_like.distributed.batched_data_dict import BatchedDataDict
from nemo_like.environments.math_environment import verify_math_answer
from nemo_like.models.policy.interfaces import PolicyConfig
from nemo_like.models.policy.packing import attention_cost_ratio, count_microbatches
from nemo_like.utils.checkpoint import CheckpointingConfig
from nemo_like.utils.logger import LoggerConfig
from nemo_like.utils.stats import paired_change

__all__ = ["DPOConfig", "accuracy_line", "attention_ratio", "dpo_step", "load_dpo_config", "tokenize_dpo_pairs", "train_dpo"]

DPO_ROLES = {"policy": "the policy DPO trains"}
_OTHER_ROLES = {"generation": "DPO generates only for its held-out check, on the policy's workers; remove the key",
                "reference": "the reference log-probs are the starting policy's, computed on its workers; remove the key",
                "critic": "there is no value model in DPO; remove the key",
                "reward_model": "DPO learns from the pairs, with no reward model; remove the key"}


class DPOTrainerConfig(OfflineTrainerConfig):
    """How long DPO trains and how often it scores the held-out pairs."""


class DPOValidationConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    # Held-out arithmetic problems answered greedily before the first step and after the last (0: none).
    math_problems: int = Field(500, ge=0)
    # Seed of the problems' generator (2: the GRPO tiny math config's validation set).
    seed: int = 2


class DPOConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    # The policy trained (model_name "bootstrap:<GRPO config>": that config's bootstrapped base model).
    # train_global_batch_size counts sequences: a step trains half as many pairs.
    policy: PolicyConfig
    # Preference pairs: JSONL files (data.train, data.validation) or data.math_pairs; data.max_length
    # tokens per side (prompt and response).
    data: RMDataConfig
    dpo: DPOLossConfig = DPOLossConfig()
    trainer: DPOTrainerConfig = DPOTrainerConfig()
    validation: DPOValidationConfig = DPOValidationConfig()
    # The language-model run's cluster section: the policy role only (cluster.num_workers, ...).
    cluster: ClusterConfig = ClusterConfig()
    logger: LoggerConfig = LoggerConfig(log_dir="logs/dpo")
    # step_<N> checkpoints (weights, optimizer, reference log-probs, where the run is); a run resumes
    # from the newest intact one in checkpoint_dir. Ranked by the held-out pair accuracy.
    checkpointing: CheckpointingConfig = CheckpointingConfig(enabled=False, checkpoint_dir="results/dpo/checkpoints",
                                                             save_period=50, metric_name="val/pair_accuracy")
    # Where the trained policy is saved (a plain HF folder; with LoRA the adapter merged in).
    output_dir: str = "results/dpo"

    @model_validator(mode="after")
    def _placement(self) -> DPOConfig:
        c = self.cluster
        check_policy_only_cluster(c, "DPO", DPO_ROLES, _OTHER_ROLES)
        gbs = self.policy.train_global_batch_size
        if gbs % 2 or gbs % c.num_workers:
            raise ValueError(f"policy.train_global_batch_size={gbs} counts sequences (two a pair): it must be even "
                             f"and divide over cluster.num_workers={c.num_workers} workers")
        if self.data.max_length > self.policy.max_total_sequence_length:
            raise ValueError(f"data.max_length={self.data.max_length} is longer than "
                             f"policy.max_total_sequence_length={self.policy.max_total_sequence_length}")
        return self


def load_dpo_config(path: str | Path, overrides: list[str] | None = None) -> DPOConfig:
    """The YAML (with its ``defaults:``) and ``key=value`` overrides, checked: ConfigError naming the key."""
    return load_trainer_config(DPOConfig, path, overrides)


def _common_prefix(a: torch.Tensor, b: torch.Tensor) -> int:
    n = min(len(a), len(b))
    diff = (a[:n] != b[:n]).nonzero()
    return int(diff[0]) if len(diff) else n


def tokenize_dpo_pairs(pairs: list[PreferencePair], tokenizer: Any, max_length: int, what: str = "pair"
                       ) -> dict[str, torch.Tensor]:
    """``input_ids`` [2P, T] (chosen at even rows, rejected at odd) right-padded, ``input_lengths``
    [2P], ``token_mask`` [2P, T] (1 on the response's tokens: after the prompt as the chat template
    renders it with the generation prompt), ``truncated`` [P] (a side cut to ``max_length`` tokens).
    DataError naming the pair when a side keeps no response token or both sides are cut the same."""
    seqs, starts, truncated = [], [], []
    for k, pair in enumerate(pairs):
        prompt = tokenize_text(tokenizer, render_chat(tokenizer, [{"role": r, "content": c} for r, c in pair.prompt],
                                                      add_generation_prompt=True))
        sides = [tokenize_text(tokenizer, render_chat(tokenizer, pair.messages(s), add_generation_prompt=False))
                 for s in ("chosen", "rejected")]
        truncated.append(any(len(s) > max_length for s in sides))
        sides = [s[:max_length] for s in sides]
        for s in sides:
            start = _common_prefix(s, prompt)
            if start >= len(s):
                raise DataError(f"{what} {k + 1}: a side has no response token left within data.max_length="
                                f"{max_length} tokens (its prompt takes {len(prompt)}); raise data.max_length")
            seqs.append(s)
            starts.append(start)
        if torch.equal(sides[0], sides[1]):
            raise DataError(f"{what} {k + 1}: 'chosen' and 'rejected' are the same in their first "
                            f"data.max_length={max_length} tokens; raise data.max_length")
    width = max(len(s) for s in seqs)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    ids = torch.full((len(seqs), width), pad, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.float32)
    for i, (s, start) in enumerate(zip(seqs, starts)):
        ids[i, :len(s)] = s
        mask[i, start:len(s)] = 1.0
    return {"input_ids": ids, "input_lengths": torch.tensor([len(s) for s in seqs]), "token_mask": mask,
            "truncated": torch.tensor(truncated)}


def _rows(t: dict[str, torch.Tensor], rows: list[int] | None = None) -> BatchedDataDict:
    pick = (lambda x: x) if rows is None else (lambda x: x[rows])
    return BatchedDataDict(input_ids=pick(t["input_ids"]), input_lengths=pick(t["input_lengths"]),
                           token_mask=pick(t["token_mask"]))


def _seq_logprobs(policy: Any, data: BatchedDataDict) -> torch.Tensor:
    return sequence_logprobs(policy.get_logprobs(data)["logprobs"], data["token_mask"])


def evaluate_pairs(policy: Any, val: dict[str, torch.Tensor], ref: torch.Tensor, cfg: DPOLossConfig
                   ) -> dict[str, float]:
    """Held-out pairs at the current weights: ``val/pair_accuracy`` (the chosen side's reward is
    higher; a tie counts half), ``val/reward_margin``, ``val/loss``, ``val/chosen_reward``, ``val/rejected_reward``."""
    _, m = dpo_terms(_seq_logprobs(policy, _rows(val)), ref, val["token_mask"].sum(1), cfg)
    return {"val/pair_accuracy": m["reward_accuracy"], "val/reward_margin": m["reward_margin"], "val/loss": m["loss"],
            "val/chosen_reward": m["chosen_reward"], "val/rejected_reward": m["rejected_reward"]}


def _math_problems(cfg: DPOValidationConfig) -> list[dict[str, Any]]:
    from nemo_like.data.datasets import ArithmeticConfig, generate_arithmetic_dataset

    ds = generate_arithmetic_dataset(ArithmeticConfig(split="validation", num_samples=cfg.math_problems,
                                                      seed=cfg.seed, min_value=0, max_value=99, ops=["+"]))
    return [dict(r) for r in ds]


def greedy_math(policy: Any, tokenizer: Any, problems: list[dict[str, Any]]) -> list[bool]:
    """Whether the policy's greedy answer to each problem (its user turn, as the GRPO math task asks
    it) is right, by the math environment's verifier."""
    prompts = [tokenize_text(tokenizer, render_chat(tokenizer, [{"role": "user", "content": p["problem"]}],
                                                    add_generation_prompt=True)) for p in problems]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    ids = torch.full((len(prompts), max(len(p) for p in prompts)), pad, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, :len(p)] = p
    lengths = torch.tensor([len(p) for p in prompts])
    out = policy.generate(BatchedDataDict(input_ids=ids, input_lengths=lengths), greedy=True)
    policy.finish_generation()
    correct = []
    for i, p in enumerate(problems):
        n, g = int(lengths[i]), int(out["generation_lengths"][i])
        text = tokenizer.decode(out["output_ids"][i, n:n + g].tolist(), skip_special_tokens=True)
        correct.append(verify_math_answer(text, str(p["expected_answer"])) == 1.0)
    return correct


def accuracy_line(result: dict[str, Any]) -> str:
    """GRPO's end-of-run line: held-out greedy accuracy before -> after, points, problems gained and
    lost with McNemar's p."""
    before, after = result.get("math_before"), result.get("math_after")
    if not before or not after:
        return "no held-out greedy accuracy (validation.math_problems=0)"
    a0, a1 = sum(before) / len(before), sum(after) / len(after)
    return (f"held-out greedy accuracy: {a0:.1%} at step 0 -> {a1:.1%} at step {result['steps']} "
            f"({(a1 - a0) * 100:+.1f} points; {paired_change(before, after)}; {len(before)} problems)")


def attention_ratio(model_dir: str, trust_remote_code: bool = False) -> float:
    """The model's ``attention_cost_ratio``: what packing's planner weighs rows with (as the worker does)."""
    from transformers import AutoConfig

    return attention_cost_ratio(AutoConfig.from_pretrained(model_dir, trust_remote_code=trust_remote_code))


def _one_micro_batch(policy: Any, batch: BatchedDataDict, ratio: float) -> bool:
    """The worker computes this batch in a single forward pass: one worker, and its plan (the same
    pure function the worker calls on the same tensors) is one micro-batch, so every pair is whole in it."""
    return policy.world_size == 1 and count_microbatches(batch, policy.cfg, policy.cfg.train_micro_batch_size,
                                                         ratio) == 1


def dpo_step(policy: Any, train: dict[str, torch.Tensor], ref: torch.Tensor, n_tokens: torch.Tensor,
             pairs: list[int], cfg: DPOLossConfig, ratio: float) -> dict[str, float]:
    """One optimizer step on ``pairs`` (indices into ``train``, ``tokenize_dpo_pairs``' layout): the
    ``train/`` metrics (DPO's loss and rewards at the weights the step trains, and the training pass's),
    ``timing/logprobs`` and ``timing/step``. One pass (``DPOPairLossFn``) when ``dpo.one_pass`` and the
    step is one micro-batch on one worker; else a log-prob pass, then the surrogate (``DPOLossFn``)."""
    ts = time.perf_counter()
    rows = [2 * p + k for p in pairs for k in (0, 1)]
    batch = _rows(train, rows)
    batch["sample_mask"] = torch.ones(len(rows))
    if cfg.one_pass and _one_micro_batch(policy, batch, ratio):
        batch["pair_index"] = torch.arange(len(rows)) // 2
        batch["pair_side"] = torch.arange(len(rows)) % 2
        batch["reference_seq_logprobs"], batch["response_tokens"] = ref[rows], n_tokens[rows].float()
        tm = policy.train(batch, DPOPairLossFn(cfg))
        m = {"loss": tm["dpo_loss"]} | {k: tm[k] for k in ("reward_accuracy", "reward_margin", "chosen_reward",
                                                           "rejected_reward")}
        t_lp, one = 0.0, 1.0
    else:
        # The step's weights' log-probs give the loss and each sequence's weight (dpo_loss.py).
        weights, m = dpo_terms(_seq_logprobs(policy, batch), ref[rows], n_tokens[rows], cfg)
        t_lp, one = time.perf_counter() - ts, 0.0
        batch["dpo_weight"] = weights
        tm = policy.train(batch, DPOLossFn())
    metrics = {f"train/{k}": v for k, v in m.items()}
    metrics |= {f"train/{k}": tm[k] for k in ("grad_norm", "lr", "computed_tokens_ratio", "padding_efficiency")
                if k in tm}
    return metrics | {"train/one_pass": one, "timing/logprobs": t_lp, "timing/step": time.perf_counter() - ts}


def train_dpo(cfg: DPOConfig) -> dict[str, Any]:
    """The whole run; returns the first and last held-out metrics, the greedy results before and after,
    the steps and the saved folder."""
    from transformers import AutoTokenizer

    from nemo_like.models.policy.lm_policy import Policy

    train_pairs, val_pairs = load_pairs(cfg.data)  # data errors before Ray starts
    pairs_per_step = cfg.policy.train_global_batch_size // 2
    if len(train_pairs) < pairs_per_step:
        raise DataError(f"{len(train_pairs)} training pairs are fewer than one step's "
                        f"{pairs_per_step} (policy.train_global_batch_size={cfg.policy.train_global_batch_size} "
                        "sequences, two a pair)")
    t = cfg.trainer
    batches = epoch_batches(len(train_pairs), pairs_per_step, t.num_epochs, t.seed, t.max_steps)
    plan = {"pairs": len(train_pairs), "pairs_per_step": pairs_per_step, "seed": t.seed}
    problems = _math_problems(cfg.validation) if cfg.validation.math_problems else []
    with OfflineRun(cfg.cluster, cfg.checkpointing, cfg.logger, plan, len(batches)) as run:
        model_dir = resolve_model(cfg.policy.model_name, key="policy.model_name")
        tok = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=cfg.policy.trust_remote_code)
        if tok.pad_token_id is None:
            tok.pad_token = tok.eos_token
        train = tokenize_dpo_pairs(train_pairs, tok, cfg.data.max_length, "training pair")
        val = tokenize_dpo_pairs(val_pairs, tok, cfg.data.max_length, "held-out pair")
        # The reference is the starting weights' log-probs (computed below), not a second model copy.
        policy = Policy(run.place(DPO_ROLES), cfg.policy.model_copy(update={"model_name": model_dir}),
                        seed=t.seed, init_reference_model=False)
        run.own(policy.shutdown)
        state = run.open(cfg, load_weights=lambda p: policy.load_checkpoint(str(p / "policy")))
        if state is None:
            tr = time.perf_counter()
            # Before any step: these weights are the reference, for the training and the held-out pairs.
            state = {"ref_train": _seq_logprobs(policy, _rows(train)), "ref_val": _seq_logprobs(policy, _rows(val))}
            state["first"] = evaluate_pairs(policy, val, state["ref_val"], cfg.dpo)
            state["math_before"] = greedy_math(policy, tok, problems) if problems else []
            if problems:
                state["first"]["val/math_accuracy"] = sum(state["math_before"]) / len(problems)
            state |= {"last": dict(state["first"]), "last_val": 0}
            run.logger.log_metrics(state["first"] | {"timing/reference": time.perf_counter() - tr}, step=0)
        ref_train, ref_val = state["ref_train"], state["ref_val"]
        n_tokens = train["token_mask"].sum(1)
        ratio = attention_ratio(model_dir, cfg.policy.trust_remote_code)
        t0, step_seconds = time.perf_counter(), []
        for step, (epoch, pairs) in run.steps(batches):
            metrics = dpo_step(policy, train, ref_train, n_tokens, pairs, cfg.dpo, ratio)
            step_seconds.append(metrics["timing/step"])
            metrics["train/epoch"] = float(epoch)
            if (t.val_period and step % t.val_period == 0) or run.is_last(step):
                state["last"], state["last_val"] = evaluate_pairs(policy, val, ref_val, cfg.dpo), step
                if run.is_last(step) and problems:
                    # Greedy answers after the last step, in the last checkpoint: a resumed finished run
                    # reports them without generating again.
                    state["math_after"] = greedy_math(policy, tok, problems)
                    state["last"]["val/math_accuracy"] = sum(state["math_after"]) / len(problems)
                metrics |= state["last"]
            run.logger.log_metrics(metrics, step=step)
            run.maybe_save(step, lambda p: policy.save_checkpoint(str(p / "policy")), state,
                           val_metrics=state["last"], val_step=state["last_val"])
        out = Path(cfg.output_dir)
        policy.export_merged(str(out))
        return {"first": state["first"], "last": state["last"], "math_before": state.get("math_before"),
                "math_after": state.get("math_after"), "steps": len(batches), "resumed_at": run.start_step,
                "seconds": time.perf_counter() - t0, "seconds_per_step": step_seconds,
                "output_dir": str(out), "train_pairs": len(train_pairs), "val_pairs": len(val_pairs),
                "truncated_pairs": int(train["truncated"].sum() + val["truncated"].sum())}
