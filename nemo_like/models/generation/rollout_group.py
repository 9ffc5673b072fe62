"""Generation apart from training: a data-parallel group of rollout workers and the weight refit.

With ``policy.generation.colocated: false`` the training workers (``Policy``) only train; a
``RolloutGroup`` of ``cluster.generation.num_workers`` actors (each a whole copy of the model, on its
own CPUs/GPU) generates, and after every policy update it is refit:

    metrics = rollouts.update_weights_from(policy, version=step)

Refit protocol (one version at a time):

1. The policy exports its weights as a plain HF model would hold them (``Policy.export_weights``:
   FSDP2 shards gathered, LoRA merged, HF names) in chunks of at most ``policy.generation.refit_chunk_mb``
   MiB of named full tensors.
2. A ``WeightTransport`` moves the chunks into every rollout worker, whose ``update_weights(…, version)``
   loads them strictly (every parameter once, known names, matching shapes) and records ``version``.
3. Every sample a worker generates afterwards carries ``policy_version`` = that version, so an
   asynchronous trainer can tell how stale a rollout is.

The transport is the seam between the two sides, one class each:

* ``ObjectStoreTransport`` ("object_store", implemented): the policy's rank 0 ``ray.put``s each chunk
  as soon as it is gathered; every rollout worker fetches the same refs one chunk at a time. Works
  across processes and nodes, on CPUs and GPUs (tensors travel through host memory). The store holds
  one copy of the weights while a refit is in flight and frees it once every worker has loaded it.
* ``CollectiveTransport`` ("collective", ``collective_refit.py``): a broadcast from the policy's rank 0
  over a process group of its own with the rollout workers: gloo on CPUs (tested), NCCL GPU to GPU
  (the same code with the other backend; not run here: no GPU was available). CUDA IPC handles, for
  engines sharing the trainer's GPU, would be one more subclass.

The engine is the other seam: a vLLM or SGLang engine plugs in as a worker class (one module) with
``generate(data, greedy) -> BatchedDataDict`` (the ``GenerationInterface`` contract plus
``policy_version``), ``update_weights(chunk_refs, version) -> dict`` and ``weights_checksum()``,
passed as ``RolloutGroup(..., worker_cls=...)``. A class with ``max_concurrency`` > 1 gets a threaded
actor, whose calls may run out of order: its generation methods then take ``min_version`` (the
version of the last refit sent; wait until it has loaded), as ``RolloutWorker`` does.
"""

from __future__ import annotations

import abc
import os
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

import ray

from nemo_like.config_sections import GenerationClusterConfig
from nemo_like.distributed.batched_data_dict import BatchedDataDict
from nemo_like.distributed.ray_cluster import RayVirtualCluster
from nemo_like.distributed.worker_group import RayWorkerGroup
from nemo_like.experience.rollouts import run_split_rollout
from nemo_like.experience.streaming import EPISODE_KEYS, with_episodes
from nemo_like.models.generation.interfaces import GenerationInterface
from nemo_like.models.generation.rollout_worker import GENERATE_KEYS, RolloutWorker
from nemo_like.models.policy.interfaces import PolicyConfig

_MIB = 1 << 20


class WeightSource(Protocol):
    """What a refit needs from the training side (``Policy`` is one)."""

    def export_weights(self, chunk_bytes: int) -> tuple[list[ray.ObjectRef], int]: ...


class WeightTransport(abc.ABC):
    """Moves one version of the weights from a ``WeightSource`` into every rollout worker."""

    name: ClassVar[str]

    @abc.abstractmethod
    def push(self, source: WeightSource, workers: RayWorkerGroup, version: int, chunk_bytes: int) -> dict[str, float]:
        """Returns at least ``refit/bytes`` (per receiver) and ``refit/chunks``; raises if any
        worker did not load the whole model."""

    def start(self, source: WeightSource, workers: RayWorkerGroup, version: int, chunk_bytes: int) -> PendingRefit:
        """Begin a refit; ``finish()`` of the result waits for the load, checks it and returns
        ``push``'s metrics. A transport whose source must take part to the end (a broadcast) does
        it all here."""
        metrics = self.push(source, workers, version, chunk_bytes)
        return PendingRefit(metrics, lambda: metrics)


