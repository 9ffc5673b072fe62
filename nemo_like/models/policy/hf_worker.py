"""One training worker: a HF causal LM sharded with FSDP2 over torch.distributed (gloo on CPU, NCCL on GPU).

The Policy facade creates one of these per placement-group bundle through RayWorkerGroup; every
public method here is called on all workers at once with that worker's shard of the batch.
"""

from __future__ import annotations

import gc
import math
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from nemo_like.data.chat_templates import apply_chat_template_setting
from nemo_like.distributed.batched_data_dict import BatchedDataDict
from nemo_like.experience.streaming import stream_episodes
from nemo_like.models.generation.hf_generation import hf_generate
from nemo_like.models.generation.prefix_cache import make_prefix_cache
from nemo_like.models.generation.request_stream import serve_remote_requests
from nemo_like.models.policy.interfaces import PolicyConfig
from nemo_like.models.policy.lora import (
    apply_lora,
    base_fingerprint,
    export_merged_model,
    hf_model,
    load_adapter,
    refuse_adapter_checkpoint,
    save_adapter,
    trainable_parameters,
)
from nemo_like.models.policy.packing import (
    MicroBatch,
    attention_cost_ratio,
    check_packing_supported,
    packed_token_logprobs,
    plan_microbatches,
)
from nemo_like.models.policy.refit_source import RefitSourceMixin
from nemo_like.models.policy.selected_logits import can_select, try_selected
from nemo_like.models.policy.weight_export import read_safetensors_folder
from nemo_like.models.worker_base import TrainingWorkerBase, local_tensor, make_optimizer
from nemo_like.utils.perf import device_peak_flops, peak_memory_gb, training_flops_per_token


def token_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, temperature: float,
                   topk: int | torch.Tensor | None = None, need: torch.Tensor | None = None):
    """logprobs[:, t] = log p(input_ids[:, t] | < t); position 0 has no prediction and is 0.

    ``topk`` (distillation): an int k also returns the k most likely tokens' ids and log-probs at
    every position ([B, T, k] each); a tensor of ids [B, T, k] also returns their log-probs [B, T, k].
    ``need`` [B, >= T] (a ``token_mask``): computed only where it is nonzero, 0 elsewhere
    (``selected_logits``)."""
    B, W = input_ids.shape
    if need is not None and can_select(model):
        need = need[:, :W].to(input_ids.device) != 0
        need[:, 0] = False
        if need.any():
            cols = (torch.arange(W, device=input_ids.device) - 1).clamp(min=0)
            flat_pos = torch.arange(B, device=input_ids.device)[:, None] * W + cols[None, :]
            out = try_selected(model, {"input_ids": input_ids, "attention_mask": attention_mask}, flat_pos,
                               input_ids, need, temperature, topk)
            if out is not None:
                return out
    logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
    logits = logits[:, :-1].float()
    if temperature != 1.0:
        logits = logits / temperature
    targets = input_ids[:, 1:]
    # gather - logsumexp avoids materialising a second [B,T,V] tensor for log_softmax.
    picked = torch.gather(logits, 2, targets.unsqueeze(-1)).squeeze(-1)
    lse = torch.logsumexp(logits, dim=-1)
    lp = _shift_in(picked - lse)
    if topk is None:
        return lp
    if isinstance(topk, int):
        vals, ids = logits.topk(topk, dim=-1)
        return lp, _shift_in(ids), _shift_in(vals - lse[..., None])
    ids = topk[:, 1:].to(logits.device)
    return lp, _shift_in(torch.gather(logits, 2, ids) - lse[..., None])


def _shift_in(x: torch.Tensor) -> torch.Tensor:
    """Predictions of tokens 1.. as positions 1..: position 0 (no prediction) gets zeros."""
    return torch.cat([torch.zeros_like(x[:, :1]), x], dim=1)


