"""Starting/connecting Ray and reserving resources for a group of workers.

``init_ray`` either connects to an existing cluster (``address`` or env ``RAY_ADDRESS``) or starts a
small local one, and reports whether *it* started it so that only the starter shuts it down.
``RayVirtualCluster`` reserves one placement-group bundle per worker so a whole worker group is
scheduled atomically (all ranks or none): a half-scheduled torch.distributed group would hang in
``init_process_group`` forever instead of failing.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import tempfile
import time
from typing import Any

# Under `uv run`, Ray (>= 2.43) by default starts every worker through `uv run` and ships the cwd as
# a zipped working_dir. Workers here already use the driver's venv interpreter, so that only costs
# seconds per worker, may re-sync the env, and makes relative paths in workers (checkpoints, logs)
# land in an extracted copy of the repo. Opt out unless the user chose otherwise. Must be set
# before Ray reads its constants, hence before `import ray`; init_ray re-applies it in case Ray was
# imported first.
os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")

import ray  # noqa: E402
from ray._private import ray_constants as _ray_constants  # noqa: E402
from ray.util.placement_group import (  # noqa: E402
    PlacementGroup,
    placement_group,
    remove_placement_group,
)

from nemo_like.distributed.stall import stack_env  # noqa: E402

__all__ = ["init_ray", "shutdown_ray_if_started", "RayVirtualCluster"]

logger = logging.getLogger(__name__)

# Ray puts Unix sockets under <temp_dir>/session_<date>_<time>_<us>_<pid>/sockets/<name>; the
# session part is ~70 bytes and AF_UNIX paths are capped at 107 bytes, so a long temp dir (e.g.
# pytest's tmp_path) makes ray.init fail with an obscure socket error. Reject it up front.
_MAX_TEMP_DIR_LEN = 35

# Temp dirs this process created for clusters it started; removed by shutdown_ray_if_started.
_created_temp_dirs: list[str] = []


def _user_code_paths() -> list[str]:
    """Driver sys.path entries that hold user code, i.e. not the interpreter's own dirs.

    Ray only gives workers the driver's cwd and script dir, so a worker class defined in a module
    that was importable on the driver through another path (pytest's rootdir insertion, a notebook's
    sys.path.append) could not be unpickled on the worker. Passing these dirs via PYTHONPATH fixes it.
    """
    prefixes = {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)}
    paths: list[str] = []
    for p in sys.path:
        if not p or not os.path.isdir(p):
            continue
        real = os.path.realpath(p)
        if any(real == pre or real.startswith(pre + os.sep) for pre in prefixes):
            continue
        if real not in paths:
            paths.append(real)
    return paths


def _runtime_env() -> dict[str, Any]:
    existing = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    paths = _user_code_paths() + [p for p in existing if p not in _user_code_paths()]
    return {"env_vars": {"PYTHONPATH": os.pathsep.join(paths)}} if paths else {}


# A worker's output reaches the driver line by line through Ray: a progress bar there (transformers'
# "Loading weights") arrives as its redraws run together on one line, in a terminal or a log. Set in the
# environment the local cluster's processes start with (workers inherit it), not in a runtime_env: one
# there makes every worker go through Ray's runtime-env set-up (measured twice as slow to start actors).
WORKER_ENV = {"HF_HUB_DISABLE_PROGRESS_BARS": "1"}


def init_ray(
    address: str | None = None,
    num_cpus: int | None = None,
    temp_dir: str | None = None,
    **ray_init_kwargs: Any,
) -> bool:
    """Make sure Ray is initialised in this process.

    - Ray already initialised: nothing happens; returns False.
    - ``address`` (or env ``RAY_ADDRESS``) given: connect to that cluster (``num_cpus`` and
      ``temp_dir`` belong to the cluster, so they are ignored with a warning); returns False.
    - Otherwise start a local cluster with ``num_cpus`` CPUs (None: all cores), no dashboard, token
      auth and usage stats off unless the env says otherwise, temp dir from ``temp_dir``, env
      ``NEMO_LIKE_RAY_TMPDIR`` or a fresh short dir under /tmp; returns True.

    Pass the result to :func:`shutdown_ray_if_started` so only what was started here is freed.
    """
    if ray.is_initialized():
        logger.info("Ray is already initialised; reusing it")
        return False
    # Token auth would write ~/.ray/auth_token and usage stats would try the network; neither is
    # wanted for a local training run. setdefault keeps any explicit user choice.
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if hasattr(_ray_constants, "RAY_ENABLE_UV_RUN_RUNTIME_ENV"):
        _ray_constants.RAY_ENABLE_UV_RUN_RUNTIME_ENV = os.environ["RAY_ENABLE_UV_RUN_RUNTIME_ENV"].lower() in (
            "1", "true", "yes",
        )
    runtime_env = _runtime_env()
    address = address or os.environ.get("RAY_ADDRESS") or None
    if address:
        if num_cpus is not None or temp_dir is not None:
            logger.warning("init_ray: connecting to %s, so num_cpus/temp_dir are ignored", address)
        ray.init(address=address, runtime_env=runtime_env or None, **ray_init_kwargs)
        return False

    created = False
    if temp_dir is None:
        temp_dir = os.environ.get("NEMO_LIKE_RAY_TMPDIR") or None
    if temp_dir is None:
        temp_dir = tempfile.mkdtemp(prefix="nlray_", dir="/tmp")
        created = True
    temp_dir = os.path.abspath(temp_dir)
    if len(temp_dir) > _MAX_TEMP_DIR_LEN:
        raise ValueError(
            f"Ray temp dir {temp_dir!r} is {len(temp_dir)} characters; use at most {_MAX_TEMP_DIR_LEN} "
            "(Ray's Unix socket paths under it are limited to 107 bytes), e.g. a dir under /tmp"
        )
    if num_cpus is not None and (isinstance(num_cpus, bool) or not isinstance(num_cpus, int) or num_cpus < 1):
        raise ValueError(f"num_cpus must be a positive int or None, got {num_cpus!r}")
    os.makedirs(temp_dir, exist_ok=True)
    # RAY_ADDRESS is unset here, but a stale /tmp/ray/ray_current_cluster must not make
    # ray.init() attach to somebody else's cluster: address="local" always starts a new one.
    ray_init_kwargs.setdefault("include_dashboard", False)
    worker_env = WORKER_ENV | stack_env(temp_dir)  # stack dumps on SIGUSR1 (distributed/stall.py)
    before = {k: os.environ.get(k) for k in worker_env}
    os.environ.update(worker_env)
    try:
        ray.init(
            address="local",
            num_cpus=num_cpus,
            _temp_dir=temp_dir,
            runtime_env=runtime_env or None,
            **ray_init_kwargs,
        )
    finally:  # the driver keeps its own (a notebook's download bars)
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    if created:
        _created_temp_dirs.append(temp_dir)
    return True


def shutdown_ray_if_started(started: bool) -> None:
    """Shut Ray down only if ``started`` (the value :func:`init_ray` returned) is True."""
    if not started:
        return
    if ray.is_initialized():
        ray.shutdown()
    while _created_temp_dirs:
        shutil.rmtree(_created_temp_dirs.pop(), ignore_errors=True)


class RayVirtualCluster:
    """One placement group with ``num_workers`` bundles, one per worker (rank i -> bundle i).

    Strategy PACK keeps workers on as few nodes as possible (cheap collectives) but still lets a
    group spill over nodes when one is too small.
    """

    def __init__(
        self,
        num_workers: int,
        cpus_per_worker: float = 1,
        gpus_per_worker: float = 0,
        name: str = "",
        ready_timeout_s: float = 60.0,
        fail_fast_if_infeasible: bool = True,
    ) -> None:
        if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 1:
            raise ValueError(f"num_workers must be a positive int, got {num_workers!r}")
        if cpus_per_worker < 0 or gpus_per_worker < 0 or (cpus_per_worker == 0 and gpus_per_worker == 0):
            raise ValueError(
                f"each worker needs a positive resource: cpus_per_worker={cpus_per_worker}, "
                f"gpus_per_worker={gpus_per_worker}"
            )
        if not ray.is_initialized():
            raise RuntimeError("Ray is not initialised; call nemo_like.distributed.init_ray() first")
        self.num_workers = num_workers
        self.cpus_per_worker = cpus_per_worker
        self.gpus_per_worker = gpus_per_worker
        self.name = name
        bundle: dict[str, float] = {}
        if cpus_per_worker > 0:
            bundle["CPU"] = float(cpus_per_worker)
        if gpus_per_worker > 0:
            bundle["GPU"] = float(gpus_per_worker)
        self.bundle = bundle
        asked = {k: v * num_workers for k, v in bundle.items()}
        label = f" {name!r}" if name else ""
        if fail_fast_if_infeasible:
            # A request larger than the whole cluster would otherwise sit pending for the full
            # timeout. Clusters with an autoscaler can grow, so they pass fail_fast_if_infeasible=False.
            total = ray.cluster_resources()
            short = {k: v for k, v in asked.items() if total.get(k, 0.0) < v}
            if short:
                raise RuntimeError(
                    f"RayVirtualCluster{label}: asked for {num_workers} worker(s) x {bundle} (total "
                    f"{asked}) but the whole Ray cluster has only {_fmt_resources(total)}. Lower the "
                    "number of workers or the CPUs/GPUs per worker, or start Ray with more resources."
                )
        self._placement_group: PlacementGroup | None = placement_group(
            [dict(bundle) for _ in range(num_workers)], strategy="PACK", name=name
        )
        start = time.monotonic()
        try:
            ready = self._placement_group.wait(timeout_seconds=ready_timeout_s)
        except BaseException:
            self.shutdown()
            raise
        if not ready:
            # A pending placement group would grab the resources the moment they appear and
            # block later groups, so do not leave it behind.
            self.shutdown()
            raise RuntimeError(
                f"RayVirtualCluster{label}: could not reserve {num_workers} "
                f"worker(s) x {bundle} (total {asked}) within {ready_timeout_s:g}s. Cluster resources: "
                f"{_fmt_resources(ray.cluster_resources())}; available now: "
                f"{_fmt_resources(ray.available_resources())}. Lower the number of workers or the "
                "CPUs/GPUs per worker, or free resources held by other placement groups/actors."
            )
        logger.info(
            "placement group %s ready in %.2fs: %d x %s", name or "<unnamed>", time.monotonic() - start,
            num_workers, bundle,
        )

    @property
    def placement_group(self) -> PlacementGroup:
        if self._placement_group is None:
            raise RuntimeError("RayVirtualCluster has been shut down")
        return self._placement_group

    @property
    def threads_per_worker(self) -> int:
        """Torch/OpenMP threads of a worker: the CPUs it reserves (at least one)."""
        return max(1, int(self.cpus_per_worker))

    def bundle_index(self, rank: int) -> int:
        """The bundle rank ``rank`` runs in (its own: rank i -> bundle i)."""
        return rank

    def bundle_node_ids(self) -> list[str]:
        """Node id hosting each bundle, in bundle (= rank) order."""
        table = ray.util.placement_group_table(self.placement_group)
        mapping = table.get("bundles_to_node_id", {})
        return [mapping[i] for i in range(self.num_workers)]

    def shutdown(self) -> None:
        """Remove the placement group (idempotent). Kill the worker group's actors first."""
        pg, self._placement_group = self._placement_group, None
        remove_placement_group_quietly(pg, self.name)


def remove_placement_group_quietly(pg: PlacementGroup | None, name: str) -> None:
    """Free ``pg`` (None: nothing to do); a Ray that is already gone has nothing left to free."""
    if pg is not None:
        try:
            remove_placement_group(pg)
        except Exception as e:  # noqa: BLE001 - teardown goes on
            logger.warning("removing placement group %s failed: %s", name or "<unnamed>", e)


def custom_resource_names(res: dict[str, float]) -> list[str]:
    """The custom resources of a node or cluster (the names a cluster gives its nodes), sorted: not
    CPU/GPU, memory in bytes, per-node markers or per-placement-group bookkeeping."""
    return sorted(k for k in res if k not in ("CPU", "GPU", "memory", "object_store_memory")
                  and not k.startswith(("node:", "accelerator_type")) and "_group_" not in k)


def _fmt_resources(res: dict[str, float]) -> str:
    """CPU/GPU/custom resources only: memory in bytes and per-node markers are noise here."""
    keys = [k for k in ("CPU", "GPU") if k in res] + custom_resource_names(res)
    return "{" + ", ".join(f"{k}: {res[k]:g}" for k in keys) + "}"