@dataclass
class PendingRefit:
    """A refit under way: ``sent`` (``refit/bytes``, ``refit/chunks``: known once exported) and
    ``finish`` (waits for every worker's load; its metrics, or the error a blocking refit raises)."""

    sent: dict[str, float]
    finish: Callable[[], dict[str, float]]
    loading: list[ray.ObjectRef] = field(default_factory=list)  # the workers' loads, where they run apart


class ObjectStoreTransport(WeightTransport):
    name = "object_store"

    def push(self, source: WeightSource, workers: RayWorkerGroup, version: int, chunk_bytes: int) -> dict[str, float]:
        return self.start(source, workers, version, chunk_bytes).finish()

    def start(self, source: WeightSource, workers: RayWorkerGroup, version: int, chunk_bytes: int) -> PendingRefit:
        # Once the chunks are in the object store the policy may train on: the workers load them
        # when their current call ends (actor calls run one at a time, in the order sent).
        refs, total = source.export_weights(chunk_bytes)
        sent = {"refit/bytes": float(total), "refit/chunks": float(len(refs))}
        # The list goes as one argument: Ray resolves only top-level refs, so each worker gets the
        # refs themselves and fetches the chunks one by one.
        loading = workers.run_all_workers_single_data("update_weights", refs, version)
        held = [refs]  # the last holder: once every worker has loaded, the chunks leave the object store
        left = [len(loading)]

        def loaded(_future) -> None:  # on Ray's callback thread
            left[0] -= 1
            if left[0] == 0:
                held.clear()
        for ref in loading:
            ref.future().add_done_callback(loaded)
        del refs

        def finish() -> dict[str, float]:
            try:
                results = workers.get_all_worker_results(loading)
            finally:
                held.clear()
            if bad := [(i, r["bytes"]) for i, r in enumerate(results) if int(r["bytes"]) != total]:
                raise RuntimeError(f"refit to version {version}: the policy exported {total} bytes but rollout "
                                   f"workers (rank, bytes loaded) {bad} loaded another amount")
            return sent | {"refit/load_seconds_max": max(r["seconds"] for r in results)}
        return PendingRefit(sent, finish, loading)


class CollectiveSource(WeightSource, Protocol):
    """What the collective transport needs beside ``export_weights`` (``Policy`` is one)."""

    def weights_manifest(self) -> list[tuple[str, tuple[int, ...], Any]]: ...
    def refit_address(self) -> tuple[str, int]: ...
    def join_refit_group_async(self, host: str, port: int, world: int, backend: str) -> list[ray.ObjectRef]: ...
    def broadcast_weights(self, chunk_bytes: int) -> dict[str, float]: ...


