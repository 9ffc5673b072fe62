"""What every training worker (the policy's HF worker, the critic's, the reward model's) does the same
way: its process (threads, rank, device, process group), reductions over ranks, FSDP2 sharding or
plain data-parallel replicas, gradient clipping, and AdamW with a LambdaLR schedule.

A subclass calls ``_setup_process`` first and sets ``self.model`` (the module it trains) and
``self.sharded`` (FSDP2 or not). Every rank starts from one model (``_broadcast_from_rank0`` for
what is random at start). With several ranks and no FSDP the ranks are replicas that average their
gradients before clipping (``_clip_grads``), as PyTorch's DDP would: at float32, ``fsdp: false``
changes the memory a rank holds, not the update (a lower precision is autocast there, FSDP's
parameter cast when sharded: the two round differently).
"""

from __future__ import annotations

import os
from contextlib import nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

PRECISION_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def pick_device(use_cuda: bool) -> torch.device:
    """The GPU this process was given. Ray narrows CUDA_VISIBLE_DEVICES to an actor's own GPU, which
    is then device 0 of what it sees (LOCAL_RANK would point past it for every rank above 0); under
    torchrun every GPU of the node is visible and LOCAL_RANK picks one."""
    if not use_cuda:
        return torch.device("cpu")
    n = torch.cuda.device_count()
    if n == 0:
        raise RuntimeError("cluster.gpus_per_worker > 0 but this worker sees no CUDA device "
                           f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})")
    return torch.device("cuda", 0 if n == 1 else int(os.environ.get("LOCAL_RANK", "0")) % n)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """A parameter's own storage: its shard under FSDP2 (a DTensor), itself otherwise."""
    return t.to_local() if hasattr(t, "to_local") else t


def setup_worker_process(num_threads: int | None) -> tuple[int, int, bool, torch.device]:
    """Torch threads (the config's, else its CPU share, ``NEMO_LIKE_NUM_THREADS``), the rank and world
    size (set by ``RayWorkerGroup``) and the device. Returns ``(rank, world_size, use_cuda, device)``."""
    threads = num_threads or int(os.environ.get("NEMO_LIKE_NUM_THREADS", "1"))
    torch.set_num_threads(max(1, threads))
    rank, world_size = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    use_cuda = os.environ.get("NEMO_LIKE_USE_GPU", "0") == "1"
    device = pick_device(use_cuda)
    if use_cuda:
        torch.cuda.set_device(device)
    return rank, world_size, use_cuda, device


def init_process_group_once(use_cuda: bool, rank: int, world_size: int) -> None:
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if use_cuda else "gloo", rank=rank, world_size=world_size)


def fused_adamw_supported(params: list[torch.Tensor]) -> bool:
    """Whether torch's fused AdamW can take ``params``: plain floating tensors on the CPU or one GPU
    type. FSDP's DTensors take the default (per-tensor) implementation."""
    from torch.distributed.tensor import DTensor

    kinds = {p.device.type for p in params}
    return bool(params) and len(kinds) == 1 and kinds <= {"cpu", "cuda"} and all(
        p.is_floating_point() and not isinstance(p, DTensor) for p in params)


def make_optimizer(params, optimizer_cfg: Any, scheduler_cfg: Any):
    """AdamW over ``params`` and a LambdaLR of the scheduler config's ``lr_factor``. Fused where the
    parameters allow: one kernel for every tensor instead of a Python loop over them, about 4x faster
    on the CPU for a 135M model (the same update up to float rounding)."""
    o = optimizer_cfg
    params = list(params)
    optimizer = torch.optim.AdamW(params, lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay,
                                  fused=fused_adamw_supported(params) or None)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: scheduler_cfg.lr_factor(s))


