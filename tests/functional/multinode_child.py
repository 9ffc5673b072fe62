"""Run by test_multinode.py in a process of its own: a three-node Ray cluster on this machine
(ray.cluster_utils.Cluster: three raylets, one CPU each), one GRPO step of the tiny default on it with
the policy's two workers (and the bootstrap's SFT) spread over two nodes, gloo between them. Prints
one JSON line: where each policy worker ran, the nodes alive, the step's metrics."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import ray
from ray.cluster_utils import Cluster

from nemo_like.algorithms.grpo_run import setup
from nemo_like.config import load_config

CONFIG = Path(__file__).resolve().parents[2] / "examples" / "configs" / "grpo_math_tiny.yaml"


def main(tmp: Path) -> None:
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    for _ in range(2):
        cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    try:
        cfg = load_config(CONFIG, [
            "grpo.num_prompts_per_step=4", "grpo.num_generations_per_prompt=4", "grpo.dynamic_sampling.enabled=false",
            "grpo.max_num_steps=1", "grpo.val_period=0", "grpo.val_at_start=false", "grpo.val_at_end=false",
            "policy.train_global_batch_size=16", "policy.train_micro_batch_size=8", "policy.logprob_batch_size=8",
            "policy.generation_batch_size=16", "policy.sequence_packing.enabled=false",
            "data.train.generator.num_samples=40", "data.validation.generator.num_samples=8",
            "bootstrap.model.hidden_size=32", "bootstrap.model.num_layers=1", "bootstrap.sft.num_steps=2",
            "bootstrap.sft.batch_size=16", "bootstrap.sft.micro_batch_size=8", "bootstrap.num_workers=2",
            f"bootstrap.cache_dir={tmp / 'cache'}", f"logger.log_dir={tmp / 'logs'}",
            "logger.tensorboard_enabled=false", "checkpointing.enabled=false",
            "cluster.num_workers=2", "cluster.cpus_per_worker=1", f"cluster.address={cluster.address}"])
        trainer = setup(cfg)
        try:
            nodes = trainer.policy.cluster.bundle_node_ids()
            m = trainer.step()
        finally:
            trainer.close()
        alive = sum(1 for n in ray.nodes() if n["Alive"])
        print(json.dumps({"policy_nodes": nodes, "alive": alive, "bootstrapped": any((tmp / "cache").iterdir()),
                          "metrics": {k: m[k] for k in ("train/loss", "train/reward_mean", "train/grad_norm")}}))
    finally:
        ray.shutdown()  # the run joined this cluster and leaves it up; the driver lets go before it stops
        cluster.shutdown()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