class CollectiveTransport(WeightTransport):
    """Broadcast from the policy's rank 0 over a process group it shares with the rollout workers
    (gloo on CPUs, NCCL on GPUs; see ``collective_refit``). The group is made at the first push and
    kept; the manifest is checked by every receiver before any tensor moves."""

    name = "collective"

    def __init__(self, backend: str | None = None):
        self.backend = backend  # None: gloo (a RolloutGroup on GPUs passes nccl)
        self._joined: tuple[int, int] | None = None  # (id of the source, id of the workers) in the group

    def push(self, source: CollectiveSource, workers: RayWorkerGroup, version: int, chunk_bytes: int) -> dict[str, float]:
        handles = workers.workers
        if self._joined != (id(source), id(workers)):
            backend = self.backend or "gloo"
            host, port = source.refit_address()
            world = 1 + len(handles)
            refs = source.join_refit_group_async(host, port, world, backend)
            refs += [h.join_refit_group.remote(host, port, 1 + r, world, backend) for r, h in enumerate(handles)]
            ray.get(refs)
            self._joined = (id(source), id(workers))
        manifest = source.weights_manifest()
        try:
            ray.get([h.check_manifest.remote(manifest) for h in handles])  # before anyone waits in a broadcast
            receiving = [h.receive_weights.remote(manifest, chunk_bytes, version) for h in handles]
            sent = source.broadcast_weights(chunk_bytes)
            results = ray.get(receiving)
        except BaseException:
            # A member that failed part way (or a restarted worker without the group) leaves the group
            # unusable: the next refit makes a new one.
            self._joined = None
            raise
        if bad := [(i, r["bytes"]) for i, r in enumerate(results) if r["bytes"] != sent["bytes"]]:
            raise RuntimeError(f"refit to version {version}: the policy sent {sent['bytes']:.0f} bytes but rollout "
                               f"workers (rank, bytes loaded) {bad} loaded another amount")
        return {"refit/bytes": sent["bytes"], "refit/chunks": sent["buckets"],
                "refit/load_seconds_max": max(r["seconds"] for r in results)}


