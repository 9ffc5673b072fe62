"""`Policy`: the driver-side facade over a RayWorkerGroup of training workers (`policy.backend`).

With ``policy.generation.colocated: true`` (the default) the same workers also generate, on the
weights they train. With ``colocated: false`` a separate rollout group generates and is sent the
weights after each update: ``export_weights`` is this side of that refit (see
``nemo_like.models.generation.rollout_group``, which this package does not import).
"""

from __future__ import annotations

import os
from typing import Any

import ray
import torch

from nemo_like.distributed.balance import balance_over_shards, shard_token_imbalance
from nemo_like.distributed.batched_data_dict import BatchedDataDict
from nemo_like.distributed.ray_cluster import RayVirtualCluster
from nemo_like.distributed.worker_group import RayWorkerGroup
from nemo_like.experience.streaming import EPISODE_KEYS, with_episodes
from nemo_like.models.generation.interfaces import GenerationInterface
from nemo_like.models.policy.backends import policy_worker_cls
from nemo_like.models.policy.interfaces import PolicyConfig, PolicyInterface


class Policy(PolicyInterface, GenerationInterface):
    def __init__(self, cluster: RayVirtualCluster, config: PolicyConfig, *, seed: int = 0,
                 init_reference_model: bool = True, init_optimizer: bool = True,
                 name_prefix: str = "policy", weights_path: str | None = None):
        self.cfg = config
        self.cluster = cluster
        self._on_gpu = bool(getattr(cluster, "gpus_per_worker", 0))
        env = {"NEMO_LIKE_USE_GPU": "1" if self._on_gpu else "0"}
        if os.environ.get("HF_HUB_OFFLINE"):
            env["HF_HUB_OFFLINE"] = os.environ["HF_HUB_OFFLINE"]
        self.worker_group = RayWorkerGroup(
            cluster, policy_worker_cls(config.backend), config, seed=seed, init_reference_model=init_reference_model,
            init_optimizer=init_optimizer, name_prefix=name_prefix, env_vars=env)
        self.world_size = self.worker_group.world_size
        self._export_bytes: int | None = None  # the exported view's size never changes: asked once
        if weights_path:
            self.load_checkpoint(weights_path)

    def _balanced(self, data: BatchedDataDict, batch_size: int | None) -> tuple[BatchedDataDict, torch.Tensor | None]:
        """``data`` reordered so that each worker gets about the same tokens of every global batch
        (``policy.balance_batch``), and the permutation (None: left as it is)."""
        return balance_over_shards(data, self.world_size if self.cfg.balance_batch else 1, batch_size)

    def _run_sharded(self, method: str, data: BatchedDataDict, **kwargs) -> BatchedDataDict:
        # Balanced by tokens except generation, whose cost is its output, unknown before.
        return self.worker_group.run_rows(method, data, balance=self.cfg.balance_batch and method != "generate", **kwargs)

    def generate(self, data: BatchedDataDict, greedy: bool = False) -> BatchedDataDict:
        keys = {"input_ids", "input_lengths"}
        if missing := keys - set(data):
            raise KeyError(f"Policy.generate needs keys {sorted(keys)}; missing {sorted(missing)}")
        sub = BatchedDataDict({k: data[k] for k in ("input_ids", "input_lengths", "stop_strings") if k in data})
        return self._run_sharded("generate", sub, greedy=greedy)

    def streams_episodes(self) -> bool:
        # FSDP over several ranks needs every rank in lock step, which per-episode turns are not.
        g = self.cfg.generation
        return g.engine == "continuous" and g.stream_episodes and self.world_size == 1

    def generate_episodes(self, batch: BatchedDataDict, envs: dict, **kwargs: Any) -> tuple[BatchedDataDict, dict[str, float]]:
        sub = BatchedDataDict({k: batch[k] for k in EPISODE_KEYS if k in batch})
        out, metrics = self.worker_group.get_all_worker_results(
            self.worker_group.run_all_workers_single_data("generate_episodes", sub, envs, **kwargs))[0]
        return with_episodes(batch, out), metrics

    def serves_requests(self) -> bool:
        """Whether the worker can take an OpenAI-compatible server's turns into its continuous
        engine as they come (``start_serving``); else the server batches them for ``generate``."""
        # Where episodes stream (policy.generation.stream_episodes, one rank, the continuous engine):
        # the same trade, measured in performance.md.
        return self.streams_episodes() and self.worker_group.has_method("serve_requests")

    def start_serving(self, url: str, key: str | None) -> list[ray.ObjectRef]:
        """The worker decodes the turns the server at ``url`` queues until the server closes the
        rollout; ``finish_serving`` the refs after that."""
        return self.worker_group.run_all_workers_single_data("serve_requests", url, key)

    def finish_serving(self, refs: list[ray.ObjectRef]) -> dict[str, float]:
        return self.worker_group.get_all_worker_results(refs)[0]

    @staticmethod
    def _logprob_inputs(data: BatchedDataDict) -> BatchedDataDict:
        # token_mask travels to mark each sample's prompt (packing computes it once per group) and the
        # positions whose log-probs are read (the HF worker computes only those).
        return BatchedDataDict({k: data[k] for k in ("input_ids", "input_lengths", "token_mask") if k in data})

    def get_logprobs(self, data: BatchedDataDict) -> BatchedDataDict:
        """``logprobs`` [B, T] and ``padding_efficiency`` [B] (the worker's real / computed tokens).
        With a ``token_mask`` in ``data``, read them through it: the HF worker computes them only where
        it is 1 (0 elsewhere)."""
        return self._run_sharded("get_logprobs", self._logprob_inputs(data))

    def get_topk_logprobs(self, data: BatchedDataDict, k: int) -> BatchedDataDict:
        """``logprobs`` [B, T], and ``topk_ids`` / ``topk_logprobs`` [B, T, k] of the k most likely next
        tokens at each position (full-vocabulary log-probs): a distillation teacher's targets."""
        return self._run_sharded("get_topk_logprobs", self._logprob_inputs(data), k=int(k))

    def get_reference_policy_logprobs(self, data: BatchedDataDict) -> BatchedDataDict:
        return self._run_sharded("get_reference_policy_logprobs", self._logprob_inputs(data))

    def train(self, data: BatchedDataDict, loss_fn: Any, global_batch_size: int | None = None,
              micro_batch_size: int | None = None) -> dict[str, float]:
        gbs = global_batch_size or self.cfg.train_global_batch_size
        if data.size % gbs:
            raise ValueError(f"train batch of {data.size} samples is not a multiple of the global batch "
                             f"size {gbs} (policy.train_global_batch_size)")
        if gbs % self.world_size:
            raise ValueError(f"policy.train_global_batch_size ({gbs}) is not divisible by the "
                             f"{self.world_size} training workers")
        tensors = BatchedDataDict({k: v for k, v in data.items() if isinstance(v, torch.Tensor)})
        tensors, _ = self._balanced(tensors, gbs)  # a permutation inside each global batch: the same update
        refs = self.worker_group.run_all_workers_sharded_data(
            "train", tensors, batch_size=gbs, loss_fn=loss_fn, global_batch_size=gbs,
            micro_batch_size=micro_batch_size)
        # Metrics are already reduced over workers inside train(); rank 0 reports them.
        out = self.worker_group.get_all_worker_results(refs)[0]
        if self.world_size > 1 and "input_lengths" in tensors:
            out["dp_token_imbalance"] = shard_token_imbalance(tensors["input_lengths"], self.world_size, gbs)
        return out

    def finish_generation(self) -> None:
        if not self._on_gpu:  # nothing to release on a CPU: skip the round trip
            return
        self.worker_group.get_all_worker_results(
            self.worker_group.run_all_workers_single_data("release_generation_memory"))

    def save_checkpoint(self, path: str) -> None:
        self.worker_group.get_all_worker_results(
            self.worker_group.run_all_workers_single_data("save_checkpoint", str(path)))

    def load_checkpoint(self, path: str) -> None:
        self.worker_group.get_all_worker_results(
            self.worker_group.run_all_workers_single_data("load_checkpoint", str(path)))

    def export_merged(self, path: str) -> None:
        """Write a plain HF folder (model and tokenizer, loadable by ``from_pretrained``) of the
        policy as it computes now: with ``policy.lora`` the adapter is merged into the base weights."""
        self.worker_group.get_all_worker_results(
            self.worker_group.run_all_workers_single_data("export_merged", str(path)))

    def export_weights(self, chunk_bytes: int) -> tuple[list[ray.ObjectRef], int]:
        """The weights as a plain HF model would hold them (LoRA merged), as object-store chunks of at
        most ``chunk_bytes`` named full tensors (``list[tuple[str, Tensor]]`` each), and their total
        bytes. The chunks live while someone holds the refs and the policy's rank 0 (their owner) lives:
        drop the refs once the refit is done."""
        if self._export_bytes is None:
            manifest = self.worker_group.get_all_worker_results(
                self.worker_group.run_all_workers_single_data("weights_manifest"))[0]
            self._export_bytes = sum(torch.Size(shape).numel() * dtype.itemsize for _, shape, dtype in manifest)
        refs = self.worker_group.get_all_worker_results(
            self.worker_group.run_all_workers_single_data("export_weight_chunks", int(chunk_bytes)))[0]
        return refs, self._export_bytes

    # The collective refit (models/generation/collective_refit.py): rank 0 is the group's sender.
    def weights_manifest(self) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        return self.worker_group.get_all_worker_results(self.worker_group.run_all_workers_single_data("weights_manifest"))[0]

    def refit_address(self) -> tuple[str, int]:
        return ray.get(self.worker_group.workers[0].refit_address.remote())

    def join_refit_group_async(self, host: str, port: int, world: int, backend: str) -> list[ray.ObjectRef]:
        return self.worker_group.run_all_workers_single_data("join_refit_group", host, port, world, backend)

    def broadcast_weights(self, chunk_bytes: int) -> dict[str, float]:
        """Every rank gathers in step; rank 0 broadcasts (its bytes and buckets are returned)."""
        return self.worker_group.get_all_worker_results(
            self.worker_group.run_all_workers_single_data("broadcast_weights", int(chunk_bytes)))[0]

    def weights_checksum(self) -> str:
        """sha256 over the exported view (``weight_export.named_checksum``): equal on a rollout worker
        that was refit from this policy and holds the weights in the same dtype."""
        return self.worker_group.get_all_worker_results(
            self.worker_group.run_all_workers_single_data("weights_checksum"))[0]

    def shutdown(self) -> None:
        self.worker_group.shutdown()
