"""One critic (value model) worker: a HF decoder trunk with a one-output head, data parallel over
torch.distributed (gloo on CPU, NCCL on GPU), sharded with FSDP2 like the policy's HF worker.

The ``Critic`` facade creates one per placement-group bundle through RayWorkerGroup; every public
method is called on all workers at once with that worker's shard of the batch.

Position convention: the value of token t is the head's output at position t - 1, the state that
chose token t; position 0 (nothing chose it) and padding get 0.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from torch import nn

from nemo_like.algorithms.ppo_terms import clipped_value_loss_terms
from nemo_like.distributed.batched_data_dict import BatchedDataDict
from nemo_like.models.critic.config import CriticConfig
from nemo_like.models.policy.interfaces import PolicyConfig
from nemo_like.models.policy.packing import (
    MicroBatch,
    PackedBatch,
    attention_cost_ratio,
    build_packed,
    plan_microbatches,
    plan_rows,
    require_mask_attention,
)
from nemo_like.models.policy.weight_export import named_checksum, read_safetensors_folder
from nemo_like.models.worker_base import TrainingWorkerBase, make_optimizer
from nemo_like.utils.checkpoint_io import load_full_training_state

_TRAIN_KEYS = ("input_ids", "input_lengths", "token_mask", "values", "returns")
# Where the non-finite flags of a training pass are counted (see CriticWorker._check_finite).
_FLAG_NAMES = ("new values", "value loss", "gradient norm")


class _ValueOutput:
    def __init__(self, logits: torch.Tensor):
        self.logits = logits


class TrunkWithValueHead(nn.Module):
    """For model types transformers has no token-classification class for: the bare trunk
    (``AutoModel``) and a linear head on its last hidden states (``logits`` [B, T, 1])."""

    def __init__(self, trunk: nn.Module, hidden_size: int):
        super().__init__()
        self.model = trunk
        self.score = nn.Linear(hidden_size, 1)
        self.config = trunk.config

    def forward(self, input_ids=None, attention_mask=None, use_cache=False, **kw):
        h = self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=use_cache, **kw).last_hidden_state
        return _ValueOutput(self.score(h))

    def gradient_checkpointing_enable(self) -> None:
        self.model.gradient_checkpointing_enable()


def load_value_model(model_name: str, trust_remote_code: bool = False) -> tuple[nn.Module, list[str]]:
    """The value model of ``model_name`` in float32 with every dropout at 0, and the names of the
    parameters the checkpoint did not hold (the new head, at its default init)."""
    from transformers import AutoConfig, AutoModel, AutoModelForTokenClassification

    hf_cfg = AutoConfig.from_pretrained(model_name, trust_remote_code=trust_remote_code)
    hf_cfg.num_labels = 1
    # Token-classification heads default to 10% dropout where the config names none: a value
    # estimate is a regression target, so no dropout anywhere (verl does the same).
    for key in list(hf_cfg.to_dict()):
        if "dropout" in key and isinstance(getattr(hf_cfg, key, None), (int, float)):
            setattr(hf_cfg, key, 0.0)
    hf_cfg.classifier_dropout = 0.0
    try:
        model, info = AutoModelForTokenClassification.from_pretrained(
            model_name, config=hf_cfg, dtype=torch.float32, trust_remote_code=trust_remote_code,
            output_loading_info=True)
        missing = sorted(info.get("missing_keys", []))
    except ValueError as e:  # transformers' "Unrecognized configuration class" for this model type
        if "Unrecognized configuration class" not in str(e):
            raise
        trunk = AutoModel.from_pretrained(model_name, config=hf_cfg, dtype=torch.float32,
                                          trust_remote_code=trust_remote_code)
        hidden = int(hf_cfg.get_text_config().hidden_size) if hasattr(hf_cfg, "get_text_config") else int(
            hf_cfg.hidden_size)
        model = TrunkWithValueHead(trunk, hidden)
        missing = ["score.weight", "score.bias"]
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
    return model, missing


def shifted_values(head_out: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """[B, T] values from the head's [B, T] outputs: values[:, t] = head_out[:, t - 1] for
    1 <= t < length, 0 at t = 0 and on padding."""
    v = torch.zeros_like(head_out)
    v[:, 1:] = head_out[:, :-1]
    ar = torch.arange(head_out.shape[1], device=head_out.device)
    keep = (ar[None, :] >= 1) & (ar[None, :] < lengths.to(head_out.device)[:, None])
    return torch.where(keep, v, torch.zeros_like(v))


def packed_values(model: nn.Module, packed: PackedBatch) -> torch.Tensor:
    """[b, T] values of the packed samples (``packed.sample_idx`` order), by the same convention as
    :func:`shifted_values`: the head's output at the position that predicts token t."""
    impl = getattr(model.config, "_attn_implementation", "sdpa") or "sdpa"
    mask = packed.attention_mask(impl, next(model.parameters()).dtype)
    out = model(input_ids=packed.input_ids, attention_mask=mask, position_ids=packed.position_ids,
                use_cache=False).logits[..., 0].float()
    picked = out[packed.src_row, packed.src_col]
    return torch.where(packed.valid, picked, torch.zeros_like(picked))


