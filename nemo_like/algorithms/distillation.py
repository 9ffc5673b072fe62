"""On-policy distillation: the student (the policy) samples, a teacher scores each sampled token, and
the student is trained towards the teacher on its own samples.

A ``teacher:`` section turns it on in a GRPO run (``examples/configs/distill_math_tiny.yaml``); the
teacher is a frozen model on a worker group of its own (``cluster.teacher``, or the ``teacher`` role
on ``cluster.resource_pools``). Two objectives (``teacher.objective``):

- ``reverse_kl`` (Thinking Machines' on-policy distillation; GKD with the student's samples): per
  sampled token, ``log p_teacher(x_t) - log p_student(x_t)`` is the token's advantage, undiscounted,
  trained with the policy-gradient loss. Its expectation under the student's samples is minus the
  reverse KL, so maximising it minimises ``KL(student || teacher)``; one number per token, so the
  teacher pass is a plain log-prob pass.
- ``topk``: the KL between the two next-token distributions over the teacher's ``topk_k`` most
  likely tokens plus one bucket for the rest of the vocabulary (NeMo RL's ``topk_logits_k``;
  ``topk_kl``: forward, reverse or mixed), a supervised loss added to the policy-gradient one
  (``TopKDistillLossFn``).

``reward_weight`` mixes in the environments' (group-relative) advantages, so a run can distil and
reinforce at once; 0 (the default) distils only, the rewards still being graded and logged.
The teacher is asked at training time, on the batch being trained, so asynchronous rollouts need
nothing more. Teacher and student must share a tokenizer (refused before Ray starts otherwise).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from nemo_like.algorithms.pg_terms import check_2d

__all__ = ["DistillStage", "TeacherConfig", "topk_kl"]


class TeacherConfig(BaseModel):
    """The frozen model the student learns from, and how (``docs/guides/distillation.md``)."""

    model_config = ConfigDict(extra="forbid")
    # HF hub id, model folder (examples/export_model.py writes one from a checkpoint) or gguf:<file>; its
    # tokenizer must be the policy's (the same vocabulary), checked before Ray starts.
    model_name: str
    # Compute dtype of the teacher's forward passes ("float32" or "bfloat16").
    precision: Literal["float32", "bfloat16"] = "float32"
    # Let transformers run the teacher's own code from its folder (only for a model you trust).
    trust_remote_code: bool = False
    # Samples per teacher forward pass on a worker.
    logprob_batch_size: int = Field(32, gt=0)
    # "reverse_kl": the per-token log p_teacher - log p_student of the sampled tokens as their advantage;
    # "topk": a KL over the teacher's topk_k most likely tokens (and the rest as one bucket), added to the loss.
    objective: Literal["reverse_kl", "topk"] = "reverse_kl"
    # Weight of the distillation term: of the per-token advantage (reverse_kl) or of the KL loss (topk).
    kl_coef: float = Field(1.0, ge=0)
    # Weight of the environments' advantages (grpo.advantage_estimator's) mixed in; 0: distillation only.
    reward_weight: float = Field(0.0, ge=0)
    # topk: how many of the teacher's most likely tokens each position compares (the rest: one bucket).
    topk_k: int = Field(16, gt=0)
    # topk: "forward" KL(teacher || student) (mass-covering), "reverse" KL(student || teacher), or "mixed".
    topk_kl: Literal["forward", "reverse", "mixed"] = "forward"
    # topk_kl=mixed: the forward KL's share (the reverse KL gets 1 - this).
    mixed_kl_weight: float = Field(0.5, ge=0, le=1)


def _bucketed(logp: torch.Tensor) -> torch.Tensor:
    """[..., k] log-probs of k tokens -> [..., k + 1] with the rest of the vocabulary's mass as the last."""
    rest = torch.log1p(-logp.exp().sum(-1).clamp(max=1 - 1e-6))
    return torch.cat([logp, rest.unsqueeze(-1)], dim=-1)


def topk_kl(student_logp: torch.Tensor, teacher_logp: torch.Tensor, kind: str = "forward",
            mixed_weight: float = 0.5) -> torch.Tensor:
    """Per-position KL over k tokens and a bucket for the rest: [B, T, k] full-vocabulary log-probs of
    the same k token ids under each model -> [B, T]. forward = sum p_T (log p_T - log p_S); reverse =
    sum p_S (log p_S - log p_T); mixed = w forward + (1 - w) reverse. Exact when k is the vocabulary."""
    s, t = _bucketed(student_logp.float()), _bucketed(teacher_logp.float())
    fwd = (t.exp() * (t - s)).sum(-1) if kind in ("forward", "mixed") else None
    rev = (s.exp() * (s - t)).sum(-1) if kind in ("reverse", "mixed") else None
    if kind == "forward":
        return fwd
    if kind == "reverse":
        return rev
    if kind == "mixed":
        return mixed_weight * fwd + (1 - mixed_weight) * rev
    raise ValueError(f"teacher.topk_kl: {kind!r} is not forward, reverse or mixed")