def per_worker_concurrency(step_concurrency: dict[str, int], num_workers: int) -> dict[str, int]:
    """Each of ``num_workers`` streaming workers' share of a task's environment calls in flight (at
    least one: with fewer slots than workers the environment may see one call per worker)."""
    return {task: max(1, c // num_workers) for task, c in step_concurrency.items()}


TRANSPORTS: dict[str, type[WeightTransport]] = {ObjectStoreTransport.name: ObjectStoreTransport,
                                                 CollectiveTransport.name: CollectiveTransport}


@dataclass
class RolloutHandle:
    """A generation in flight (``generate_async``); ``collect`` waits for it. ``ranks[i]`` produced
    ``refs[i]``, the i-th contiguous piece of the batch."""

    refs: list[ray.ObjectRef]
    ranks: list[int]
    size: int


class RolloutGroup(GenerationInterface):
    def __init__(self, policy_config: PolicyConfig, cluster_config: GenerationClusterConfig, *, seed: int = 0,
                 transport: WeightTransport | None = None, worker_cls: type = RolloutWorker,
                 name_prefix: str = "rollout", cluster: Any = None):
        """``cluster``: where the workers run (a RayVirtualCluster or a role's share of a resource pool,
        from ``place_roles``); None reserves a group of ``cluster_config``'s size here."""
        self.cfg = policy_config
        self.worker_cls = worker_cls
        gpus = cluster.gpus_per_worker if cluster is not None else cluster_config.gpus_per_worker
        if transport is None:
            cls = TRANSPORTS[policy_config.generation.refit_transport]
            transport = cls(backend="nccl" if gpus else "gloo") if cls is CollectiveTransport else cls()
        self.transport = transport
        self.cluster = cluster if cluster is not None else RayVirtualCluster(
            cluster_config.num_workers, cpus_per_worker=cluster_config.cpus_per_worker, gpus_per_worker=gpus,
            name=name_prefix)
        env = {"NEMO_LIKE_USE_GPU": "1" if gpus else "0"}
        if os.environ.get("HF_HUB_OFFLINE"):
            env["HF_HUB_OFFLINE"] = os.environ["HF_HUB_OFFLINE"]
        # A threaded actor runs a call beside another (RolloutWorker: batches in flight share its engine).
        self._threaded = int(getattr(worker_cls, "max_concurrency", 1)) > 1
        actor_cls = ray.remote(max_concurrency=int(worker_cls.max_concurrency))(worker_cls) if self._threaded else worker_cls
        try:
            self.workers = RayWorkerGroup(self.cluster, actor_cls, policy_config, seed=seed,
                                          name_prefix=name_prefix, env_vars=env)
        except BaseException:
            self.cluster.shutdown()
            raise
        self.num_workers = self.workers.world_size
        self._on_gpu = bool(gpus)
        self._version = 0
        self._pad_id: int | None = None
        self._pending_refit: PendingRefit | None = None  # update_weights_from(wait=False)
        self._last_load: dict[str, float] = {}  # metrics of the last load finish_refit checked

    @property
    def policy_version(self) -> int:
        """The version of the last refit (0: the weights of ``policy.model_name``): the weights every
        call sent to the workers from now on sees, unless a refit sent without waiting fails to load
        (``finish_refit`` then raises; a worker it left half-loaded refuses to generate)."""
        return self._version

    # ---- generation ---------------------------------------------------------------------------
    def generate_async(self, data: BatchedDataDict, greedy: bool = False) -> RolloutHandle:
        """Start generating ``data``, split into contiguous pieces over the workers (as even as
        possible; a worker with no rows is not called); ``collect`` returns the results in order."""
        keys = {"input_ids", "input_lengths"}
        if missing := keys - set(data):
            raise KeyError(f"RolloutGroup.generate needs keys {sorted(keys)}; missing {sorted(missing)}")
        sub = BatchedDataDict({k: data[k] for k in GENERATE_KEYS if k in data})
        n, w = sub.size, self.num_workers
        refs, ranks, start = [], [], 0
        for rank, handle in enumerate(self.workers.workers):
            end = start + n // w + (1 if rank < n % w else 0)
            if end > start:
                refs.append(handle.generate.remote(sub.slice(start, end), greedy=greedy, **self._after_refit()))
                ranks.append(rank)
            start = end
        return RolloutHandle(refs, ranks, n)

    def collect(self, handle: RolloutHandle) -> BatchedDataDict:
        parts = [self._get(ref, rank, "generate") for ref, rank in zip(handle.refs, handle.ranks)]
        if not parts:
            raise ValueError("RolloutGroup.generate got an empty batch")
        # Workers stop at their own longest sample; the narrower ones are padded as one sample would be.
        out = BatchedDataDict.from_batches(parts, pad_value_dict={"output_ids": self._pad_token_id()})
        assert out.size == handle.size, (out.size, handle.size)
        return out

    def generate(self, data: BatchedDataDict, greedy: bool = False) -> BatchedDataDict:
        return self.collect(self.generate_async(data, greedy=greedy))

    def streams_episodes(self) -> bool:
        g = self.cfg.generation
        return (g.engine == "continuous" and g.stream_episodes
                and "streaming" in getattr(self.worker_cls, "capabilities", frozenset()))

    def generate_episodes(self, batch: BatchedDataDict, envs: dict, **kwargs: Any) -> tuple[BatchedDataDict, dict[str, float]]:
        """Each worker streams its share of the episodes (dealt round-robin, results in batch order).
        A task's ``step_concurrency`` (calls its environment may have in flight) is shared out among
        the workers, each keeping at least one."""
        sub = BatchedDataDict({k: batch[k] for k in EPISODE_KEYS if k in batch})
        kwargs = kwargs | self._after_refit()
        if kwargs.get("step_concurrency"):
            kwargs = kwargs | {"step_concurrency": per_worker_concurrency(kwargs["step_concurrency"], self.num_workers)}

        def on(rank: int):
            handle = self.workers.workers[rank]
            return lambda b: self._get(handle.generate_episodes.remote(b, envs, **kwargs), rank, "generate_episodes")

        out, metrics = run_split_rollout(sub, [on(r) for r in range(self.num_workers)])
        return with_episodes(batch, out), metrics

    def finish_generation(self) -> None:
        if self._on_gpu:
            self._all("release_generation_memory")

    # ---- refit --------------------------------------------------------------------------------
    def update_weights_from(self, policy: WeightSource, version: int, wait: bool = True) -> dict[str, float]:
        """Send ``policy``'s current weights to every worker as ``version``: ``timing/weight_sync``
        (seconds, export and load), ``refit/bytes`` (moved to each worker), ``refit/chunks``.

        ``wait=False`` (the object store transport; others always wait) returns once the weights
        are exported: every call to the workers sent after this one sees them, and a worker busy
        with a rollout loads them while the policy trains on: ``RolloutWorker`` between two steps of
        its engine (later calls wait for them: ``min_version``), a worker class that runs its calls
        one at a time in the order sent (a default Ray actor) when the current call ends. It returns
        this refit's ``refit/bytes`` and ``refit/chunks`` and the previous one's
        ``refit/load_seconds_max``; the load is checked (and its metrics returned) by ``finish_refit``,
        which the next refit and the checks below call first."""
        chunk_bytes = max(1, int(self.cfg.generation.refit_chunk_mb * _MIB))
        self.finish_refit()
        # The load time of the previous refit (checked just now, or by a check since), reported once.
        load = {k: v for k, v in self._last_load.items() if k == "refit/load_seconds_max"}
        self._last_load = {}
        t0 = time.perf_counter()
        pending = self.transport.start(policy, self.workers, int(version), chunk_bytes)
        if wait:
            metrics = pending.finish()
            self._version = int(version)
            return {"timing/weight_sync": time.perf_counter() - t0, **metrics}
        self._version = int(version)
        self._pending_refit = pending
        return {"timing/weight_sync": time.perf_counter() - t0, **pending.sent, **load}

    def finish_refit(self) -> dict[str, float]:
        """Wait for a refit sent with ``wait=False`` to load (raising as a blocking one would);
        its ``refit/`` metrics, or {} if none is pending."""
        pending, self._pending_refit = self._pending_refit, None
        if pending is None:
            return {}
        self._last_load = pending.finish()
        return self._last_load

    def weights_checksums(self) -> list[str]:
        self.finish_refit()
        return self._all("weights_checksum")

    def worker_versions(self) -> list[int]:
        self.finish_refit()
        return self._all("policy_version")

    def shutdown(self, refit_timeout_s: float = 5.0) -> None:
        """Stop the workers; a refit still loading is given ``refit_timeout_s`` to end (it waits
        behind a worker's current call), then dropped with a warning."""
        try:
            pending, self._pending_refit = self._pending_refit, None
            if pending is not None:
                done, _ = ray.wait(pending.loading, num_returns=len(pending.loading), timeout=refit_timeout_s)
                if len(done) < len(pending.loading):
                    warnings.warn(f"{self.workers.name_prefix}: the last refit was still loading at shutdown",
                                  stacklevel=2)
                else:
                    pending.finish()
        except Exception as e:  # noqa: BLE001 - the workers go anyway; say what their last load did
            warnings.warn(f"the last refit of {self.workers.name_prefix} failed: {e}", stacklevel=2)
        finally:
            try:
                self.workers.shutdown()
            finally:
                self.cluster.shutdown()

    # ---- helpers ------------------------------------------------------------------------------
    def _after_refit(self) -> dict[str, int]:
        """What a threaded worker's call needs to run on the weights of the last refit sent."""
        return {"min_version": self._version} if self._threaded else {}

    def _all(self, method: str, *args: Any) -> list[Any]:
        return self.workers.get_all_worker_results(self.workers.run_all_workers_single_data(method, *args))

    def _pad_token_id(self) -> int:
        if self._pad_id is None:
            self._pad_id = self._all("pad_token_id")[0]
        return self._pad_id

    def _get(self, ref: ray.ObjectRef, rank: int, method: str) -> Any:
        try:
            return ray.get(ref)
        except ray.exceptions.RayError as e:
            raise RuntimeError(f"{self.workers.name_prefix} rank {rank} failed in {method!r}: "
                               f"{type(e).__name__}: {e}") from e