def _attention_mask(input_ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    ar = torch.arange(input_ids.shape[1], device=input_ids.device)
    return (ar[None, :] < lengths[:, None].to(input_ids.device)).long()


def _without_skipped(gb: BatchedDataDict) -> tuple[BatchedDataDict, int]:
    """The samples a training pass computes, and how many of them train: those not flagged
    ``skip_pass`` (samples that cannot move the weights, see ``guards.inert_samples``). With every
    sample flagged, the shortest is kept with its loss masked (0 trained), so the optimizer still
    gets gradients (zeros, as the full pass would give) and FSDP ranks stay in lock step."""
    if "skip_pass" not in gb:
        return gb, gb.size
    keep = ~gb["skip_pass"].bool()
    if keep.any():
        return gb.select_indices(keep), int(keep.sum())
    one = gb.select_indices([int(gb["input_lengths"].argmin())])
    one["sample_mask"] = torch.zeros(1)
    return one, 0


class HFPolicyWorker(RefitSourceMixin, TrainingWorkerBase):
    def __init__(self, config: PolicyConfig, *, seed: int = 0, init_reference_model: bool = True,
                 init_optimizer: bool = True):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.cfg = config
        self._setup_process(config.num_threads)
        torch.manual_seed(seed + self.rank)

        self.tokenizer = AutoTokenizer.from_pretrained(config.tokenizer_name or config.model_name,
                                                       trust_remote_code=config.trust_remote_code)
        if config.chat_template != "default":  # the template trained with goes into saved and exported folders
            apply_chat_template_setting(self.tokenizer, config.chat_template)
        # Master weights stay fp32; bf16 is FSDP mixed precision for compute (unsharded: autocast).
        model = AutoModelForCausalLM.from_pretrained(config.model_name, dtype=torch.float32,
                                                     trust_remote_code=config.trust_remote_code)
        model.to(self.device)
        if config.sequence_packing.enabled:
            check_packing_supported(model)
        self._attention_ratio = attention_cost_ratio(model.config)  # for packing's row length
        if config.activation_checkpointing:
            model.gradient_checkpointing_enable()
        # FSDP2 on one rank shards nothing but still pays for its hooks and DTensor optimizer steps
        # (measured back to back: 8-15% slower per SFT step of the tiny model); it stays on for one
        # rank only where it supplies mixed precision. Off, several ranks are replicas (worker_base).
        self.sharded = config.fsdp and (self.world_size > 1 or config.precision != "float32")
        if config.lora.enabled:  # adapters go in before sharding: FSDP2 shards them with their layer
            model = apply_lora(model, config.lora, config.model_name)
        # Every rank starts from rank 0's model: replicas get all of it (as DDP does: a weight the
        # checkpoint lacks is random per process), sharded ranks the random adapters.
        self._broadcast_from_rank0(model, [n for n, p in model.named_parameters()
                                           if self.replicas or (config.lora.enabled and p.requires_grad)])
        layers = getattr(getattr(hf_model(model), "model", None), "layers", None)
        self.model = self._fully_shard(model, layers, config.precision) if self.sharded else model
        self._prefix_cache = make_prefix_cache(config)  # next turns reuse their episode's KV
        self.model.train()

        # The reference policy is the initial weights; kept as a detached copy and swapped in for
        # reference logprobs (NeMo RL does the same) rather than a second model instance. With LoRA
        # the frozen base is the reference: the model with its adapter disabled, no copy.
        self._reshard()
        self.has_reference = init_reference_model
        # On a GPU the reference copy lives in pinned host memory: it is only needed for the
        # reference log-prob pass, and a second full set of weights in GPU memory would be waste.
        self.reference_params = {n: self._stash(p) for n, p in self.model.named_parameters()} if (
            init_reference_model and not config.lora.enabled) else None
        # What a LoRA checkpoint or export checks the base weights against (they never change).
        self.base_fingerprint = base_fingerprint(self.model) if config.lora.enabled else None
        self.num_params = sum(p.numel() for p in self.model.parameters())
        self.optimizer = self.scheduler = None
        if init_optimizer:
            # Only what trains is optimised: AdamW's moments for frozen base weights would be waste.
            self.optimizer, self.scheduler = make_optimizer(trainable_parameters(self.model), config.optimizer,
                                                            config.scheduler)

    # ---- generation -------------------------------------------------------------------------
    def generate(self, data: BatchedDataDict, greedy: bool = False) -> BatchedDataDict:
        self.model.eval()
        with self._gathered(), self._autocast(self.cfg.precision):
            try:
                out = hf_generate(
                    self.model, self.tokenizer, data, self.cfg.generation, greedy=greedy,
                    max_total_length=self.cfg.max_total_sequence_length,
                    micro_batch_size=self.cfg.generation_batch_size,
                    synced=self.world_size > 1, device=self.device, prefix_cache=self._prefix_cache,
                )
            finally:
                self.model.train()
        return out

    def generate_episodes(self, data: BatchedDataDict, envs: dict, **kwargs: Any):
        """``stream_episodes`` on this worker's model (one rank: ``Policy.streams_episodes``)."""
        self.model.eval()
        with self._gathered(), self._autocast(self.cfg.precision):
            try:
                return stream_episodes(self.model, self.tokenizer, data, envs, self.cfg.generation,
                                       max_total_length=self.cfg.max_total_sequence_length,
                                       slots=self.cfg.generation.max_num_seqs or self.cfg.generation_batch_size,
                                       device=self.device, prefix_cache=self._prefix_cache, **kwargs)
            finally:
                self.model.train()

    def serve_requests(self, url: str, key: str | None) -> dict[str, float]:
        """Decode the turns the trainer's server at ``url`` queues (``request_stream``) until it
        closes the rollout (one rank: ``Policy.serves_requests``)."""
        self.model.eval()
        with self._gathered(), self._autocast(self.cfg.precision):
            try:
                return serve_remote_requests(
                    self.model, self.tokenizer, self.cfg.generation, url, key,
                    max_total_length=self.cfg.max_total_sequence_length,
                    slots=self.cfg.generation.max_num_seqs or self.cfg.generation_batch_size,
                    device=self.device, prefix_cache=self._prefix_cache)
            finally:
                self.model.train()

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
    def _mb_logprobs(self, mb: MicroBatch, topk: int | torch.Tensor | None = None):
        """[b, w] log-probs of the micro-batch's samples, in ``mb.idx`` order (and top-k parts with
        ``topk``: ``token_logprobs``); where the batch has a ``token_mask``, only there (0 elsewhere:
        every loss reads them through it)."""
        temp = self.cfg.generation.temperature
        need = mb.data["token_mask"] if "token_mask" in mb.data else None
        with self._autocast(self.cfg.precision):
            if mb.packed is not None:
                return packed_token_logprobs(self.model, mb.packed.to(self.device), temp, topk, need)
            ids = mb.data["input_ids"].to(self.device)
            return token_logprobs(self.model, ids, _attention_mask(ids, mb.data["input_lengths"]), temp, topk, need)

    @torch.no_grad()
    def get_logprobs(self, data: BatchedDataDict) -> BatchedDataDict:
        # Log-probs of the policy itself, not of one dropout draw (LoRA dropout, models with dropout).
        self.model.eval()
        try:
            return self._logprobs(data)
        finally:
            self.model.train()

    def _logprobs(self, data: BatchedDataDict) -> BatchedDataDict:
        lp = torch.zeros_like(data["input_ids"], dtype=torch.float32)
        mbs = plan_microbatches(data, self.cfg, self.cfg.logprob_batch_size, self._attention_ratio)
        real = computed = 0
        for n_pass in range(self._synced_count(len(mbs))):
            mb = mbs[min(n_pass, len(mbs) - 1)]
            out = self._mb_logprobs(mb)
            if n_pass < len(mbs):
                lp[mb.idx, : out.shape[1]] = out.float().cpu()
                real, computed = real + mb.tokens_real, computed + mb.tokens_computed
        return BatchedDataDict(logprobs=lp, padding_efficiency=torch.full((data.size,), real / max(computed, 1)))

    @torch.no_grad()
    def get_topk_logprobs(self, data: BatchedDataDict, k: int) -> BatchedDataDict:
        """``logprobs`` [B, T] of the tokens, and ``topk_ids`` / ``topk_logprobs`` [B, T, k]: the k most
        likely next tokens at every position (a distillation teacher's targets)."""
        self.model.eval()
        try:
            B, T = data["input_ids"].shape
            lp = torch.zeros(B, T)
            ids, vals = torch.zeros(B, T, k, dtype=torch.long), torch.zeros(B, T, k)
            mbs = plan_microbatches(data, self.cfg, self.cfg.logprob_batch_size, self._attention_ratio)
            for n_pass in range(self._synced_count(len(mbs))):
                mb = mbs[min(n_pass, len(mbs) - 1)]
                out, top_ids, top_lp = self._mb_logprobs(mb, k)
                if n_pass < len(mbs):
                    w = out.shape[1]
                    lp[mb.idx, :w], ids[mb.idx, :w], vals[mb.idx, :w] = out.float().cpu(), top_ids.cpu(), top_lp.float().cpu()
            return BatchedDataDict(logprobs=lp, topk_ids=ids, topk_logprobs=vals)
        finally:
            self.model.train()

    def get_reference_policy_logprobs(self, data: BatchedDataDict) -> BatchedDataDict:
        if not self.has_reference:
            raise RuntimeError("this policy was created without a reference model (init_reference_model=False)")
        with self.model.disable_adapter() if self.cfg.lora.enabled else self._swap_in(self.reference_params):
            lp = self.get_logprobs(data)["logprobs"]
        return BatchedDataDict(reference_logprobs=lp)

    def _stash(self, p: torch.Tensor) -> torch.Tensor:
        t = local_tensor(p.detach()).clone()
        return t.to("cpu").pin_memory() if self.device.type == "cuda" else t

    @contextmanager
    def _swap_in(self, params: dict[str, torch.Tensor]):
        self._reshard()
        current = dict(self.model.named_parameters())
        saved = {n: self._stash(p) for n, p in current.items()}
        with torch.no_grad():
            for n, p in current.items():
                local_tensor(p).copy_(params[n], non_blocking=True)
        try:
            yield
        finally:
            # The forward just run left the root's gathered parameters holding the swapped-in
            # values; the next forward would reuse them (FSDP2 does not gather an unsharded root).
            self._reshard()
            with torch.no_grad():
                for n, p in current.items():
                    local_tensor(p).copy_(saved[n], non_blocking=True)

    # ---- training -----------------------------------------------------------------------------
    def train(self, data: BatchedDataDict, loss_fn: Any, global_batch_size: int | None = None,
              micro_batch_size: int | None = None) -> dict[str, Any]:
        """`data` is this worker's shard; every global batch is split evenly over workers."""
        gbs = (global_batch_size or self.cfg.train_global_batch_size) // self.world_size
        mbs = micro_batch_size or self.cfg.train_micro_batch_size
        if gbs == 0 or data.size % gbs:
            raise ValueError(f"worker shard of {data.size} samples is not a multiple of the per-worker "
                             f"global batch {gbs} (policy.train_global_batch_size / world size)")
        self.model.train()
        all_metrics: list[dict[str, float]] = []
        tok_real = tok_computed = tok_samples = 0
        trained_lengths: list[torch.Tensor] = []  # of the samples the passes trained (MFU)
        t_start = time.perf_counter()
        for gb_start in range(0, data.size, gbs):
            gb = data.slice(gb_start, gb_start + gbs)
            mask = gb["token_mask"].float() * gb["sample_mask"].float()[:, None]
            counts = self._reduce(torch.tensor([mask.sum(), (mask.sum(1) > 0).sum()], dtype=torch.float64))
            global_toks, global_seqs = counts[0].float(), counts[1].float()
            gb, n_trained = _without_skipped(gb)  # after counting: the loss's normalisers still count them
            trained_lengths.append(gb["input_lengths"][:n_trained])

            self.optimizer.zero_grad(set_to_none=True)
            sums: dict[str, float] = {}
            weight_total = 0.0
            # Micro-batches grouped by length (or packed rows), each as wide as its own longest
            # sample. The loss is a share of global counts, so the gradient does not depend on the
            # grouping.
            plan = plan_microbatches(gb, self.cfg, mbs, self._attention_ratio)
            for n_pass in range(self._synced_count(len(plan))):
                item = plan[min(n_pass, len(plan) - 1)]
                mbd = item.data.copy().to(self.device)
                if "teacher_topk_ids" in mbd:  # a top-k distillation loss reads these ids' log-probs too
                    lp, mbd["curr_topk_logprobs"] = self._mb_logprobs(item, mbd["teacher_topk_ids"])
                else:
                    lp = self._mb_logprobs(item)
                loss, metrics = loss_fn(lp, mbd, global_seqs, global_toks)
                if n_pass >= len(plan):  # a lock-step pass of a rank with fewer micro-batches: no gradient
                    (loss * 0.0).backward()
                    continue
                # Gradients are averaged over ranks (FSDP, or the replicas' all-reduce); the loss is
                # already a share of the global sum.
                (loss * self.world_size).backward()
                tok_real += item.tokens_real
                tok_computed += item.tokens_computed
                tok_samples += item.sample_tokens
                mb = item.data
                w = float((mb["token_mask"].float() * mb["sample_mask"].float()[:, None]).sum())
                weight_total += w
                for k, v in metrics.items():
                    if k == "loss":
                        sums["loss"] = sums.get("loss", 0.0) + float(v)
                    else:
                        sums[k] = sums.get(k, 0.0) + float(v) * w
            grad_norm = self._clip_grads(self.cfg.max_grad_norm)
            self.optimizer.step()
            self.scheduler.step()
            all_metrics.append(self._reduce_metrics(sums, weight_total) | {
                "grad_norm": grad_norm, "lr": self.scheduler.get_last_lr()[0]})
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        elapsed = time.perf_counter() - t_start
        trained = torch.cat(trained_lengths)
        perf = self._perf_metrics(trained, elapsed)
        eff = torch.tensor([tok_real, tok_computed, perf.get("mfu", 0.0), tok_samples, trained.numel(),
                            float(trained.sum())], dtype=torch.float64)
        eff = self._reduce(eff)
        out = _mean_dicts(all_metrics) | {"num_optimizer_steps": float(len(all_metrics)),
                                          "padding_efficiency": float(eff[0] / eff[1].clamp(min=1)),
                                          # Positions computed per token of the samples: below 1 when
                                          # shared prompts are computed once.
                                          "computed_tokens_ratio": float(eff[1] / eff[3].clamp(min=1)),
                                          # Samples trained, all ranks (fewer under grpo.skip_inert_samples).
                                          "trained_samples": float(eff[4]),
                                          "trained_tokens": float(eff[5]),
                                          "peak_memory_gb": perf["peak_memory_gb"]}
        if "mfu" in perf:
            out["mfu"] = float(eff[2]) / self.world_size
        return out

    def _perf_metrics(self, lengths: torch.Tensor, elapsed: float) -> dict[str, float]:
        """This rank's peak memory and, on a GPU of known peak, its model FLOPs utilisation over the
        samples trained (``lengths``)."""
        out = {"peak_memory_gb": peak_memory_gb(self.device)}
        peak = device_peak_flops(torch.cuda.get_device_name(self.device)) if self.device.type == "cuda" else None
        lengths = lengths.double()
        if peak and elapsed > 0 and lengths.numel():
            # Causal attention: a token attends to half its sequence on average (sum n^2 / 2 / sum n).
            context = float((lengths ** 2).sum() / 2 / lengths.sum())
            flops = training_flops_per_token(self.model.config, self.num_params, context) * float(lengths.sum())
            out["mfu"] = flops / elapsed / peak
        return out

    def release_generation_memory(self) -> None:
        """After generation: return the KV cache's blocks (and the prefix cache's) before training."""
        if self._prefix_cache is not None:
            self._prefix_cache.clear()
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _reduce_metrics(self, sums: dict[str, float], weight_total: float) -> dict[str, float]:
        """Loss is summed over workers; the other metrics are token-weighted means over workers."""
        keys = sorted(sums)
        vec = self._reduce(torch.tensor([sums[k] for k in keys] + [weight_total], dtype=torch.float64))
        total_w = float(vec[-1])
        # Nothing carried loss (every sample masked or skipped): the means are undefined, NaN (logged as
        # null), not 0.0, which would read as a collapsed ratio; the keys stay for tables and curves.
        return {k: float(vec[i]) if k == "loss" else (float(vec[i]) / total_w if total_w else math.nan)
                for i, k in enumerate(keys)}

    # ---- checkpoints --------------------------------------------------------------------------
    def save_checkpoint(self, path: str, save_optimizer: bool = True) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        out = self._save_weights(path, merged=False)
        optim_sd = get_optimizer_state_dict(self.model, self.optimizer, options=opts) if (
            save_optimizer and self.optimizer is not None) else None
        if self.rank == 0:
            if optim_sd is not None:
                torch.save({"optimizer": optim_sd, "scheduler": self.scheduler.state_dict()}, out / "optimizer.pt")
        self._barrier()
        torch.save(torch.get_rng_state(), out / f"rng_rank{self.rank}.pt")

    def export_merged(self, path: str) -> None:
        """A plain HF folder of the policy as it computes: with LoRA, the adapter merged into the base."""
        self._save_weights(path, merged=True)
        self._barrier()

    def _save_weights(self, path: str, merged: bool) -> Path:
        """Tokenizer and weights into ``path`` (every rank calls this, rank 0 writes): a plain HF
        folder, or with LoRA the adapter as a peft folder (``merged``: merged into a plain HF folder)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        out = Path(path)
        self._reshard()
        if self.rank == 0:
            out.mkdir(parents=True, exist_ok=True)
            self.tokenizer.save_pretrained(out)
        if self.cfg.lora.enabled:
            save = export_merged_model if merged else save_adapter
            save(self.model, self.cfg, out, self.rank, self.base_fingerprint)
            return out
        model_sd = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if self.rank == 0:
            self.model.save_pretrained(out, state_dict=model_sd, safe_serialization=True)
        return out

    def load_checkpoint(self, path: str, load_optimizer: bool = True) -> None:
        """Exact or refused: every tensor of the model (with LoRA: of the adapter, see lora.py) from the
        checkpoint and nothing else (an error names the missing and unexpected ones); files read as
        tensors and plain types only."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        p = Path(path)
        self._reshard()  # after a forward-only pass the root's parameters are plain tensors, not shards
        if self.cfg.lora.enabled:
            load_adapter(self.model, self.cfg, p, self.base_fingerprint)
        else:
            self._load_full_weights(p)
        opts = StateDictOptions(full_state_dict=True, strict=True)
        if load_optimizer and self.optimizer is not None and (p / "optimizer.pt").exists():
            st = torch.load(p / "optimizer.pt", weights_only=True, map_location="cpu")
            set_optimizer_state_dict(self.model, self.optimizer, st["optimizer"], options=opts)
            self.scheduler.load_state_dict(st["scheduler"])
        rng = p / f"rng_rank{self.rank}.pt"
        if rng.exists():
            torch.set_rng_state(torch.load(rng, weights_only=True))

    def _load_full_weights(self, p: Path) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        refuse_adapter_checkpoint(p)
        sd = read_safetensors_folder(p)
        if getattr(self.model.config, "tie_word_embeddings", False) and "lm_head.weight" not in sd:
            sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
        expected = set(self.model.state_dict())  # FSDP2 keeps the plain names; no gather needed
        missing, unexpected = sorted(expected - set(sd)), sorted(set(sd) - expected)
        if missing or unexpected:
            raise RuntimeError(f"{p}: the checkpoint's weights do not match the model: missing {missing[:10]}"
                               f"{' ...' if len(missing) > 10 else ''}, unexpected {unexpected[:10]}"
                               f"{' ...' if len(unexpected) > 10 else ''}")
        set_model_state_dict(self.model, sd, options=StateDictOptions(full_state_dict=True, strict=True))


def _mean_dicts(ds: list[dict[str, float]]) -> dict[str, float]:
    """Per key, the mean over the dicts that have a number for it (NaN: an optimizer step with
    nothing to average, left out); NaN where none has."""
    keys = {k for d in ds for k in d}
    vals = {k: [d[k] for d in ds if k in d and not math.isnan(d[k])] for k in keys}
    return {k: sum(v) / len(v) if v else math.nan for k, v in vals.items()}