class TopKDistillLossFn:
    """The policy-gradient loss plus ``kl_coef`` x the top-k KL (``topk_kl``) on the loss tokens,
    normalised by the global token count (so micro-batch losses sum to the batch's). Reads
    ``teacher_topk_logprobs`` [B, T, k] from ``data`` and ``curr_topk_logprobs`` [B, T, k], the
    student's log-probs of the same ids that the worker gathers when ``teacher_topk_ids`` is present.
    Metrics: the PG loss's, ``distill_topk_kl`` (this micro-batch's token mean)."""

    def __init__(self, pg_loss: Any, cfg: TeacherConfig) -> None:
        self.pg, self.cfg = pg_loss, cfg

    @property
    def loss_type(self) -> str:
        return "token"

    # The KL acts on every sample, whatever its advantage: nothing may skip the pass.
    zero_advantage_is_inert = False

    def __call__(self, curr_logprobs: torch.Tensor, data: Mapping[str, Any], global_valid_seqs: Any,
                 global_valid_toks: Any) -> tuple[torch.Tensor, dict[str, float]]:
        loss, metrics = self.pg(curr_logprobs, data, global_valid_seqs, global_valid_toks)
        check_2d("curr_logprobs", curr_logprobs, None)
        mask = data["token_mask"].to(curr_logprobs.dtype) * data["sample_mask"].to(curr_logprobs.dtype)[:, None]
        kl = topk_kl(data["curr_topk_logprobs"], data["teacher_topk_logprobs"].to(curr_logprobs.device),
                     self.cfg.topk_kl, self.cfg.mixed_kl_weight)
        kl_sum = (kl * mask).sum()
        loss = loss + self.cfg.kl_coef * kl_sum / max(float(global_valid_toks), 1.0)
        n = float(mask.sum())
        metrics = dict(metrics) | {"distill_topk_kl": float(kl_sum.detach()) / n if n else 0.0,
                                   "loss": float(loss.detach())}
        return loss, metrics


class DistillStage:
    """The teacher's part of a GRPO step: its log-probs of the batch, the per-token advantages or the
    top-k targets, and the ``distill/`` metrics. ``teacher``: a ``Policy`` without an optimizer."""

    def __init__(self, cfg: TeacherConfig | None, teacher: Any) -> None:
        self.cfg, self.teacher = cfg, teacher

    @property
    def active(self) -> bool:
        return self.cfg is not None

    def wrap_loss(self, loss_fn: Any) -> Any:
        return TopKDistillLossFn(loss_fn, self.cfg) if self.active and self.cfg.objective == "topk" else loss_fn

    def apply(self, train_data: Any, advantages: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
        """The advantages to train with ([N] or [N, T] in, [N, T] out with reverse_kl) and the metrics;
        with topk, ``train_data`` gains the teacher's ids and log-probs for the loss. The student's
        log-probs are the sampler's (``generation_logprobs``): the distribution the tokens came from."""
        mask = train_data["token_mask"].float() * train_data["sample_mask"].float()[:, None]
        student = train_data["generation_logprobs"].float()
        n = mask.sum().clamp(min=1)
        if self.cfg.objective == "topk":
            out = self.teacher.get_topk_logprobs(train_data, self.cfg.topk_k)
            train_data["teacher_topk_ids"] = out["topk_ids"]
            train_data["teacher_topk_logprobs"] = out["topk_logprobs"]
            teacher = out["logprobs"]
        else:
            teacher = self.teacher.get_logprobs(train_data)["logprobs"]
        gap = (teacher - student) * mask  # log p_teacher - log p_student per sampled token
        metrics = {"distill/reverse_kl": float(-gap.sum() / n),  # the sampled estimate of KL(student || teacher)
                   "distill/teacher_logprob_mean": float((teacher * mask).sum() / n),
                   "distill/student_logprob_mean": float((student * mask).sum() / n)}
        env = advantages if advantages.dim() == 2 else advantages[:, None].expand_as(gap)
        # Without rewards the estimator's output is left out, not multiplied by 0: a group of one
        # (grpo.num_generations_per_prompt=1) may give it no finite value to weigh.
        rewarded = self.cfg.reward_weight * env * mask if self.cfg.reward_weight else torch.zeros_like(gap)
        if self.cfg.objective == "topk":
            return rewarded, metrics
        return rewarded + self.cfg.kl_coef * gap, metrics


def teacher_policy_config(policy: Any, teacher: TeacherConfig) -> Any:
    """The teacher's worker config: the student's (lengths, packing, generation temperature, so both
    score the same tokens the same way) with the teacher's model and precision, no adapter, HF backend."""
    from nemo_like.models.policy.interfaces import LoraConfig

    return policy.model_copy(update={
        "model_name": teacher.model_name, "tokenizer_name": None, "precision": teacher.precision,
        "trust_remote_code": teacher.trust_remote_code, "logprob_batch_size": teacher.logprob_batch_size,
        "backend": "hf", "lora": LoraConfig(), "activation_checkpointing": False})