def check_value_packing(model: nn.Module) -> None:
    """Refuse packing on a value model whose attention ignores the packed mask: two short
    sequences with a shared prompt, packed, must get the values they get one by one."""
    require_mask_attention(model, "critic sequence packing")
    vocab = int(model.config.vocab_size)
    ids = torch.randint(0, vocab, (2, 6), generator=torch.Generator().manual_seed(0))
    ids[1, :2] = ids[0, :2]
    lengths = torch.tensor([6, 4])
    device = next(model.parameters()).device
    with torch.no_grad():
        packed = build_packed(ids, lengths, plan_rows(ids, lengths, 16, torch.tensor([2, 2]))).to(device)
        got = packed_values(model, packed).cpu()
        ref = torch.zeros_like(got)
        for k, i in enumerate(packed.sample_idx):
            n = int(lengths[i])
            out = model(input_ids=ids[i:i + 1, :n].to(device), use_cache=False).logits[..., 0].float()
            ref[k, :n] = shifted_values(out, lengths[i:i + 1].to(device))[0].cpu()
    err = float((got - ref).abs().max())
    if not err < 1e-4:
        raise ValueError(f"critic sequence packing: this value model's attention does not confine packed "
                         f"sequences (packed values differ from unpacked by {err:.3g}); turn packing off")


