"""A reward model (a causal-LM trunk with a scalar head read at a sequence's last token), trained on
preference pairs with the Bradley-Terry loss, and the ``RewardModel`` facade over its worker group.

The model is ``AutoModelForSequenceClassification`` with one label: a saved reward model is a plain
HF folder that ``from_pretrained`` loads, and ``score(h[last token])`` is what it means by a score.
The score is read at each sequence's last real token (its length - 1) from the trunk's hidden states,
not by HF's "last non-pad token" rule, which depends on the pad token (often the end-of-turn token
itself). The trunk and the head are wrapped in one module, so FSDP2 (several workers) shards the
trunk's layers and the root holds the embeddings, final norm and head.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field
from torch import nn

from nemo_like.distributed.balance import balance_over_shards, shard_token_imbalance
from nemo_like.distributed.batched_data_dict import BatchedDataDict
from nemo_like.distributed.resource_pools import Placement
from nemo_like.distributed.worker_group import RayWorkerGroup
from nemo_like.models.policy.interfaces import LoraConfig, OptimizerConfig, SchedulerConfig
from nemo_like.models.policy.lora import apply_lora
from nemo_like.models.policy.packing import PackedBatch, build_packed, plan_rows, require_mask_attention
from nemo_like.models.worker_base import TrainingWorkerBase, make_optimizer
from nemo_like.utils.checkpoint_io import load_full_training_state


class RewardModelConfig(BaseModel):
    """The reward model and its optimizer."""

    model_config = ConfigDict(extra="forbid")

    # HF hub id or folder of the trunk (a causal LM); the head is new unless the folder is a reward model.
    model_name: str = ""
    # Let transformers run the model's own code from its folder (only for a model you trust).
    trust_remote_code: bool = False
    # Pairs per optimizer step, over all workers (each pair is two sequences).
    train_global_batch_size: int = Field(32, gt=0)
    # Pairs per forward/backward pass on a worker.
    train_micro_batch_size: int = Field(16, gt=0)
    # Sequences per forward pass when scoring.
    forward_micro_batch_size: int = Field(64, gt=0)
    optimizer: OptimizerConfig = OptimizerConfig(lr=1e-4)
    scheduler: SchedulerConfig = SchedulerConfig()
    # Clip the gradient's global L2 norm to this before each step; None: no clipping.
    max_grad_norm: float | None = Field(1.0, gt=0)
    # Threads per worker; None = the worker's CPU share.
    num_threads: int | None = Field(None, ge=1)
    # Pack a micro-batch's sequences into rows (no padding; a pair's shared prompt computed once)
    # instead of padding each to the longest; the scores are the same.
    sequence_packing: bool = False
    # Tokens per packed row (raised to the longest sequence where that is longer).
    packing_row_length: int = Field(512, gt=1)
    # Train LoRA adapters (and the new head, whole) instead of every weight; the saved model has the
    # adapters merged in, a plain HF folder as without them.
    lora: LoraConfig = LoraConfig()
    # Several workers: reorder each global batch so that every worker gets about the same tokens (a
    # pair's two sides kept together), for training and scoring, as policy.balance_batch does for the
    # policy; the scores and the update are the same. train/dp_token_imbalance: the busiest worker's
    # tokens / the mean.
    balance_batch: bool = True


class LastTokenScore(nn.Module):
    """``forward(input_ids, lengths) -> [B]``: the head of a sequence-classification model at each
    sequence's last real token."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    @property
    def trunk(self) -> nn.Module:
        return getattr(self.model, self.model.base_model_prefix)

    def forward(self, input_ids: torch.Tensor, lengths: torch.Tensor, packed: PackedBatch | None = None,
                last_at: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Padded rows (``lengths``), or ``packed`` rows with each score read at ``last_at`` (row, column)
        of the packed positions. One entry point: under FSDP2 the root's forward gathers its parameters."""
        if packed is not None:
            impl = getattr(self.model.config, "_attn_implementation", "sdpa") or "sdpa"
            mask = packed.attention_mask(impl, next(self.parameters()).dtype)
            h = self.trunk(input_ids=packed.input_ids, attention_mask=mask, position_ids=packed.position_ids,
                           use_cache=False).last_hidden_state
            return self.model.score(h[last_at[0], last_at[1]])[:, 0].float()
        attn = (torch.arange(input_ids.shape[1], device=input_ids.device)[None] < lengths[:, None]).long()
        h = self.trunk(input_ids=input_ids, attention_mask=attn, use_cache=False).last_hidden_state
        last = h[torch.arange(h.shape[0], device=h.device), lengths - 1]
        return self.model.score(last)[:, 0].float()


def pack_for_scores(ids: torch.Tensor, lengths: torch.Tensor, row_length: int) -> tuple[PackedBatch, torch.Tensor]:
    """Rows 2i and 2i+1 (a pair, or any two sequences) packed with their common prefix computed once.

    Each sequence gets one extra (dummy) token, so that the packed position that "predicts" it, which
    build_packed records, is the position of the sequence's last real token: where the score is read.
    Returns the packed rows and, for each packed sample, its row in ``ids``."""
    n = ids.shape[0]
    ext = torch.cat([ids, torch.zeros((n, 1), dtype=ids.dtype)], dim=1)
    ext_len = lengths + 1
    prefix = torch.zeros(n, dtype=torch.long)
    for i in range(0, n - 1, 2):
        m = int(min(lengths[i], lengths[i + 1]))
        same = (ids[i, :m] == ids[i + 1, :m]).long()
        prefix[i] = prefix[i + 1] = int(same.cumprod(0).sum())
    rows = plan_rows(ext, ext_len, max(row_length, int(ext_len.max())), prefix)
    packed = build_packed(ext, ext_len, rows)
    return packed, torch.tensor(packed.sample_idx)


def load_reward_model(model_name: str, trust_remote_code: bool = False) -> nn.Module:
    """A one-label sequence-classification model in float32 with no dropout (a regression target)."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    cfg = AutoConfig.from_pretrained(model_name, trust_remote_code=trust_remote_code)
    cfg.num_labels = 1
    for key in list(cfg.to_dict()):
        if "dropout" in key and isinstance(getattr(cfg, key, None), (int, float)):
            setattr(cfg, key, 0.0)
    model = AutoModelForSequenceClassification.from_pretrained(model_name, config=cfg, dtype=torch.float32,
                                                               trust_remote_code=trust_remote_code)
    if not hasattr(model, "score") or model.score.out_features != 1:
        raise ValueError(f"reward_model.model_name={model_name!r}: its classification head is not one scalar "
                         "'score' layer (num_labels=1)")
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
    return model


# A checkpoint's model tensors, named as the training module has them.
CHECKPOINT_FILE = "reward_model.safetensors"


def _with_lora(model: nn.Module, config: RewardModelConfig) -> nn.Module:
    """The peft wrapper of ``model`` with ``config.lora``'s adapters and its head trained whole."""
    return apply_lora(model, config.lora, config.model_name, key="reward_model.lora", task_type="SEQ_CLS")


def bradley_terry(chosen: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
    """Per pair: -log sigmoid(r_chosen - r_rejected)."""
    return -F.logsigmoid(chosen - rejected)


class RewardModelWorker(TrainingWorkerBase):
    def __init__(self, config: RewardModelConfig, *, seed: int = 0):
        self.cfg = config
        self._setup_process(config.num_threads)
        torch.manual_seed(seed)  # the same new head on every rank
        model = load_reward_model(config.model_name, config.trust_remote_code)
        if config.lora.enabled:  # adapters injected in place; the HF model keeps its forward and its head
            model = _with_lora(model, config).get_base_model()
        scorer = LastTokenScore(model).to(self.device)
        if config.sequence_packing:
            require_mask_attention(scorer.model, "reward_model.sequence_packing")
        self.sharded = self.world_size > 1  # FSDP2 over several workers
        layers = getattr(scorer.trunk, "layers", None)
        self.model = self._fully_shard(scorer, layers) if self.sharded else scorer
        self.optimizer, self.scheduler = make_optimizer([p for p in scorer.parameters() if p.requires_grad],
                                                        config.optimizer, config.scheduler)

    def _scores(self, ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        width = int(lengths.max())
        if not self.cfg.sequence_packing:
            return self.model(ids[:, :width].to(self.device), lengths.to(self.device))
        packed, order = pack_for_scores(ids[:, :width], lengths, self.cfg.packing_row_length)
        k = torch.arange(len(order))
        last_at = (packed.src_row[k, lengths[order]].to(self.device), packed.src_col[k, lengths[order]].to(self.device))
        got = self.model(None, None, packed=packed.to(self.device), last_at=last_at)
        return torch.empty_like(got).index_copy(0, order.to(got.device), got)  # back in the rows' order

    @torch.no_grad()
    def score(self, data: BatchedDataDict) -> BatchedDataDict:
        """``scores`` [B] of the shard's sequences."""
        self.model.eval()
        out = torch.zeros(data.size)
        mb = self.cfg.forward_micro_batch_size
        for s in range(0, data.size, mb):
            out[s:s + mb] = self._scores(data["input_ids"][s:s + mb], data["input_lengths"][s:s + mb]).cpu()
        return BatchedDataDict(scores=out)

    def train_pairs(self, data: BatchedDataDict) -> dict[str, float]:
        """One optimizer step per global batch of pairs (rows 2i and 2i+1 of the shard are pair i's
        chosen and rejected sides); means over all ranks' pairs."""
        n_pairs = data.size // 2
        per_rank = self.cfg.train_global_batch_size // self.world_size
        if data.size % 2 or n_pairs % per_rank:
            raise ValueError(f"reward-model shard of {data.size} rows is not whole global batches of {per_rank} pairs")
        self.model.train()
        steps = []
        for g in range(0, n_pairs, per_rank):
            self.optimizer.zero_grad(set_to_none=True)
            sums = torch.zeros(3, dtype=torch.float64)  # loss, right, margin
            mbs = min(self.cfg.train_micro_batch_size, per_rank)
            for s in range(g, g + per_rank, mbs):
                rows = slice(2 * s, 2 * min(s + mbs, g + per_rank))
                r = self._scores(data["input_ids"][rows], data["input_lengths"][rows])
                loss_terms = bradley_terry(r[0::2], r[1::2])
                (loss_terms.sum() / self.cfg.train_global_batch_size * self.world_size).backward()
                margin = (r[0::2] - r[1::2]).detach()
                sums += torch.tensor([float(loss_terms.detach().sum()), float((margin > 0).sum()),
                                      float(margin.sum())], dtype=torch.float64)
            norm = self._clip_grads(self.cfg.max_grad_norm)
            sums = self._reduce(sums) / self.cfg.train_global_batch_size
            if not (math.isfinite(norm) and math.isfinite(float(sums[0]))):
                self.optimizer.zero_grad(set_to_none=True)
                raise RuntimeError("reward model: non-finite loss or gradient; the optimizer step was skipped")
            lr = self.scheduler.get_last_lr()[0]
            self.optimizer.step()
            self.scheduler.step()
            steps.append({"loss": float(sums[0]), "accuracy": float(sums[1]), "margin": float(sums[2]),
                          "grad_norm": norm, "lr": float(lr)})
        return {k: sum(s[k] for s in steps) / len(steps) for k in steps[0]} | {"num_optimizer_steps": len(steps)}

    def save(self, path: str) -> None:
        """The sequence-classification model as a plain HF folder (rank 0 writes)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        sd = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if self.rank == 0:
            inner = {k.removeprefix("model."): v for k, v in sd.items()}
            if self.cfg.lora.enabled:
                # Merged on a fresh CPU copy: the training model's base weights stay untouched.
                fresh = _with_lora(load_reward_model(self.cfg.model_name, self.cfg.trust_remote_code), self.cfg)
                fresh.get_base_model().load_state_dict(inner, strict=True)
                fresh.merge_and_unload(safe_merge=True).save_pretrained(Path(path), safe_serialization=True)
            else:
                self.model.model.save_pretrained(Path(path), state_dict=inner, safe_serialization=True)
        self._barrier()

    def save_checkpoint(self, path: str) -> None:
        """Every tensor of the model as it trains (with LoRA: base, adapters and head apart, not
        merged), the optimizer and scheduler state; rank 0 writes."""
        from safetensors.torch import save_file
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        sd = get_model_state_dict(self.model, options=opts)
        optim_sd = get_optimizer_state_dict(self.model, self.optimizer, options=opts)
        if self.rank == 0:
            Path(path).mkdir(parents=True, exist_ok=True)
            save_file({k: v.contiguous() for k, v in sd.items()}, str(Path(path) / CHECKPOINT_FILE))
            torch.save({"optimizer": optim_sd, "scheduler": self.scheduler.state_dict()}, Path(path) / "optimizer.pt")
        self._barrier()

    def load_checkpoint(self, path: str) -> None:
        """Exactly a checkpoint's weights (an error names missing and unexpected ones), optimizer and
        scheduler state."""
        from safetensors.torch import load_file

        # A LoRA checkpoint loaded without LoRA (or the other way) shows up as missing/unexpected weights.
        load_full_training_state(self.model, load_file(str(Path(path) / CHECKPOINT_FILE)), str(path),
                                 "reward model (same reward_model.lora?)", self.optimizer, self.scheduler,
                                 Path(path) / "optimizer.pt")


class RewardModel:
    """The driver-side facade: ``score(batch)``, ``train_pairs(pairs)``, ``save(path)``."""

    def __init__(self, cluster: Placement, config: RewardModelConfig, *, seed: int = 0,
                 name_prefix: str = "reward_model"):
        self.cfg = config
        if config.train_global_batch_size % cluster.num_workers:
            raise ValueError(f"reward_model.train_global_batch_size ({config.train_global_batch_size}) is not "
                             f"divisible by the {cluster.num_workers} workers")
        self.worker_group = RayWorkerGroup(cluster, RewardModelWorker, config, seed=seed, name_prefix=name_prefix,
                                           env_vars={"NEMO_LIKE_USE_GPU": "1" if cluster.gpus_per_worker else "0"})
        self.world_size = self.worker_group.world_size

    def _results(self, refs):
        return self.worker_group.get_all_worker_results(refs)

    def score(self, data: BatchedDataDict) -> torch.Tensor:
        """[B] scores of ``input_ids`` / ``input_lengths``."""
        sub = BatchedDataDict(input_ids=data["input_ids"], input_lengths=data["input_lengths"])
        # Rows 2i and 2i+1 stay on one worker: packing computes a pair's shared prompt once.
        return self.worker_group.run_rows("score", sub, balance=self.cfg.balance_batch, balance_unit=2)["scores"]

    def train_pairs(self, data: BatchedDataDict) -> dict[str, float]:
        """Pairs as rows 2i (chosen) and 2i+1 (rejected), a whole number of global batches."""
        gbs = self.cfg.train_global_batch_size
        if data.size % (2 * gbs):
            raise ValueError(f"{data.size // 2} pairs are not whole global batches of {gbs} "
                             "(reward_model.train_global_batch_size)")
        # Each global batch of 2 x gbs rows is cut into equal contiguous pieces, one per rank: an even
        # number of rows each, so a pair's two rows stay together.
        sub = BatchedDataDict(input_ids=data["input_ids"], input_lengths=data["input_lengths"])
        # Whole pairs moved inside each global batch: every optimizer step sees the same pairs.
        sub, _ = balance_over_shards(sub, self.world_size if self.cfg.balance_batch else 1, 2 * gbs, unit=2)
        refs = self.worker_group.run_all_workers_sharded_data("train_pairs", sub, batch_size=2 * gbs)
        out = self._results(refs)[0]
        if self.world_size > 1:
            out["dp_token_imbalance"] = shard_token_imbalance(sub["input_lengths"], self.world_size, 2 * gbs)
        return out

    def save(self, path: str) -> None:
        self._results(self.worker_group.run_all_workers_single_data("save", str(path)))

    def save_checkpoint(self, path: str) -> None:
        self._results(self.worker_group.run_all_workers_single_data("save_checkpoint", str(path)))

    def load_checkpoint(self, path: str) -> None:
        self._results(self.worker_group.run_all_workers_single_data("load_checkpoint", str(path)))

    def shutdown(self) -> None:
        self.worker_group.shutdown()
