"""Roles on resource pools: the placement groups of a run, and which bundles each worker group uses.

Without ``cluster.resource_pools`` each role (policy, generation, critic, reward_model) keeps a
placement group of its own, a :class:`RayVirtualCluster` sized by its section (``num_workers`` x
``cpus_per_worker``) that Ray packs where it fits. With pools, each pool is one placement group of
``nodes`` x ``slots`` bundles (a slot per GPU; one per node on a CPU pool) whose nodes are distinct Ray
nodes, and each role named to it gets a :class:`RolePlacement`: a view of the pool that tells the
role's :class:`RayWorkerGroup` which bundle each rank runs in and what it reserves there.

Roles on one pool are colocated and time-sliced: the GRPO step runs one phase at a time, so a rank of
each role sits in the same bundle, each reserving 1/k of it (k roles) so that Ray admits all of them,
and each sets its torch threads to the whole share of the bundle its rank would have alone. On a GPU
pool every worker of a role has a bundle with one GPU of its own, which the roles on the pool share.
"""

from __future__ import annotations

from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group

from nemo_like.config_sections import ClusterConfig, ResourcePoolConfig
from nemo_like.distributed.ray_cluster import (
    RayVirtualCluster,
    custom_resource_names,
    remove_placement_group_quietly,
)

__all__ = ["PLAN_HEADER", "Placement", "PlacementError", "ResourcePool", "RolePlacement", "RolePlan", "check_pools_fit",
           "place_roles", "refuse_roles_not_placed"]

# The first line of the printed plan, the same for every trainer (GRPO/PPO, reward model, gym agents).
PLAN_HEADER = "[nemo_like] placement (role -> pool -> nodes):"

# Per bundle, of a pool's node resource: a sliver, so that pools sharing named nodes never exhaust it.
_NODE_RESOURCE_SHARE = 0.001


class PlacementError(ValueError):
    """A pool the cluster cannot hold; the message names the key."""


class ResourcePool:
    """One pool's placement group: ``nodes`` x ``slots`` bundles, the slots of a node on one Ray node."""

    def __init__(self, name: str, cfg: ResourcePoolConfig, ready_timeout_s: float = 60.0) -> None:
        self.name, self.cfg = name, cfg
        self.slots = max(1, cfg.gpus_per_node)
        # Rounded down at Ray's resource precision (1e-4; it rounds to nearest): slots x share must not
        # come to more than the node has (2 CPUs over 3 GPU slots: 0.6666, not 0.6667).
        bundle: dict[str, float] = {"CPU": int(cfg.cpus_per_node / self.slots * 1e4) / 1e4}
        if cfg.gpus_per_node:
            bundle["GPU"] = 1.0
        if cfg.node_resource:
            bundle[cfg.node_resource] = _NODE_RESOURCE_SHARE
        self.bundle = bundle
        # One bundle a node spreads strictly; several slots a node cannot (STRICT_SPREAD puts every
        # bundle on its own node), so they are packed and the layout checked once placed.
        strategy = "STRICT_PACK" if cfg.nodes == 1 else "STRICT_SPREAD" if self.slots == 1 else "PACK"
        self._pg: PlacementGroup | None = placement_group([dict(bundle) for _ in range(cfg.nodes * self.slots)],
                                                          strategy=strategy, name=f"pool-{name}")
        try:
            self._place(ready_timeout_s)
        except BaseException:  # an interrupted or failed wait must not leave the group holding the room
            self.shutdown()
            raise

    def _place(self, ready_timeout_s: float) -> None:
        cfg, n = self.cfg, self.cfg.nodes * self.slots
        if not self.placement_group.wait(timeout_seconds=ready_timeout_s):
            raise PlacementError(
                f"cluster.resource_pools.{self.name}: could not reserve {cfg.nodes} node(s) x "
                f"{_fmt(self.bundle, self.slots)} within {ready_timeout_s:g}s (other pools or actors hold the room); "
                f"nodes: {_free_nodes()}")
        table = ray.util.placement_group_table(self.placement_group)["bundles_to_node_id"]
        self.bundle_nodes = [table[i] for i in range(n)]
        per_node = {node: self.bundle_nodes.count(node) for node in self.bundle_nodes}
        if len(per_node) != cfg.nodes or set(per_node.values()) != {self.slots}:
            raise PlacementError(f"cluster.resource_pools.{self.name}: Ray placed its {n} GPU slots "
                                 f"{sorted(per_node.values())} a node, not {self.slots} on each of {cfg.nodes} nodes; "
                                 "use nodes whose GPUs the pool takes whole (gpus_per_node = the node's GPUs)")
        # Bundles in node order (PACK may interleave nodes): a role's ranks on one node are consecutive.
        first = {node: i for i, node in reversed(list(enumerate(self.bundle_nodes)))}
        self.bundles_by_node = sorted(range(n), key=lambda i: (first[self.bundle_nodes[i]], i))

    @property
    def placement_group(self) -> PlacementGroup:
        if self._pg is None:
            raise RuntimeError(f"resource pool {self.name!r} has been shut down")
        return self._pg

    def shutdown(self) -> None:
        pg, self._pg = self._pg, None
        remove_placement_group_quietly(pg, f"pool-{self.name}")