class TrainingWorkerBase:
    rank: int = 0
    world_size: int = 1
    device: torch.device = torch.device("cpu")
    model: nn.Module
    sharded: bool = False

    def _setup_process(self, num_threads: int | None) -> bool:
        """Threads, rank, world size, device and the process group; returns whether it is on CUDA."""
        self.rank, self.world_size, use_cuda, self.device = setup_worker_process(num_threads)
        init_process_group_once(use_cuda, self.rank, self.world_size)
        return use_cuda

    @property
    def replicas(self) -> bool:
        """Several ranks each holding the whole model (no FSDP)."""
        return self.world_size > 1 and not self.sharded

    def _reduce(self, t: torch.Tensor, op=None) -> torch.Tensor:
        """``t`` (CPU) reduced over the ranks (default: sum), back on the CPU; NCCL reduces only
        tensors on the GPU."""
        if not (dist.is_initialized() and self.world_size > 1):
            return t
        out = t.to(self.device) if self.device.type == "cuda" else t.clone()
        dist.all_reduce(out, op=op or dist.ReduceOp.SUM)
        return out.cpu()

    def _synced_count(self, n: int) -> int:
        """Passes every rank runs: FSDP's collectives run in lock step, and token budgets can give
        ranks different counts; a rank with fewer repeats a pass whose result it throws away."""
        if self.world_size == 1:
            return n
        return int(self._reduce(torch.tensor([n], dtype=torch.long), op=dist.ReduceOp.MAX)[0])

    def _barrier(self) -> None:
        if dist.is_initialized() and self.world_size > 1:
            dist.barrier()

    # ---- sharding ----------------------------------------------------------------------------
    def _fully_shard(self, model: nn.Module, layers, precision: str = "float32") -> nn.Module:
        """FSDP2 over all ranks: each of ``layers`` its own unit, the root holding the rest; a
        precision other than float32 as FSDP mixed precision (float32 master weights, reductions)."""
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        kw: dict = {"mesh": init_device_mesh(self.device.type, (self.world_size,))}
        if precision != "float32":
            kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=PRECISION_DTYPES[precision], reduce_dtype=torch.float32)
        for layer in layers or []:
            fully_shard(layer, **kw)
        fully_shard(model, **kw)
        return model

    def _reshard(self) -> None:
        # FSDP2 leaves the root module's parameters unsharded after a forward pass; put every
        # parameter back to its sharded DTensor form before touching parameters directly.
        from torch.distributed.fsdp import FSDPModule

        for m in self.model.modules():
            if isinstance(m, FSDPModule):
                m.reshard()

    def _autocast(self, precision: str):
        """Unsharded, a lower precision is applied by autocast (sharded, FSDP's mixed precision does it)."""
        if self.sharded or precision == "float32":
            return nullcontext()
        return torch.autocast(self.device.type, dtype=PRECISION_DTYPES[precision])

    def _broadcast_from_rank0(self, model: nn.Module, names) -> None:
        """Before sharding: the parameters ``names`` of ``model`` (a new head, LoRA adapters: random
        per process) made rank 0's on every rank, so the ranks start from one model, as one rank would."""
        if self.world_size == 1 or not names:  # (every rank computes the same names)
            return
        wanted = set(names)
        with torch.no_grad():
            for n, p in model.named_parameters():
                if n in wanted:
                    dist.broadcast(p.data, src=0)

    # ---- gradients ----------------------------------------------------------------------------
    def _average_replica_grads(self) -> None:
        """Replicas: the mean gradient over the ranks (FSDP's reduce-scatter does this when sharded).
        A parameter with a gradient on some ranks only gets zeros on the others, so every rank reduces
        the same list; one with none anywhere keeps ``None`` (AdamW skips it, as on one rank)."""
        if not self.replicas:
            return
        cuda = self.device.type == "cuda"
        params = [p for p in self.model.parameters() if p.requires_grad]
        has = self._reduce(torch.tensor([p.grad is not None for p in params], dtype=torch.float32))
        for p, anywhere in zip(params, has.tolist()):
            if not anywhere:
                continue
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad, op=dist.ReduceOp.AVG if cuda else dist.ReduceOp.SUM)
            if not cuda:  # gloo has no AVG
                p.grad.div_(self.world_size)

    def _clip_grads(self, max_grad_norm: float | None) -> float:
        """Average the replicas' gradients, then clip the global L2 norm to ``max_grad_norm`` (None:
        no clipping); returns the norm before clipping."""
        self._average_replica_grads()
        params = [p for p in self.model.parameters() if p.grad is not None]
        if not params:
            return 0.0
        norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm if max_grad_norm is not None else float("inf"))
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        return float(norm)

    def shutdown(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
