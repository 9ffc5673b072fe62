"""`Critic`: the driver-side facade over a RayWorkerGroup of critic (value model) workers."""

from __future__ import annotations

import os

import torch

from nemo_like.distributed.balance import balance_over_shards
from nemo_like.distributed.batched_data_dict import BatchedDataDict
from nemo_like.distributed.ray_cluster import RayVirtualCluster
from nemo_like.distributed.worker_group import RayWorkerGroup
from nemo_like.models.critic.config import CriticConfig
from nemo_like.models.critic.worker import CriticWorker
from nemo_like.models.policy.interfaces import PolicyConfig

_TRAIN_KEYS = ("input_ids", "input_lengths", "token_mask", "values", "returns")


class Critic:
    def __init__(self, cluster: RayVirtualCluster, config: CriticConfig, policy_config: PolicyConfig, *,
                 seed: int = 0, name_prefix: str = "critic"):
        self.cfg = config
        self.policy_cfg = policy_config
        self.cluster = cluster
        env = {"NEMO_LIKE_USE_GPU": "1" if getattr(cluster, "gpus_per_worker", 0) else "0"}
        if os.environ.get("HF_HUB_OFFLINE"):
            env["HF_HUB_OFFLINE"] = os.environ["HF_HUB_OFFLINE"]
        self.worker_group = RayWorkerGroup(cluster, CriticWorker, config, policy_config, seed=seed,
                                           name_prefix=name_prefix, env_vars=env)
        self.world_size = self.worker_group.world_size

    @property
    def _balance_shards(self) -> int:
        """The workers a batch is balanced over: the critic follows ``policy.balance_batch``."""
        return self.world_size if self.policy_cfg.balance_batch else 1

    @property
    def train_global_batch_size(self) -> int:
        return self.cfg.train_global_batch_size or self.policy_cfg.train_global_batch_size

    def _all(self, method: str, *args):
        return self.worker_group.get_all_worker_results(self.worker_group.run_all_workers_single_data(method, *args))

    def compute_values(self, data: BatchedDataDict) -> BatchedDataDict:
        """``values`` [B, T] float32: values[:, t] is the critic's estimate at the state that chose
        token t (its head at position t - 1), 0 at t = 0 and on padding."""
        keys = {"input_ids", "input_lengths"}
        if missing := keys - set(data):
            raise KeyError(f"Critic.compute_values needs keys {sorted(keys)}; missing {sorted(missing)}")
        # token_mask, when given, lets packing lay a prompt's samples after one copy of it.
        sub = BatchedDataDict({k: data[k] for k in ("input_ids", "input_lengths", "token_mask") if k in data})
        n = sub.size
        out = self.worker_group.run_rows("compute_values", sub, balance=self.policy_cfg.balance_batch)
        width = data["input_ids"].shape[1]
        if out["values"].shape[1] != width:  # shards are as wide as their input: restore the batch's width
            v = torch.zeros(n, width, dtype=torch.float32)
            w = min(width, out["values"].shape[1])
            v[:, :w] = out["values"][:, :w]
            out = BatchedDataDict(values=v)
        return out

    def train(self, data: BatchedDataDict, global_batch_size: int | None = None,
              micro_batch_size: int | None = None) -> dict[str, float]:
        """``critic.ppo_epochs`` passes over ``data`` (keys input_ids, input_lengths, token_mask,
        values: the old values, returns), one optimizer step per global batch; metrics reduced over
        the workers."""
        if missing := [k for k in _TRAIN_KEYS if k not in data]:
            raise KeyError(f"Critic.train needs keys {list(_TRAIN_KEYS)}; missing {missing}")
        gbs = global_batch_size or self.train_global_batch_size
        if data.size % gbs:
            raise ValueError(f"critic train batch of {data.size} samples is not a multiple of the global batch "
                             f"size {gbs} (critic.train_global_batch_size)")
        if gbs % self.world_size:
            raise ValueError(f"critic.train_global_batch_size ({gbs}) is not divisible by the "
                             f"{self.world_size} critic workers")
        tensors = BatchedDataDict({k: data[k] for k in _TRAIN_KEYS})
        tensors, _ = balance_over_shards(tensors, self._balance_shards, gbs)  # inside each global batch: same update
        refs = self.worker_group.run_all_workers_sharded_data(
            "train", tensors, batch_size=gbs, global_batch_size=gbs, micro_batch_size=micro_batch_size)
        return self.worker_group.get_all_worker_results(refs)[0]

    def save_checkpoint(self, path: str) -> None:
        self._all("save_checkpoint", str(path))

    def load_checkpoint(self, path: str) -> None:
        self._all("load_checkpoint", str(path))

    def weights_checksum(self) -> str:
        return self._all("weights_checksum")[0]

    def shutdown(self) -> None:
        self.worker_group.shutdown()
