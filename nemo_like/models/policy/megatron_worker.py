"""A training worker on Megatron-core's ``GPTModel`` (local spec, tensor/pipeline parallel 1).

The same public methods as :class:`HFPolicyWorker` for log-probs, reference log-probs, training,
checkpoints and the refit source, so the ``Policy`` facade and the GRPO loop use it unchanged. It
subclasses the HF worker for the parts that do not depend on the model class (the micro-batch plan,
the training loop and its metrics, the reference-weight swap, the rank reductions) and replaces the
rest:

* the model is the ``GPTModel`` that :mod:`megatron_mapping` builds from the HF folder's config, its
  weights mapped from the HF weights. Parameters are in ``policy.precision``; with bf16 the
  optimizer keeps float32 master weights (AdamW over them, copied into the model after each step), as
  Megatron's own mixed-precision optimizer does. Ranks above one are plain data parallel: every rank
  holds the whole model and gradients are averaged over ranks before the step.
* checkpoints, ``export_merged`` and the refit's exported view are plain HF (``from_pretrained``
  names, tied weights once) of the float32 weights, like the HF worker's: a checkpoint of either
  worker loads into the other (the optimizer state only into the worker kind that wrote it).
* on a CPU megatron's CUDA-only bits are pointed at the CPU for the worker's life
  (``megatron_mapping.cpu_forward_context``; CI and development only).

Not supported (refused at start with the setting to change): LoRA, sequence packing (Megatron packs
with Transformer Engine's THD attention), activation checkpointing, and generation: the worker does
not generate, so it needs ``policy.generation.colocated: false`` (a rollout group refit from it).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import nemo_like.models.policy.megatron_mapping as mm
import nemo_like.models.policy.weight_export as weight_export
from nemo_like.data.chat_templates import apply_chat_template_setting
from nemo_like.distributed.batched_data_dict import BatchedDataDict
from nemo_like.models.policy.hf_worker import HFPolicyWorker
from nemo_like.models.policy.interfaces import PolicyConfig
from nemo_like.models.policy.lora import refuse_adapter_checkpoint
from nemo_like.models.policy.packing import MicroBatch
from nemo_like.models.worker_base import PRECISION_DTYPES, setup_worker_process
from nemo_like.utils.perf import device_peak_flops, peak_memory_gb, training_flops_per_token

BACKEND = "megatron"


def check_megatron_supported(config: PolicyConfig) -> None:
    """Refuse the policy settings this worker does not implement, naming the setting."""
    problems = []
    if config.lora.enabled:
        problems.append("policy.lora.enabled (LoRA adapters are HF/peft only)")
    if config.sequence_packing.enabled:
        problems.append("policy.sequence_packing.enabled (Megatron packs with Transformer Engine's THD "
                        "attention, which the local spec has not)")
    if config.activation_checkpointing:
        problems.append("policy.activation_checkpointing (not mapped to Megatron's recompute yet)")
    if problems:
        raise ValueError("the Megatron policy backend does not support: " + "; ".join(problems))


class _MasterWeightAdamW:
    """AdamW over float32 master copies of lower-precision model parameters (the same objects when the
    model is float32): ``step`` updates the masters and copies them into the model."""

    def __init__(self, params: list[torch.nn.Parameter], masters: list[torch.Tensor], **adamw: Any):
        self.params, self.masters = params, masters
        self.shared = all(m is p for m, p in zip(masters, params))
        self.inner = torch.optim.AdamW(masters, **adamw)

    @property
    def param_groups(self):
        return self.inner.param_groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None
        if not self.shared:
            for m in self.masters:
                m.grad = None

    def grads_to_masters(self) -> list[torch.Tensor]:
        """The model's gradients as the masters' (float32); the masters that have one."""
        if not self.shared:
            for m, p in zip(self.masters, self.params):
                m.grad = None if p.grad is None else p.grad.detach().float()
        return [m for m in self.masters if m.grad is not None]

    @torch.no_grad()
    def step(self) -> None:
        self.inner.step()
        if not self.shared:
            for m, p in zip(self.masters, self.params):
                p.copy_(m)

    def state_dict(self) -> dict:
        return self.inner.state_dict()

    def load_state_dict(self, sd: dict) -> None:
        self.inner.load_state_dict(sd)


class MegatronPolicyWorker(HFPolicyWorker):
    @staticmethod
    def check_config(config: PolicyConfig) -> None:
        """The settings this worker refuses, checked by the config before Ray starts."""
        if config.generation.colocated:
            raise ValueError("policy.backend=megatron trains only (it does not generate): set "
                             "policy.generation.colocated=false, so that a rollout group generates and is "
                             "refit from it (cluster.generation.* places it)")
        check_megatron_supported(config)

    def __init__(self, config: PolicyConfig, *, seed: int = 0, init_reference_model: bool = True,
                 init_optimizer: bool = True):
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

        check_megatron_supported(config)
        mm.require_megatron()
        self.cfg = config
        self.rank, self.world_size, use_cuda, self.device = setup_worker_process(config.num_threads)
        self.sharded = False  # data-parallel replicas; _clip_grads below averages their gradients
        self._cpu_context = contextlib.ExitStack()
        if use_cuda:
            mm.init_model_parallel("nccl", seed=seed)
        else:
            mm.init_model_parallel("gloo")
            self._cpu_context.enter_context(mm.cpu_forward_context())
        torch.manual_seed(seed + self.rank)

        self.tokenizer = AutoTokenizer.from_pretrained(config.tokenizer_name or config.model_name,
                                                       trust_remote_code=config.trust_remote_code)
        if config.chat_template != "default":  # the template trained with goes into saved and exported folders
            apply_chat_template_setting(self.tokenizer, config.chat_template)
        self.hf_config = AutoConfig.from_pretrained(config.model_name, trust_remote_code=config.trust_remote_code)
        mm.model_dims(self.hf_config)  # refuses an unsupported architecture before any weights are read
        self.dtype = PRECISION_DTYPES[config.precision]
        hf = AutoModelForCausalLM.from_pretrained(config.model_name, dtype=torch.float32,
                                                  trust_remote_code=config.trust_remote_code)
        mapped = mm.hf_to_megatron_state_dict(hf.state_dict(), self.hf_config)
        del hf
        self.model = mm.build_gpt_model(self.hf_config, params_dtype=self.dtype,
                                        use_cpu_initialization=not use_cuda, perform_initialization=False)
        mm.load_megatron_state_dict(self.model, mapped)
        self.model.train()
        self._prefix_cache = None
        self._attention_ratio = 0.0  # only packing uses it
        self._names = [n for n, p in self.model.named_parameters() if p.requires_grad]
        self._params = [p for p in self.model.parameters() if p.requires_grad]
        # Master weights: float32 from the checkpoint itself (not the model's rounded copy).
        self._masters = self._params if self.dtype == torch.float32 else [
            mapped[n].detach().to(self.device, torch.float32).clone() for n in self._names]
        del mapped

        self.has_reference = init_reference_model
        self.reference_params = {n: self._stash(p) for n, p in self.model.named_parameters()} if (
            init_reference_model) else None
        self.base_fingerprint = None
        self.num_params = sum(p.numel() for p in self.model.parameters())
        self.optimizer = self.scheduler = None
        if init_optimizer:
            o = config.optimizer
            self.optimizer = _MasterWeightAdamW(self._params, self._masters, lr=o.lr, betas=o.betas, eps=o.eps,
                                                weight_decay=o.weight_decay)
            self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer.inner,
                                                               lambda s: config.scheduler.lr_factor(s))

    # ---- what the HF worker's loops call ----------------------------------------------------------
    def _reshard(self) -> None:
        return None  # no FSDP

    def _mb_logprobs(self, mb: MicroBatch) -> torch.Tensor:
        if mb.packed is not None:  # check_megatron_supported refuses packing; a plan never packs here
            raise RuntimeError("the Megatron worker got a packed micro-batch")
        ids = mb.data["input_ids"].to(self.device)
        logits = mm.gpt_logits(self.model, ids)
        lp = mm.token_logprobs_from_logits(logits, ids, self.cfg.generation.temperature)
        # Right padding under a causal mask: real tokens never see the pads; the pads' own values are
        # meaningless and zeroed.
        lengths = mb.data["input_lengths"].to(self.device)
        return lp * (torch.arange(ids.shape[1], device=self.device)[None] < lengths[:, None])

    def _clip_grads(self, max_grad_norm: float | None) -> float:
        """Average the gradients over the data-parallel ranks (the loop scaled each rank's loss by
        the world size, as FSDP expects), hand them to the float32 masters, clip those."""
        if dist.is_initialized() and self.world_size > 1:
            for p in self._params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
                p.grad.div_(self.world_size)
        grads = self.optimizer.grads_to_masters()
        max_norm = max_grad_norm if max_grad_norm is not None else float("inf")
        return float(torch.nn.utils.clip_grad_norm_(grads, max_norm))

    def _perf_metrics(self, lengths: torch.Tensor, elapsed: float) -> dict[str, float]:
        out = {"peak_memory_gb": peak_memory_gb(self.device)}
        peak = device_peak_flops(torch.cuda.get_device_name(self.device)) if self.device.type == "cuda" else None
        lengths = lengths.double()
        if peak and elapsed > 0 and lengths.numel():
            context = float((lengths ** 2).sum() / 2 / lengths.sum())
            flops = training_flops_per_token(self.hf_config, self.num_params, context) * float(lengths.sum())
            out["mfu"] = flops / elapsed / peak
        return out

    # ---- generation: not here ---------------------------------------------------------------------
    def generate(self, data: BatchedDataDict, greedy: bool = False) -> BatchedDataDict:
        raise NotImplementedError("the Megatron policy backend does not generate: set "
                                  "policy.generation.colocated: false (a rollout group refit from the policy)")

    def generate_episodes(self, data: BatchedDataDict, envs: dict, **kwargs: Any):
        self.generate(data)

    # ---- the weights as HF names ------------------------------------------------------------------
    def _float32_megatron_state(self) -> dict[str, torch.Tensor]:
        """Megatron name -> the float32 weights (the masters; the parameters themselves in float32)."""
        return {n: m.detach() for n, m in zip(self._names, self._masters)}

    def _iter_hf_tensors(self) -> Iterator[weight_export.NamedTensor]:
        """(plain HF name, float32 CPU tensor), tied weights once, in ``named_parameters`` order."""
        hf = mm.megatron_to_hf_state_dict(self._float32_megatron_state(), self.hf_config)
        for name in list(hf):
            yield name, hf.pop(name).cpu()

    def export_weight_chunks(self, max_bytes: int) -> list:
        import ray

        emit = ray.put if self.rank == 0 else (lambda chunk: None)
        if self.rank != 0:
            return []
        return weight_export.chunk_named_tensors(self._iter_hf_tensors(), max_bytes, emit)

    def weights_manifest(self) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        return [(n, s, torch.float32) for n, s in mm.hf_parameter_shapes(self.hf_config).items()]

    def weights_checksum(self) -> str:
        return weight_export.named_checksum(self._iter_hf_tensors())

    def broadcast_weights(self, max_bytes: int) -> dict[str, float]:
        from nemo_like.models.generation import collective_refit

        if self.rank != 0:
            return {}
        if self._refit_group is None:
            raise RuntimeError("broadcast_weights before join_refit_group: the refit group is not set up")
        nbytes, buckets = collective_refit.send(self._refit_group, self._iter_hf_tensors(), self.weights_manifest(),
                                                max_bytes, self.device)
        return {"bytes": float(nbytes), "buckets": float(buckets)}

    # ---- checkpoints ------------------------------------------------------------------------------
    def _save_weights(self, path: str, merged: bool = True) -> Path:
        """An HF folder (config, float32 safetensors, tokenizer, generation config) of the weights;
        rank 0 writes."""
        from safetensors.torch import save_file

        out = Path(path)
        if self.rank == 0:
            out.mkdir(parents=True, exist_ok=True)
            self.tokenizer.save_pretrained(out)
            self.hf_config.save_pretrained(out)
            with contextlib.suppress(Exception):  # a folder without generation_config.json has none to copy
                from transformers import GenerationConfig

                GenerationConfig.from_pretrained(self.cfg.model_name).save_pretrained(out)
            save_file(dict(self._iter_hf_tensors()), str(out / "model.safetensors"), metadata={"format": "pt"})
        return out

    def save_checkpoint(self, path: str, save_optimizer: bool = True) -> None:
        out = self._save_weights(path)
        if self.rank == 0 and save_optimizer and self.optimizer is not None:
            torch.save({"backend": BACKEND, "optimizer": self.optimizer.state_dict(),
                        "scheduler": self.scheduler.state_dict(), "param_names": self._names},
                       out / "optimizer.pt")
        if dist.is_initialized() and self.world_size > 1:
            dist.barrier()
        torch.save(torch.get_rng_state(), out / f"rng_rank{self.rank}.pt")

    def export_merged(self, path: str) -> None:
        self._save_weights(path)
        if dist.is_initialized() and self.world_size > 1:
            dist.barrier()

    def load_checkpoint(self, path: str, load_optimizer: bool = True) -> None:
        """Exact or refused: every weight of the model from the checkpoint's HF folder and nothing else;
        the optimizer state only from a checkpoint this worker kind wrote."""
        p = Path(path)
        refuse_adapter_checkpoint(p)
        sd = weight_export.read_safetensors_folder(p)
        try:
            mapped = mm.hf_to_megatron_state_dict(sd, self.hf_config)
        except (KeyError, ValueError) as e:
            raise RuntimeError(f"{p}: the checkpoint's weights do not match the model: {e}") from e
        mm.load_megatron_state_dict(self.model, mapped)  # copies cast to the model's dtype
        if self._masters is not self._params:
            with torch.no_grad():
                for n, m in zip(self._names, self._masters):
                    m.copy_(mapped[n])
        if load_optimizer and self.optimizer is not None and (p / "optimizer.pt").exists():
            st = torch.load(p / "optimizer.pt", weights_only=True, map_location="cpu")
            if st.get("backend") != BACKEND or st.get("param_names") != self._names:
                raise RuntimeError(f"{p}/optimizer.pt was not written by the Megatron worker of this model; "
                                   "load the weights only (load_optimizer=False)")
            self.optimizer.load_state_dict(st["optimizer"])
            self.scheduler.load_state_dict(st["scheduler"])
        rng = p / f"rng_rank{self.rank}.pt"
        if rng.exists():
            torch.set_rng_state(torch.load(rng, weights_only=True))

    def shutdown(self) -> None:
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
        self._cpu_context.close()
        if dist.is_initialized():
            dist.destroy_process_group()
