"""TrainingWorkerBase's collectives on two real gloo processes: replicas start from rank 0's random
parts and average their gradients, including parameters that only some ranks used."""

from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from nemo_like.models.worker_base import TrainingWorkerBase


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(3, 2)
        self.b = nn.Linear(3, 2)  # used by rank 1 only
        self.unused = nn.Linear(3, 2)  # used by no rank


class _Replica(TrainingWorkerBase):
    def __init__(self):
        self._setup_process(1)
        torch.manual_seed(100 + self.rank)  # different random init per process, as a new head would be
        self.model = _Net()
        self.sharded = False
        self._broadcast_from_rank0(self.model, [n for n, _ in self.model.named_parameters()])


def _run(rank: int, port: int, out: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    w = _Replica()
    x = torch.full((1, 3), float(rank + 1))
    loss = w.model.a(x).sum() * (rank + 1)
    if rank == 1:
        loss = loss + w.model.b(x).sum()
    loss.backward()
    norm = w._clip_grads(None)
    grads = {n: (p.grad.clone() if p.grad is not None else None) for n, p in w.model.named_parameters()}
    torch.save({"params": {n: p.detach().clone() for n, p in w.model.named_parameters()}, "grads": grads,
                "norm": norm, "count": w._synced_count(3 + rank), "replicas": w.replicas}, f"{out}/rank{rank}.pt")
    dist.barrier()
    w.shutdown()


def test_replicas_share_rank0s_init_and_average_gradients(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_run, args=(port, str(tmp_path)), nprocs=2, join=True)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1))
    assert r0["replicas"] and r0["count"] == r1["count"] == 4  # the larger pass count
    torch.manual_seed(100)
    want = _Net()  # rank 0's init
    for n, p in want.named_parameters():
        assert torch.equal(r0["params"][n], p.detach()) and torch.equal(r1["params"][n], p.detach()), n
    # d/dW of sum(a(x)) * k is k * x per output row: rank 0 (x = 1, k = 1) and rank 1 (x = 2, k = 2).
    assert torch.allclose(r0["grads"]["a.weight"], torch.full((2, 3), (1.0 + 4.0) / 2))
    assert torch.allclose(r0["grads"]["a.bias"], torch.full((2,), (1.0 + 2.0) / 2))
    # b: a gradient on rank 1 only; rank 0 joins with zeros, so both hold half of rank 1's.
    assert torch.allclose(r0["grads"]["b.weight"], torch.full((2, 3), 1.0))
    assert r0["grads"]["unused.weight"] is None and r1["grads"]["unused.weight"] is None  # AdamW skips it
    for n in r0["grads"]:
        g0, g1 = r0["grads"][n], r1["grads"][n]
        assert (g0 is None and g1 is None) or torch.equal(g0, g1), n
    assert r0["norm"] == r1["norm"] > 0


def test_optimizer_is_fused_on_plain_tensors_and_takes_adamws_step():
    from types import SimpleNamespace

    from nemo_like.models.worker_base import fused_adamw_supported, make_optimizer

    torch.manual_seed(0)
    net, ref = nn.Linear(8, 4), nn.Linear(8, 4)
    ref.load_state_dict(net.state_dict())
    o = SimpleNamespace(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    opt, sched = make_optimizer(net.parameters(), o, SimpleNamespace(lr_factor=lambda s: 1.0))
    assert opt.defaults["fused"] is True
    textbook = torch.optim.AdamW(ref.parameters(), lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1,
                                 foreach=False)
    x = torch.randn(16, 8)
    for _ in range(3):
        for m, op in ((net, opt), (ref, textbook)):
            op.zero_grad()
            (m(x) ** 2).mean().backward()
            op.step()
    for a, b in zip(net.parameters(), ref.parameters()):
        assert torch.allclose(a, b, atol=1e-6), (a - b).abs().max()
    # A resumed run loads the state it saved into a fresh fused optimizer.
    again, _ = make_optimizer(net.parameters(), o, SimpleNamespace(lr_factor=lambda s: 1.0))
    again.load_state_dict(opt.state_dict())
    assert float(again.state[next(net.parameters())]["step"]) == 3.0
    # Not for what the fused kernel cannot take: no parameters, or integer tensors.
    assert not fused_adamw_supported([])
    assert not fused_adamw_supported([torch.zeros(2, dtype=torch.long)])
