"""One training worker: a HF causal LM sharded with FSDP2 over torch.distributed (gloo on CPU, NCCL on GPU).

The Policy facade creates one of these per placement-group bundle through RayWorkerGroup; every
public method here is called on all workers at once with that worker's shard of the batch.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from nemo_like.distributed.batched_data_dict import BatchedDataDict
from nemo_like.models.generation.hf_generation import hf_generate
from nemo_like.models.policy.interfaces import PolicyConfig

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def token_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, temperature: float):
    """logprobs[:, t] = log p(input_ids[:, t] | < t); position 0 has no prediction and is 0."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
    logits = logits[:, :-1].float()
    if temperature != 1.0:
        logits = logits / temperature
    targets = input_ids[:, 1:]
    # gather - logsumexp avoids materialising a second [B,T,V] tensor for log_softmax.
    picked = torch.gather(logits, 2, targets.unsqueeze(-1)).squeeze(-1)
    lp = picked - torch.logsumexp(logits, dim=-1)
    return torch.cat([torch.zeros_like(lp[:, :1]), lp], dim=1)


def _attention_mask(input_ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    ar = torch.arange(input_ids.shape[1], device=input_ids.device)
    return (ar[None, :] < lengths[:, None].to(input_ids.device)).long()


class HFPolicyWorker:
    def __init__(self, config: PolicyConfig, *, seed: int = 0, init_reference_model: bool = True,
                 init_optimizer: bool = True):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.cfg = config
        threads = config.num_threads or int(os.environ.get("NEMO_LIKE_NUM_THREADS", "1"))
        torch.set_num_threads(max(1, threads))
        self.rank = int(os.environ.get("RANK", "0"))
        self.world_size = int(os.environ.get("WORLD_SIZE", "1"))
        use_cuda = torch.cuda.is_available() and os.environ.get("NEMO_LIKE_USE_GPU", "0") == "1"
        self.device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if use_cuda else torch.device("cpu")
        if use_cuda:
            torch.cuda.set_device(self.device)
        if not dist.is_initialized():
            dist.init_process_group(backend="nccl" if use_cuda else "gloo", rank=self.rank,
                                    world_size=self.world_size)
        torch.manual_seed(seed + self.rank)

        self.tokenizer = AutoTokenizer.from_pretrained(config.tokenizer_name or config.model_name,
                                                       trust_remote_code=config.trust_remote_code)
        # Master weights stay fp32; bf16/fp16 is applied as FSDP mixed precision for compute.
        model = AutoModelForCausalLM.from_pretrained(config.model_name, dtype=torch.float32,
                                                     trust_remote_code=config.trust_remote_code)
        model.to(self.device)
        if config.activation_checkpointing:
            model.gradient_checkpointing_enable()
        # FSDP2 on one rank shards nothing but still pays for its hooks and DTensor optimizer steps
        # (measured back to back: 8-15% slower per SFT step of the tiny model); it stays on for one
        # rank only where it supplies mixed precision.
        shard = config.fsdp and (self.world_size > 1 or config.precision != "float32")
        self.model = self._shard(model) if shard else model
        self.model.train()

        # The reference policy is the initial weights; kept as a detached copy and swapped in for
        # reference logprobs (NeMo RL does the same) rather than a second model instance.
        self._reshard()
        self.reference_params = (
            {n: p.detach().clone() for n, p in self.model.named_parameters()} if init_reference_model else None
        )
        self.optimizer = self.scheduler = None
        if init_optimizer:
            o = config.optimizer
            self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=o.lr, betas=o.betas, eps=o.eps,
                                               weight_decay=o.weight_decay)
            self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: config.scheduler.lr_factor(s))

    def _shard(self, model):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh(self.device.type, (self.world_size,))
        mp = None
        if self.cfg.precision != "float32":
            mp = MixedPrecisionPolicy(param_dtype=_DTYPES[self.cfg.precision], reduce_dtype=torch.float32)
        kw = {"mesh": mesh} | ({"mp_policy": mp} if mp else {})
        layers = getattr(getattr(model, "model", None), "layers", None)
        for layer in layers or []:
            fully_shard(layer, **kw)
        fully_shard(model, **kw)
        return model

    # ---- generation -------------------------------------------------------------------------
    def generate(self, data: BatchedDataDict, greedy: bool = False) -> BatchedDataDict:
        self.model.eval()
        with self._gathered():
            try:
                out = hf_generate(
                    self.model, self.tokenizer, data, self.cfg.generation, greedy=greedy,
                    max_total_length=self.cfg.max_total_sequence_length,
                    micro_batch_size=self.cfg.generation_batch_size,
                    synced=self.world_size > 1, device=self.device,
                )
            finally:
                self.model.train()
        return out

    @contextmanager
    def _gathered(self):
        # FSDP2 frees each layer's gathered weights after its forward, so decoding would all-gather
        # every layer once per generated token; keep them gathered for the whole call instead.
        from torch.distributed.fsdp import FSDPModule

        layers = [m for m in self.model.modules() if isinstance(m, FSDPModule) and m is not self.model]
        for m in layers:
            m.set_reshard_after_forward(False, recurse=False)
        try:
            yield
        finally:
            for m in layers:
                m.set_reshard_after_forward(True, recurse=False)
            self._reshard()

    # ---- log-probs ----------------------------------------------------------------------------
    @torch.no_grad()
    def get_logprobs(self, data: BatchedDataDict) -> BatchedDataDict:
        temp = self.cfg.generation.temperature
        lp = torch.zeros_like(data["input_ids"], dtype=torch.float32)
        for idx, mb in data.make_length_sorted_microbatch_iterator(self.cfg.logprob_batch_size):
            ids = mb["input_ids"].to(self.device)
            lp[idx, : ids.shape[1]] = token_logprobs(self.model, ids, _attention_mask(ids, mb["input_lengths"]), temp).cpu()
        return BatchedDataDict(logprobs=lp)

    def get_reference_policy_logprobs(self, data: BatchedDataDict) -> BatchedDataDict:
        if self.reference_params is None:
            raise RuntimeError("this policy was created without a reference model (init_reference_model=False)")
        with self._swap_in(self.reference_params):
            lp = self.get_logprobs(data)["logprobs"]
        return BatchedDataDict(reference_logprobs=lp)

    def _reshard(self) -> None:
        # FSDP2 leaves the root module's parameters unsharded after a forward pass; put every
        # parameter back to its sharded DTensor form before touching parameters directly.
        from torch.distributed.fsdp import FSDPModule

        for m in self.model.modules():
            if isinstance(m, FSDPModule):
                m.reshard()

    @contextmanager
    def _swap_in(self, params: dict[str, torch.Tensor]):
        self._reshard()
        current = dict(self.model.named_parameters())
        saved = {n: p.detach().clone() for n, p in current.items()}
        with torch.no_grad():
            for n, p in current.items():
                p.copy_(params[n])
        try:
            yield
        finally:
            with torch.no_grad():
                for n, p in current.items():
                    p.copy_(saved[n])

    # ---- training -----------------------------------------------------------------------------
    def train(self, data: BatchedDataDict, loss_fn: Any, global_batch_size: int | None = None,
              micro_batch_size: int | None = None) -> dict[str, Any]:
        """`data` is this worker's shard; every global batch is split evenly over workers."""
        gbs = (global_batch_size or self.cfg.train_global_batch_size) // self.world_size
        mbs = micro_batch_size or self.cfg.train_micro_batch_size
        temp = self.cfg.generation.temperature
        if gbs == 0 or data.size % gbs:
            raise ValueError(f"worker shard of {data.size} samples is not a multiple of the per-worker "
                             f"global batch {gbs} (policy.train_global_batch_size / world size)")
        self.model.train()
        all_metrics: list[dict[str, float]] = []
        for gb_start in range(0, data.size, gbs):
            gb = data.slice(gb_start, gb_start + gbs)
            mask = gb["token_mask"].float() * gb["sample_mask"].float()[:, None]
            counts = torch.tensor([mask.sum(), (mask.sum(1) > 0).sum()], dtype=torch.float64)
            if dist.is_initialized() and self.world_size > 1:
                dist.all_reduce(counts)
            global_toks, global_seqs = counts[0].float(), counts[1].float()

            self.optimizer.zero_grad(set_to_none=True)
            sums: dict[str, float] = {}
            weight_total = 0.0
            # Micro-batches grouped by length, each padded only to its own longest sample. The loss
            # is a share of global counts, so the gradient does not depend on the grouping.
            for _, mb in gb.make_length_sorted_microbatch_iterator(mbs):
                ids = mb["input_ids"].to(self.device)
                lp = token_logprobs(self.model, ids, _attention_mask(ids, mb["input_lengths"]), temp)
                mbd = mb.to(self.device)
                loss, metrics = loss_fn(lp, mbd, global_seqs, global_toks)
                # FSDP averages gradients over ranks; the loss is already a share of the global sum.
                (loss * self.world_size).backward()
                w = float((mb["token_mask"].float() * mb["sample_mask"].float()[:, None]).sum())
                weight_total += w
                for k, v in metrics.items():
                    if k == "loss":
                        sums["loss"] = sums.get("loss", 0.0) + float(v)
                    else:
                        sums[k] = sums.get(k, 0.0) + float(v) * w
            grad_norm = self._clip_grads()
            self.optimizer.step()
            self.scheduler.step()
            all_metrics.append(self._reduce_metrics(sums, weight_total) | {
                "grad_norm": grad_norm, "lr": self.scheduler.get_last_lr()[0]})
        return _mean_dicts(all_metrics) | {"num_optimizer_steps": float(len(all_metrics))}

    def _clip_grads(self) -> float:
        params = [p for p in self.model.parameters() if p.grad is not None]
        max_norm = self.cfg.max_grad_norm if self.cfg.max_grad_norm is not None else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        return float(norm)

    def _reduce_metrics(self, sums: dict[str, float], weight_total: float) -> dict[str, float]:
        """Loss is summed over workers; the other metrics are token-weighted means over workers."""
        keys = sorted(sums)
        vec = torch.tensor([sums[k] for k in keys] + [weight_total], dtype=torch.float64)
        if dist.is_initialized() and self.world_size > 1:
            dist.all_reduce(vec)
        total_w = float(vec[-1]) or 1.0
        return {k: float(vec[i]) if k == "loss" else float(vec[i]) / total_w for i, k in enumerate(keys)}

    # ---- checkpoints --------------------------------------------------------------------------
    def save_checkpoint(self, path: str, save_optimizer: bool = True) -> None:
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                             get_optimizer_state_dict)

        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        model_sd = get_model_state_dict(self.model, options=opts)
        optim_sd = get_optimizer_state_dict(self.model, self.optimizer, options=opts) if (
            save_optimizer and self.optimizer is not None) else None
        out = Path(path)
        if self.rank == 0:
            out.mkdir(parents=True, exist_ok=True)
            # A plain HF folder: the checkpoint's weights load with from_pretrained(path).
            self.model.save_pretrained(out, state_dict=model_sd, safe_serialization=True)
            self.tokenizer.save_pretrained(out)
            if optim_sd is not None:
                torch.save({"optimizer": optim_sd, "scheduler": self.scheduler.state_dict()}, out / "optimizer.pt")
        if dist.is_initialized() and self.world_size > 1:
            dist.barrier()
        torch.save(torch.get_rng_state(), out / f"rng_rank{self.rank}.pt")

    def load_checkpoint(self, path: str, load_optimizer: bool = True) -> None:
        from safetensors.torch import load_file
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                             set_optimizer_state_dict)

        p = Path(path)
        files = sorted(p.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"{p}: no *.safetensors weights in checkpoint")
        sd: dict[str, torch.Tensor] = {}
        for f in files:
            sd.update(load_file(str(f)))
        if getattr(self.model.config, "tie_word_embeddings", False) and "lm_head.weight" not in sd:
            sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
        opts = StateDictOptions(full_state_dict=True, strict=False)
        set_model_state_dict(self.model, sd, options=opts)
        if load_optimizer and self.optimizer is not None and (p / "optimizer.pt").exists():
            st = torch.load(p / "optimizer.pt", weights_only=False)
            set_optimizer_state_dict(self.model, self.optimizer, st["optimizer"], options=opts)
            self.scheduler.load_state_dict(st["scheduler"])
        rng = p / f"rng_rank{self.rank}.pt"
        if rng.exists():
            torch.set_rng_state(torch.load(rng))

    def shutdown(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def _mean_dicts(ds: list[dict[str, float]]) -> dict[str, float]:
    keys = {k for d in ds for k in d}
    return {k: sum(d[k] for d in ds if k in d) / sum(1 for d in ds if k in d) for k in keys}
