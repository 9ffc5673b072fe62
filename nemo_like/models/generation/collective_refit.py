"""Refit by collective broadcast (``policy.generation.refit_transport: collective``).

The policy's rank 0 and every rollout worker join a process group of their own (rank 0 sends,
rollout worker i is rank i + 1), apart from the training ranks' FSDP group: gloo between CPU
processes, NCCL between GPUs, so on GPUs the weights go device to device and never through host
memory or the object store (verl and NeMo RL refit non-colocated engines the same way). The group is
made once, at the first refit, and reused.

Both ends agree on the stream without sending names: the receivers check the policy's manifest
(name, shape, dtype of every exported tensor, in order) against their own parameters before anything
is sent (a mismatch is an error naming the tensor, and nobody is left waiting in a collective), then
``bucket_plan(manifest, max_bytes)`` cuts the stream into the same byte buckets on every rank: one
broadcast per bucket of at most ``refit_chunk_mb`` MiB (a bigger tensor alone), each tensor at an
offset aligned for its dtype.
"""

from __future__ import annotations

import socket
from collections.abc import Iterable, Iterator
from datetime import timedelta

import torch
import torch.distributed as dist

Manifest = list[tuple[str, tuple[int, ...], torch.dtype]]
NamedTensor = tuple[str, torch.Tensor]
_ALIGN = 16  # bytes: every dtype's element size divides it, so each slice can be viewed as its dtype
GROUP_TIMEOUT_S = 600.0  # a broadcast that waits this long for a peer fails instead of hanging


def free_address() -> tuple[str, int]:
    """This node's address and a free TCP port for the group's rendezvous store."""
    import ray

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    return ray.util.get_node_ip_address(), port


def open_group(host: str, port: int, rank: int, world: int, backend: str, timeout_s: float = GROUP_TIMEOUT_S):
    """Join the refit group (every member calls this at once; rank 0 hosts the store)."""
    timeout = timedelta(seconds=timeout_s)
    store = dist.PrefixStore("nemo_like_refit", dist.TCPStore(host, port, world, is_master=rank == 0, timeout=timeout))
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, world, timeout)
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, world, opts)
    raise ValueError(f"refit group backend must be 'gloo' or 'nccl', got {backend!r}")


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return torch.Size(shape).numel() * dtype.itemsize


def bucket_plan(manifest: Manifest, max_bytes: int) -> list[list[tuple[int, int]]]:
    """Consecutive buckets of (manifest index, byte offset); a bucket's size is its last offset plus
    that tensor's bytes, at most ``max_bytes`` unless a single tensor is bigger."""
    plan: list[list[tuple[int, int]]] = []
    bucket: list[tuple[int, int]] = []
    end = 0
    for i, (_, shape, dtype) in enumerate(manifest):
        start = -(-end // _ALIGN) * _ALIGN
        n = _nbytes(shape, dtype)
        if bucket and start + n > max_bytes:
            plan.append(bucket)
            bucket, start = [], 0
        bucket.append((i, start))
        end = start + n
    if bucket:
        plan.append(bucket)
    return plan


def _bucket_size(manifest: Manifest, bucket: list[tuple[int, int]]) -> int:
    i, off = bucket[-1]
    return off + _nbytes(manifest[i][1], manifest[i][2])


def _broadcast(pg, buf: torch.Tensor) -> None:
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    pg.broadcast([buf], opts).wait()


def send(pg, tensors: Iterable[NamedTensor], manifest: Manifest, max_bytes: int, device: torch.device) -> tuple[int, int]:
    """Rank 0: broadcast ``tensors`` (in manifest order) bucket by bucket; (bytes, buckets)."""
    it = iter(tensors)
    total = 0
    plan = bucket_plan(manifest, max_bytes)
    for bucket in plan:
        buf = torch.empty(_bucket_size(manifest, bucket), dtype=torch.uint8, device=device)
        for i, off in bucket:
            name, t = next(it)
            want, shape, dtype = manifest[i]
            if name != want or tuple(t.shape) != tuple(shape) or t.dtype != dtype:
                raise RuntimeError(f"refit stream out of step with its manifest at {i}: {name} {tuple(t.shape)} "
                                   f"{t.dtype} where the manifest says {want} {tuple(shape)} {dtype}")
            n = _nbytes(shape, dtype)
            buf[off : off + n] = t.detach().contiguous().reshape(-1).view(torch.uint8).to(device)
            total += n
        _broadcast(pg, buf)
    return total, len(plan)


def receive(pg, manifest: Manifest, max_bytes: int, device: torch.device) -> Iterator[list[NamedTensor]]:
    """Ranks > 0: one list of (name, tensor) per bucket, views into the received buffer (copy them
    before the next bucket arrives)."""
    for bucket in bucket_plan(manifest, max_bytes):
        buf = torch.empty(_bucket_size(manifest, bucket), dtype=torch.uint8, device=device)
        _broadcast(pg, buf)
        out = []
        for i, off in bucket:
            name, shape, dtype = manifest[i]
            out.append((name, buf[off : off + _nbytes(shape, dtype)].view(dtype).reshape(shape)))
        yield out


def check_manifest(manifest: Manifest, params: dict[str, torch.Tensor], who: str) -> None:
    """Every parameter arrives once, under a name and in a shape the receiving model has."""
    seen: set[int] = set()
    for name, shape, _dtype in manifest:
        p = params.get(name)
        if p is None:
            raise ValueError(f"{who}: tensor {name!r} of the policy's manifest is not a parameter of this model; "
                             f"its parameters are e.g. {sorted(params)[:5]}")
        if tuple(p.shape) != tuple(shape):
            raise ValueError(f"{who}: tensor {name!r} has shape {tuple(shape)} in the policy but "
                             f"{tuple(p.shape)} here")
        if id(p) in seen:
            raise ValueError(f"{who}: tensor {name!r} would be sent twice (or under two tied names)")
        seen.add(id(p))
    unique = {id(p): n for n, p in params.items()}
    if missing := sorted(n for i, n in unique.items() if i not in seen):
        raise ValueError(f"{who}: {len(missing)} parameter(s) are not in the policy's manifest: {missing[:10]}")
