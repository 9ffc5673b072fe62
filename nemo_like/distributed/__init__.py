"""Distributed building blocks: Ray start-up, placement-group clusters, worker groups, batched data."""

from nemo_like.distributed.batched_data_dict import BatchedDataDict
from nemo_like.distributed.ray_cluster import RayVirtualCluster, init_ray, shutdown_ray_if_started
from nemo_like.distributed.worker_group import RayWorkerGroup

__all__ = ["BatchedDataDict", "RayVirtualCluster", "RayWorkerGroup", "init_ray", "shutdown_ray_if_started"]
