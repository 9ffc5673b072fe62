"""RayWorkerGroup: one Ray actor per placement-group bundle, wired up for torch.distributed.

Each actor gets the torchrun-style env vars (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
MASTER_ADDR, MASTER_PORT) so the worker class can simply call
``torch.distributed.init_process_group(backend)`` with the default ``env://`` init, plus thread
limits (OMP_NUM_THREADS, NEMO_LIKE_NUM_THREADS) sized to the CPUs reserved for it: without them
every worker would spin up one thread per core and N workers would oversubscribe the machine N-fold.

Device note: with GPUs, Ray narrows CUDA_VISIBLE_DEVICES per actor, so a worker must use
``cuda:0`` / ``torch.cuda.current_device()``, not LOCAL_RANK, to pick its GPU.
"""

from __future__ import annotations

import collections
import logging
import re
import socket
import time
import uuid
from typing import Any

import ray
import torch
from ray.actor import ActorClass, ActorHandle
from ray.util.scheduling_strategies import (
    NodeAffinitySchedulingStrategy,
    PlacementGroupSchedulingStrategy,
)

from nemo_like.distributed import stall
from nemo_like.distributed.balance import balance_over_shards
from nemo_like.distributed.batched_data_dict import BatchedDataDict
from nemo_like.distributed.ray_cluster import RayVirtualCluster
from nemo_like.distributed.worker_registry import record_worker, started_worker

__all__ = ["RayWorkerGroup"]

logger = logging.getLogger(__name__)