class RolePlacement:
    """One role's share of a pool, in the shape a :class:`RayWorkerGroup` takes (as a RayVirtualCluster):
    rank r runs in bundle ``bundle_index(r)``, reserving ``cpus_per_worker``/``gpus_per_worker`` there."""

    def __init__(self, pool: ResourcePool, role: str, num_workers: int, sharing: int) -> None:
        self.pool, self.role, self.num_workers, self.name = pool, role, num_workers, f"{role}@{pool.name}"
        gpu = bool(pool.cfg.gpus_per_node)
        self._per_bundle = 1 if gpu else num_workers // pool.cfg.nodes
        cpus = pool.bundle["CPU"] / self._per_bundle  # this rank's share when the role runs alone
        self.threads_per_worker = max(1, int(cpus))
        # Round down at Ray's resource precision (1e-4): k shares must never add up to more than the bundle.
        self.cpus_per_worker = int(cpus / sharing * 1e4) / 1e4
        self.gpus_per_worker = int(1e4 / sharing) / 1e4 if gpu else 0.0

    @property
    def placement_group(self) -> PlacementGroup:
        return self.pool.placement_group

    def bundle_index(self, rank: int) -> int:
        return self.pool.bundles_by_node[rank // self._per_bundle]

    def bundle_node_ids(self) -> list[str]:
        """Node id hosting each rank, in rank order."""
        return [self.pool.bundle_nodes[self.bundle_index(r)] for r in range(self.num_workers)]

    def shutdown(self) -> None:
        """Nothing to free: the pool's placement group outlives the roles on it (RolePlan.shutdown)."""


Placement = RayVirtualCluster | RolePlacement


class RolePlan:
    """The placements of a run by role, and the pools behind them; ``shutdown`` frees every group."""

    def __init__(self, placements: dict[str, Placement], pools: dict[str, ResourcePool], cluster: ClusterConfig):
        self.placements, self.pools, self._cluster = placements, pools, cluster

    def __getitem__(self, role: str) -> Placement:
        return self.placements[role]

    def describe(self, reference: bool = False, labels: dict[str, str] | None = None) -> list[str]:
        """One line a role: role -> pool (its shape) -> the nodes its ranks run on; ``reference``: the
        run has a reference model, which lives in the policy's workers; ``labels``: what a role is in
        this run, shown beside its name (the reward model a reward-model run trains is its policy)."""
        info = {n["NodeID"]: n for n in ray.nodes()}
        lines = []
        for role, p in self.placements.items():
            if isinstance(p, RolePlacement):
                c = p.pool.cfg
                others = [r for r in self._cluster.pool_sharing()[p.pool.name] if r != role]
                where = (f"pool {p.pool.name!r} ({c.nodes} node(s) x {_fmt(p.pool.bundle, p.pool.slots)}"
                         + (f", shared with {', '.join(others)}" if others else "") + ")")
            else:
                res = {"CPU": p.cpus_per_worker} | ({"GPU": p.gpus_per_worker} if p.gpus_per_worker else {})
                where = f"own group ({p.num_workers} x {_fmt(res, 1)})"
            shown = "policy+reference" if role == "policy" and reference else role
            if labels and role in labels:
                shown += f" ({labels[role]})"
            ranks: dict[str, list[int]] = {}
            for r, node in enumerate(p.bundle_node_ids()):
                ranks.setdefault(node, []).append(r)
            nodes = "; ".join(f"{_node_label(info.get(n), n)} ranks {','.join(map(str, rs))}" for n, rs in ranks.items())
            lines.append(f"{shown} -> {where} -> {nodes}")
        return lines

    def summary(self, reference: bool = False, labels: dict[str, str] | None = None) -> str:
        """The printed plan: ``PLAN_HEADER`` and ``describe``'s lines, indented."""
        return "\n".join([PLAN_HEADER] + [f"  {line}" for line in self.describe(reference, labels)])

    def shutdown(self) -> None:
        for p in self.placements.values():
            p.shutdown()
        for pool in self.pools.values():
            pool.shutdown()


def refuse_roles_not_placed(roles: dict[str, str], run: str, placed: dict[str, str],
                            hints: dict[str, str] | None = None) -> None:
    """``cluster.roles`` of a run that places only the roles in ``placed`` (role -> what it is there):
    ValueError naming the first other role, with its ``hints`` line (why it has none, what to name
    instead) or the roles the run has. Checked before ``ClusterConfig.check_roles``, whose reasons are
    the language-model run's."""
    for role in roles:
        if role not in placed:
            why = (hints or {}).get(role) or "remove the key"
            has = ", ".join(f"{r} ({what})" for r, what in placed.items())
            raise ValueError(f"cluster.roles.{role}: {run} has no {role} role; {why}. Its roles: {has}")


def check_pools_fit(cluster: ClusterConfig) -> None:
    """Right after Ray connects: each pool fits the live nodes on its own (enough nodes with its CPUs,
    GPUs and node resource). Pools that fit alone but not together fail when they are reserved."""
    nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
    for name, c in cluster.resource_pools.items():
        fit = [r for r in nodes if r.get("CPU", 0) >= c.cpus_per_node and r.get("GPU", 0) >= c.gpus_per_node
               and (c.node_resource is None or r.get(c.node_resource, 0) > 0)]
        if len(fit) < c.nodes:
            what = f"{c.cpus_per_node:g} CPU(s)" + (f", {c.gpus_per_node} GPU(s)" if c.gpus_per_node else "") + (
                f" and resource {c.node_resource!r}" if c.node_resource else "")
            raise PlacementError(f"cluster.resource_pools.{name}.nodes={c.nodes}: the Ray cluster has {len(fit)} live "
                                 f"node(s) with {what} (of {len(nodes)} node(s)); lower nodes or what each node "
                                 "gives, or add nodes")


def place_roles(cluster: ClusterConfig, roles: list[str]) -> RolePlan:
    """Reserve every role's room before any worker starts: a short cluster fails in seconds, naming
    the pool or role, and not after the first model loaded. ``roles``: the roles the run has, in the
    order they are placed."""
    placements: dict[str, Placement] = {}
    pools: dict[str, ResourcePool] = {}
    plan = RolePlan(placements, pools, cluster)
    try:
        if not cluster.resource_pools:
            for role in roles:
                s = cluster.role_workers(role)
                placements[role] = RayVirtualCluster(s.num_workers, cpus_per_worker=s.cpus_per_worker,
                                                     gpus_per_worker=s.gpus_per_worker, name=role)
            return plan
        check_pools_fit(cluster)
        sharing = cluster.pool_sharing()
        for role in roles:
            name = cluster.roles[role]
            if name not in pools:
                pools[name] = ResourcePool(name, cluster.resource_pools[name])
            placements[role] = RolePlacement(pools[name], role, cluster.role_workers(role).num_workers,
                                             len(sharing[name]))
        return plan
    except BaseException:
        plan.shutdown()
        raise


def _fmt(bundle: dict[str, float], slots: int) -> str:
    per = {k: v * slots for k, v in bundle.items() if k in ("CPU", "GPU")}
    return " + ".join(f"{v:g} {k}" for k, v in per.items())


def _node_label(node: dict[str, Any] | None, node_id: str) -> str:
    """Short id, address and custom resources (the names a cluster gives its nodes)."""
    if node is None:
        return f"node {node_id[:8]}"
    custom = custom_resource_names(node["Resources"])
    return f"node {node_id[:8]} ({node.get('NodeManagerAddress', '?')}{'; ' + ','.join(custom) if custom else ''})"


def _free_nodes() -> str:
    """Each live node's size and what the whole cluster has free now: enough to see which pool to shrink."""
    free = []
    avail = ray.available_resources()
    for n in ray.nodes():
        if n.get("Alive"):
            r = n["Resources"]
            free.append(f"{n['NodeID'][:8]} {r.get('CPU', 0):g} CPU" + (f" {r['GPU']:g} GPU" if r.get("GPU") else ""))
    return f"{len(free)} node(s) [{', '.join(free)}], available now {avail.get('CPU', 0):g} CPU"