class CriticWorker(TrainingWorkerBase):
    def __init__(self, config: CriticConfig, policy_config: PolicyConfig, *, seed: int = 0):
        self.cfg = config
        self.policy_cfg = policy_config
        self._setup_process(config.num_threads)
        # The same seed on every rank: the new head is initialised identically everywhere (and
        # broadcast from rank 0 below, in case a model's init is not deterministic).
        torch.manual_seed(seed)
        self.model_name = config.model_name or policy_config.model_name
        model, new_params = load_value_model(self.model_name, policy_config.trust_remote_code)
        model.to(self.device)
        self._broadcast_from_rank0(model, new_params)
        # What cuts the passes into micro-batches: the policy's packing / token budget unless overridden.
        self.passes_cfg = config.passes_config(policy_config)
        if self.passes_cfg.sequence_packing.enabled:
            check_value_packing(model)
        self._attention_ratio = attention_cost_ratio(model.config)
        if config.activation_checkpointing:
            model.gradient_checkpointing_enable()
        self.sharded = config.fsdp and (self.world_size > 1 or config.precision != "float32")
        trunk = getattr(model, getattr(model, "base_model_prefix", "model"), None) or getattr(model, "model", None)
        layers = getattr(trunk, "layers", None)
        self.model = self._fully_shard(model, layers, config.precision) if self.sharded else model
        self.model.train()
        self.optimizer, self.scheduler = make_optimizer(self.model.parameters(), config.optimizer, config.scheduler)

    # ---- values -------------------------------------------------------------------------------
    def _mb_values(self, mb: MicroBatch) -> torch.Tensor:
        """[b, w] float32 values of one micro-batch (``mb.idx`` order, on the device), with gradients
        if enabled: packed rows, or right-padded samples."""
        with self._autocast(self.cfg.precision):
            if mb.packed is not None:
                return packed_values(self.model, mb.packed.to(self.device))
            lengths = mb.data["input_lengths"]
            width = max(1, int(lengths.max()))
            ids = mb.data["input_ids"][:, :width].to(self.device)
            lengths = lengths.to(self.device)
            attn = (torch.arange(width, device=self.device)[None, :] < lengths[:, None]).long()
            out = self.model(input_ids=ids, attention_mask=attn, use_cache=False).logits
        return shifted_values(out[..., 0].float(), lengths)

    def _plan(self, data: BatchedDataDict, mb_size: int) -> list[MicroBatch]:
        return plan_microbatches(data, self.passes_cfg, mb_size, self._attention_ratio)

    @torch.no_grad()
    def compute_values(self, data: BatchedDataDict) -> BatchedDataDict:
        """``values`` [B, T] float32 of the shard: see the module's position convention."""
        values = torch.zeros(data["input_ids"].shape, dtype=torch.float32)
        plan = self._plan(data, self.cfg.forward_micro_batch_size) if data.size else []
        for i in range(self._synced_count(len(plan))):
            if not plan:  # an empty shard cannot take part (the facade pads shards to equal sizes)
                break
            mb = plan[min(i, len(plan) - 1)]
            v = self._mb_values(mb)
            if i < len(plan):
                values[mb.idx, :v.shape[1]] = v.cpu()
        self._reshard()
        return BatchedDataDict(values=values)

    # ---- training -----------------------------------------------------------------------------
    def _check_inputs(self, data: BatchedDataDict) -> None:
        """Non-finite returns or old values on loss-carrying tokens, on any rank: every rank raises
        before anything is computed, so no rank waits in a collective for one that gave up."""
        mask = data["token_mask"] > 0
        bad = torch.tensor([float((~torch.isfinite(data[k].float()) & mask).sum()) for k in ("returns", "values")],
                           dtype=torch.float64)
        bad = self._reduce(bad)
        if bad.any():
            what = ", ".join(f"{int(n)} {k} token(s)" for k, n in zip(("returns", "old values"), bad.tolist()) if n)
            raise RuntimeError(f"critic: non-finite training targets ({what} on loss-carrying tokens); "
                               "refusing to train the critic on them (weights left unchanged)")

    def train(self, data: BatchedDataDict, *, global_batch_size: int,
              micro_batch_size: int | None = None) -> dict[str, float]:
        """``ppo_epochs`` passes over this worker's shard, one optimizer step per global batch
        (``global_batch_size`` samples over all ranks, split evenly)."""
        if missing := [k for k in _TRAIN_KEYS if k not in data]:
            raise KeyError(f"CriticWorker.train needs keys {list(_TRAIN_KEYS)}; missing {missing}")
        gbs = global_batch_size // self.world_size
        if gbs == 0 or data.size % gbs:
            raise ValueError(f"critic worker shard of {data.size} samples is not a multiple of the per-worker "
                             f"global batch {gbs} (critic.train_global_batch_size / world size)")
        mbs = max(1, min(micro_batch_size or self.cfg.train_micro_batch_size, gbs))
        self._check_inputs(data)
        self.model.train()
        steps: list[dict[str, float]] = []
        for _ in range(self.cfg.ppo_epochs):
            for start in range(0, data.size, gbs):
                steps.append(self._train_global_batch(data.slice(start, start + gbs), mbs))
        out = {k: _nanmean([s[k] for s in steps]) for k in steps[0]} if steps else {}
        out["num_optimizer_steps"] = float(len(steps))
        return out

    def _train_global_batch(self, gb: BatchedDataDict, mbs: int) -> dict[str, float]:
        mask_all = (gb["token_mask"] > 0).float()
        # The loss is a mean over the global batch's loss tokens on all ranks: each micro-batch adds
        # its token sum divided by that global count, so neither the micro-batch cut nor the split
        # over ranks changes the gradient.
        global_toks = float(self._reduce(torch.tensor([float(mask_all.sum())], dtype=torch.float64))[0])
        denom = max(global_toks, 1.0)
        self.optimizer.zero_grad(set_to_none=True)
        sums = torch.zeros(3, dtype=torch.float64)  # value loss, clipped tokens, values
        flags = torch.zeros(len(_FLAG_NAMES), dtype=torch.float64)
        tokens = torch.zeros(2, dtype=torch.float64)  # real and computed positions of the passes
        coef = self.cfg.value_loss_coef
        plan = self._plan(gb, mbs)
        for n_pass in range(self._synced_count(len(plan))):
            item = plan[min(n_pass, len(plan) - 1)]
            mb = item.data
            values = self._mb_values(item)
            w = values.shape[1]
            mask = (mb["token_mask"][:, :w] > 0).float().to(self.device)
            old = mb["values"][:, :w].float().to(self.device)
            ret = mb["returns"][:, :w].float().to(self.device)
            tok_loss, tok_clipped = clipped_value_loss_terms(values, old, ret, mask,
                                                             cliprange_value=self.cfg.cliprange_value)
            loss = tok_loss.sum() / denom
            if n_pass >= len(plan):  # a lock-step pass of a rank with fewer micro-batches: no gradient
                (loss * 0.0).backward()
                continue
            if not bool(torch.isfinite(torch.where(mask > 0, values, torch.zeros_like(values))).all()):
                flags[0] += 1
            if not bool(torch.isfinite(loss)):
                flags[1] += 1
            # Gradients are averaged over ranks (FSDP's reduce-scatter, or the all-reduce below):
            # scaling by the world size makes the result the gradient of the global token mean.
            (loss * coef * self.world_size).backward()
            sums += torch.tensor([float(loss.detach()), float(tok_clipped.sum()) / denom,
                                  float((values.detach() * mask).sum()) / denom], dtype=torch.float64)
            tokens += torch.tensor([item.tokens_real, item.tokens_computed], dtype=torch.float64)
        grad_norm = self._clip_grads(self.cfg.max_grad_norm)  # averages the replicas' gradients first
        if not math.isfinite(grad_norm):
            flags[2] += 1
        flags = self._reduce(flags)
        if flags.any():
            self.optimizer.zero_grad(set_to_none=True)
            self._reshard()
            what = ", ".join(n for n, f in zip(_FLAG_NAMES, flags.tolist()) if f)
            raise RuntimeError(f"critic: non-finite {what} in a training step; the optimizer step was skipped "
                               "and the critic's weights are unchanged")
        lr = self.scheduler.get_last_lr()[0]
        self.optimizer.step()
        self.scheduler.step()
        sums = self._reduce(sums)
        tokens = self._reduce(tokens)
        nan = math.nan
        # No loss-carrying token in the global batch: the loss (a sum) is 0, the means undefined (NaN).
        return {"value_loss": float(sums[0]),
                "vf_clipfrac": float(sums[1]) if global_toks else nan,
                "values_mean": float(sums[2]) if global_toks else nan,
                "grad_norm": grad_norm, "lr": float(lr),
                "padding_efficiency": float(tokens[0] / tokens[1].clamp(min=1))}

    # ---- checkpoints --------------------------------------------------------------------------
    def _full_state_dict(self) -> dict[str, torch.Tensor]:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        self._reshard()
        return get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def save_checkpoint(self, path: str) -> None:
        """Weights (``save_pretrained`` layout: ``from_pretrained`` of the token-classification
        class loads them), optimizer and scheduler state; every rank calls it, rank 0 writes."""
        from safetensors.torch import save_file
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        out = Path(path)
        sd = self._full_state_dict()
        optim_sd = get_optimizer_state_dict(self.model, self.optimizer,
                                            options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if self.rank == 0:
            out.mkdir(parents=True, exist_ok=True)
            if isinstance(self.model, TrunkWithValueHead):
                save_file({k: v.contiguous() for k, v in sd.items()}, str(out / "critic.safetensors"))
                self.model.config.save_pretrained(out)
            else:
                self.model.save_pretrained(out, state_dict=sd, safe_serialization=True)
            torch.save({"optimizer": optim_sd, "scheduler": self.scheduler.state_dict()}, out / "optimizer.pt")
        self._barrier()

    def load_checkpoint(self, path: str) -> None:
        """Exactly the checkpoint's weights (an error names missing and unexpected ones), and its
        optimizer and scheduler state."""
        p = Path(path)
        sd = read_safetensors_folder(p, "critic checkpoint")
        self._reshard()
        load_full_training_state(self.model, sd, str(p), "critic", self.optimizer, self.scheduler, p / "optimizer.pt")

    def weights_checksum(self) -> str:
        """sha256 over the full state dict (name, dtype, shape and bytes of every tensor)."""
        return named_checksum(self._full_state_dict().items())


def _nanmean(xs: list[float]) -> float:
    vals = [x for x in xs if not math.isnan(x)]
    return sum(vals) / len(vals) if vals else math.nan