# Set by the group; a caller's env_vars may not override them or ranks would disagree.
_RESERVED_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
# Remember at most this many (ref -> rank, method) entries; refs a caller never fetched must not
# make the table grow without bound.
_MAX_TRACKED_REFS = 100_000
# Ray colours the remote traceback header; escape codes are noise in logs and exception messages.
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _pick_free_port() -> int:
    """A port that was free a moment ago.

    The socket is closed before torch binds the port, so another process could grab it in between;
    the window is a few seconds at most and a collision surfaces as an EADDRINUSE from
    init_process_group on rank 0, not as a silent error.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


@ray.remote(num_cpus=0)
def _node_ip_and_free_port() -> tuple[str, int]:
    return ray.util.get_node_ip_address(), _pick_free_port()


def _master_addr_port(node_ids: list[str]) -> tuple[str, int]:
    """Rendezvous address for rank 0: loopback if the whole group is on the driver's node
    (no dependence on how the host's interfaces are configured), else rank 0's node IP with a
    port picked on that node."""
    driver_node = ray.get_runtime_context().get_node_id()
    if all(n == driver_node for n in node_ids):
        return "127.0.0.1", _pick_free_port()
    strategy = NodeAffinitySchedulingStrategy(node_id=node_ids[0], soft=False)
    ip, port = ray.get(_node_ip_and_free_port.options(scheduling_strategy=strategy).remote())
    return ip, port


class RayWorkerGroup:
    """``cluster.num_workers`` actors of ``worker_cls``; actor i runs in bundle ``cluster.bundle_index(i)``
    with RANK=i. ``cluster`` is a :class:`RayVirtualCluster` (bundle i) or a role's share of a resource
    pool (``nemo_like.distributed.resource_pools.RolePlacement``, ranks of a node in one bundle).

    ``*args``/``**kwargs`` go to every worker's constructor. The constructor returns once every
    worker's ``__init__`` finished, so construction errors surface here, naming the rank.
    """

    def __init__(
        self,
        cluster: RayVirtualCluster,
        worker_cls: type | ActorClass,
        *args: Any,
        name_prefix: str = "worker",
        env_vars: dict[str, str] | None = None,
        startup_timeout_s: float | None = 900.0,
        **kwargs: Any,
    ) -> None:
        env_vars = {str(k): str(v) for k, v in (env_vars or {}).items()}
        clash = sorted(set(env_vars) & set(_RESERVED_ENV))
        if clash:
            raise ValueError(f"env_vars may not set {clash}: RayWorkerGroup sets them for each rank")
        self.cluster = cluster
        self.name_prefix = name_prefix
        self._worker_cls = worker_cls.__ray_metadata__.modified_class if isinstance(worker_cls, ActorClass) else worker_cls
        remote_cls = worker_cls if isinstance(worker_cls, ActorClass) else ray.remote(worker_cls)

        holder = getattr(cluster, "_nemo_like_holder", None)
        if holder is not None and not holder._shut_down and (cluster.cpus_per_worker or cluster.gpus_per_worker):
            # A second group would wait forever for resources the first one holds.
            raise RuntimeError(
                f"cannot start worker group {name_prefix!r}: the cluster's bundles are held by worker group "
                f"{holder.name_prefix!r}; shut that one down first (e.g. policy.shutdown()) or use another "
                "RayVirtualCluster")
        pg = cluster.placement_group
        node_ids = cluster.bundle_node_ids()
        master_addr, master_port = _master_addr_port(node_ids)
        num_threads = str(cluster.threads_per_worker)
        world_size = cluster.num_workers
        group_id = uuid.uuid4().hex[:8]
        self._workers: list[ActorHandle] = []
        for rank in range(world_size):
            same_node = [i for i, n in enumerate(node_ids) if n == node_ids[rank]]
            worker_env = {
                "OMP_NUM_THREADS": num_threads,
                "NEMO_LIKE_NUM_THREADS": num_threads,
                **env_vars,
                "RANK": str(rank),
                "WORLD_SIZE": str(world_size),
                "LOCAL_RANK": str(same_node.index(rank)),
                "LOCAL_WORLD_SIZE": str(len(same_node)),
                "MASTER_ADDR": master_addr,
                "MASTER_PORT": str(master_port),
            }
            actor = remote_cls.options(
                num_cpus=cluster.cpus_per_worker,
                num_gpus=cluster.gpus_per_worker,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=pg, placement_group_bundle_index=cluster.bundle_index(rank)
                ),
                runtime_env={"env_vars": worker_env},
                # Unique per group so two groups with the same prefix never collide; shows up in
                # `ray list actors` to tell the ranks apart.
                name=f"{name_prefix}-{rank}-{group_id}",
            ).remote(*args, **kwargs)
            self._workers.append(actor)
            record_worker(actor._actor_id.hex(), self._worker_cls.__name__, f"{name_prefix}-{rank}-{group_id}",
                          str(node_ids[rank] or ""))
        self._ref_info: collections.OrderedDict[str, tuple[int, str]] = collections.OrderedDict()
        self._shut_down = False
        logger.info(
            "%s: %d workers of %s, MASTER_ADDR=%s MASTER_PORT=%d", name_prefix, world_size,
            self._worker_cls.__name__, master_addr, master_port,
        )
        cluster._nemo_like_holder = self
        try:
            self.get_all_worker_results(
                [self._track(w.__ray_ready__.remote(), rank, "__init__") for rank, w in enumerate(self._workers)],
                timeout=startup_timeout_s,
            )
        except TimeoutError as e:
            self.shutdown(timeout=0)
            raise TimeoutError(
                f"{e}. Workers that never start are usually waiting for resources: check that Ray has "
                f"{cluster.cpus_per_worker} CPU(s) and {cluster.gpus_per_worker} GPU(s) free per worker "
                "(`ray status`)") from None
        except BaseException:
            self.shutdown(timeout=0)
            raise

    # --- introspection ------------------------------------------------------------------------
    @property
    def workers(self) -> list[ActorHandle]:
        return list(self._workers)

    @property
    def world_size(self) -> int:
        return self.cluster.num_workers

    # --- dispatch -----------------------------------------------------------------------------
    def _track(self, ref: ray.ObjectRef, rank: int, method: str) -> ray.ObjectRef:
        # Keyed by hex, not by the ref itself: holding the ref would pin its result in the store.
        self._ref_info[ref.hex()] = (rank, method)
        while len(self._ref_info) > _MAX_TRACKED_REFS:
            self._ref_info.popitem(last=False)
        return ref

    def has_method(self, method: str) -> bool:
        """Whether the workers' class has ``method`` (a protocol's optional part)."""
        return callable(getattr(self._worker_cls, method, None))

    def _check_method(self, method: str) -> None:
        if self._shut_down:
            raise RuntimeError(f"RayWorkerGroup {self.name_prefix!r} has been shut down")
        if not callable(getattr(self._worker_cls, method, None)):
            public = sorted(m for m in dir(self._worker_cls) if not m.startswith("_") and callable(getattr(self._worker_cls, m)))
            raise AttributeError(f"{self._worker_cls.__name__} has no method {method!r}; methods: {public}")

    def run_all_workers_single_data(self, method: str, *args: Any, **kwargs: Any) -> list[ray.ObjectRef]:
        """Call ``method(*args, **kwargs)`` on every worker (same arguments); one ref per rank."""
        self._check_method(method)
        return [
            self._track(getattr(w, method).remote(*args, **kwargs), rank, method)
            for rank, w in enumerate(self._workers)
        ]

    def run_all_workers_sharded_data(
        self, method: str, data: BatchedDataDict, *, batch_size: int | None = None, **kwargs: Any
    ) -> list[ray.ObjectRef]:
        """Call ``method(data=shard_i, **kwargs)`` on worker i.

        Shards come from ``data.shard_by_batch_size(world_size, batch_size=batch_size)``: with
        ``batch_size`` each global batch of that size is split evenly across the workers.
        """
        self._check_method(method)
        if not isinstance(data, BatchedDataDict):
            raise TypeError(f"data must be a BatchedDataDict, got {type(data).__name__}")
        shards = data.shard_by_batch_size(self.world_size, batch_size=batch_size)
        return [
            self._track(getattr(w, method).remote(data=shard, **kwargs), rank, method)
            for rank, (w, shard) in enumerate(zip(self._workers, shards, strict=True))
        ]

    def run_rows(self, method: str, data: BatchedDataDict, *, balance: bool = False, balance_unit: int | None = None,
                 **kwargs: Any) -> BatchedDataDict:
        """``method`` over ``data``'s rows split across the workers, the per-row results gathered in
        ``data``'s order. Every worker gets the same number of rows (FSDP's collectives run in lock
        step): a batch that does not divide is padded with copies of row 0, whose results are dropped.
        ``balance``: rows reordered first so that each worker gets about the same tokens
        (``balance_over_shards``, ``balance_unit`` rows kept together; results put back in order)."""
        n = data.size
        pad = (-n) % self.world_size
        perm = None
        if pad:
            data = BatchedDataDict.from_batches([data, data.select_indices([0] * pad)])
        elif balance:
            data, perm = balance_over_shards(data, self.world_size, unit=balance_unit)
        out = BatchedDataDict.from_batches(self.get_all_worker_results(
            self.run_all_workers_sharded_data(method, data, **kwargs)))
        if perm is not None:
            out = out.select_indices(torch.argsort(perm))
        return out.slice(0, n) if pad else out

    def get_all_worker_results(self, refs: list[ray.ObjectRef], timeout: float | None = None) -> list[Any]:
        """Results of ``refs`` in order.

        Waits for whichever finishes first rather than in rank order: when one rank fails, the
        others are often stuck in a collective waiting for it, and a rank-ordered ``ray.get`` would
        hang on them instead of reporting the failure. Raises RuntimeError naming the rank and
        method (original error text included), or TimeoutError naming the ranks still running.
        """
        refs = list(refs)
        results: dict[int, Any] = {}
        pending = {ref.hex(): i for i, ref in enumerate(refs)}
        remaining = list(refs)
        deadline = None if timeout is None else time.monotonic() + timeout
        with stall.waiting_for(lambda: self._waiting_text(remaining, pending)):
            while remaining:
                wait_s = None if deadline is None else max(0.0, deadline - time.monotonic())
                if stall.active() is not None:  # a stall watch runs: look up between short waits
                    wait_s = 1.0 if wait_s is None else min(wait_s, 1.0)
                done, remaining = ray.wait(remaining, num_returns=1, timeout=wait_s)
                if done:
                    self._take(done[0], pending[done[0].hex()], results)
                    continue
                stall.check()
                if deadline is not None and time.monotonic() >= deadline:
                    ranks = [self._describe(r, pending[r.hex()])[0] for r in remaining]
                    raise TimeoutError(f"{self.name_prefix}: ranks {ranks} did not finish within {timeout}s")
        return [results[i] for i in range(len(refs))]

    def _waiting_text(self, remaining: list[ray.ObjectRef], pending: dict[str, int]) -> str:
        """"policy rank 1 (PolicyWorker policy-1-ab12cd34) in 'train'" for each rank still running."""
        out = []
        for r in list(remaining):
            rank, method = self._describe(r, pending[r.hex()])
            known = (started_worker(self._workers[rank]._actor_id.hex())
                     if 0 <= rank < len(self._workers) else None)
            who = f" ({known.class_name} {known.name})" if known is not None else ""
            out.append(f"{self.name_prefix} rank {rank}{who} in {method!r}")
        return ", ".join(out)

    def _take(self, ref: ray.ObjectRef, idx: int, results: dict[int, Any]) -> None:
        """A finished ref's result into ``results``; RuntimeError naming the rank and method if it failed."""
        try:
            results[idx] = ray.get(ref)
        except ray.exceptions.RayError as e:
            rank, method = self._describe(ref, idx)
            kind = "died" if isinstance(e, ray.exceptions.RayActorError) else "raised"
            raise RuntimeError(
                f"{self.name_prefix} rank {rank} {kind} in {method!r}: {type(e).__name__}: "
                f"{_ANSI.sub('', str(e))}"
            ) from e
        self._ref_info.pop(ref.hex(), None)

    def _describe(self, ref: ray.ObjectRef, idx: int) -> tuple[int, str]:
        # Refs not created by this group (e.g. built by hand): fall back to their position.
        return self._ref_info.get(ref.hex(), (idx, "<unknown method>"))

    # --- teardown -----------------------------------------------------------------------------
    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop all workers (idempotent).

        If the worker class defines ``shutdown()``, it is called on every worker first (best
        effort, bounded by ``timeout`` seconds in total) so workers can flush files or destroy their
        process group; then every actor is killed, which releases its bundle's resources.
        """
        if self._shut_down:
            return
        self._shut_down = True
        workers, self._workers = self._workers, []
        if callable(getattr(self._worker_cls, "shutdown", None)) and timeout > 0:
            refs = []
            for w in workers:
                try:
                    refs.append(w.shutdown.remote())
                except Exception as e:  # noqa: BLE001 - best effort by design
                    logger.warning("%s: could not call shutdown(): %s", self.name_prefix, e)
            try:
                ready, not_ready = ray.wait(refs, num_returns=len(refs), timeout=timeout)
                for ref in ready:
                    try:
                        ray.get(ref)
                    except ray.exceptions.RayError as e:
                        logger.warning("%s: worker shutdown() failed: %s", self.name_prefix, e)
                if not_ready:
                    logger.warning("%s: %d worker shutdown() calls timed out", self.name_prefix, len(not_ready))
            except Exception as e:  # noqa: BLE001
                logger.warning("%s: waiting for worker shutdown() failed: %s", self.name_prefix, e)
        for w in workers:
            try:
                ray.kill(w, no_restart=True)
            except Exception as e:  # noqa: BLE001 - already dead, or Ray already down
                logger.debug("%s: ray.kill failed: %s", self.name_prefix, e)
        self._ref_info.clear()

