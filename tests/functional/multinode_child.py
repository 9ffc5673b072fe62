"""Run by test_multinode.py in a process of its own: a three-node Ray cluster on this machine
(ray.cluster_utils.Cluster: three raylets, one CPU each, two named by a `trainer` resource and one by a
`rollout` resource), the tiny default run on it with roles on pools: the policy's two FSDP workers on
pool `trainer` (the two trainer nodes, gloo between them), the rollout worker on pool `gen` (the
third node). After a checkpointed step the rollout node's raylet is killed mid-step; the run must stop
naming the lost worker, and on a cluster that has the node back it must resume from that checkpoint.
Prints one JSON line: the printed plan, where Ray says each actor lives, what the loss looked like."""

from __future__ import annotations

import contextlib
import io
import json
import sys
import threading
import time
from pathlib import Path

import ray
from ray._private import state
from ray.cluster_utils import Cluster

from nemo_like.algorithms.grpo_run import setup
from nemo_like.cli import dead_worker
from nemo_like.config import load_config
from nemo_like.distributed.ray_cluster import init_ray
from nemo_like.models.tiny import build_char_tokenizer, build_tiny_llama

CONFIG = Path(__file__).resolve().parents[2] / "examples" / "configs" / "grpo_math_tiny.yaml"


def actor_nodes() -> dict[str, str]:
    """Ray's own record (the GCS actor table) of the node each live worker actor runs on."""
    return {a["Name"]: a["Address"]["NodeID"] for a in state.actors().values()
            if a["State"] == "ALIVE" and a["Name"].startswith(("policy-", "rollout-"))}


def main(tmp: Path) -> None:
    # A node whose raylet stops answering is declared dead after 3 missed 0.5 s health checks, not 5 x 3 s.
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "resources": {"trainer": 1},
        "_system_config": {"health_check_period_ms": 500, "health_check_failure_threshold": 3}})
    cluster.add_node(num_cpus=1, resources={"trainer": 1})
    gen_node = cluster.add_node(num_cpus=1, resources={"rollout": 1})
    cluster.wait_for_nodes()
    init_ray(address=cluster.address)  # joined as setup() would; setup() reuses this connection
    named = {n["NodeID"]: sorted(k for k in n["Resources"] if k in ("trainer", "rollout")) for n in ray.nodes()}
    out: dict = {"named": named}
    # A tiny untrained model of the default's shape: what runs where is the point here, not what it learns.
    model = tmp / "model"
    build_tiny_llama(build_char_tokenizer(model), hidden_size=32, num_layers=1, num_heads=4, seed=0, save_dir=model)
    try:
        cfg = load_config(CONFIG, [
            "grpo.num_prompts_per_step=4", "grpo.num_generations_per_prompt=4", "grpo.dynamic_sampling.enabled=false",
            "grpo.max_num_steps=12", "grpo.val_period=0", "grpo.val_at_start=false", "grpo.val_at_end=false",
            "policy.train_global_batch_size=16", "policy.train_micro_batch_size=8", "policy.logprob_batch_size=8",
            "policy.generation_batch_size=16", "policy.sequence_packing.enabled=false",
            "policy.generation.colocated=false", "data.train.generator.num_samples=40",
            "data.validation.generator.num_samples=8", f"policy.model_name={model}", f"logger.log_dir={tmp / 'logs'}",
            "logger.tensorboard_enabled=false", f"checkpointing.checkpoint_dir={tmp / 'ckpt'}",
            "checkpointing.save_period=1", "checkpointing.metric_name=null",
            "cluster.num_workers=2", "cluster.cpus_per_worker=1",
            # Weight decay moves the weights every step even where all rewards tie (an untrained model
            # scores 0 everywhere), so each checkpoint's weights differ and the resume check can tell them apart.
            "policy.optimizer.weight_decay=0.5",
            "++cluster.resource_pools.trainer.nodes=2", "++cluster.resource_pools.trainer.cpus_per_node=1",
            "++cluster.resource_pools.trainer.node_resource=trainer", "++cluster.resource_pools.gen.cpus_per_node=1",
            "++cluster.resource_pools.gen.node_resource=rollout",
            "++cluster.roles.policy=trainer", "++cluster.roles.generation=gen"])
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            trainer = setup(cfg)
        out["plan"] = [line for line in printed.getvalue().splitlines() if " -> " in line]
        out["actors"] = actor_nodes()
        try:
            checksums = {}
            for _ in range(2):  # two checkpoints whose weights differ, before anything goes wrong
                trainer.step()
                checksums[trainer.step_count] = trainer.policy.weights_checksum()
            # The rollout node's raylet goes while step 3 runs (generation starts it); its worker goes with it.
            killer = threading.Timer(0.3, cluster.remove_node, args=(gen_node,), kwargs={"allow_graceful": False})
            killer.start()
            t0 = time.monotonic()
            try:
                while trainer.step_count < cfg.grpo.max_num_steps:
                    trainer.step()
                    checksums[trainer.step_count] = trainer.policy.weights_checksum()
                out["stopped"] = None
            except Exception as e:  # noqa: BLE001 - what the CLI would print is what the test checks
                out["stopped"], out["error_type"] = dead_worker(e), type(e).__name__
                out["error_text"] = str(e)[:1500]
                out["seconds_to_stop"] = round(time.monotonic() - t0, 1)
            out["last_checkpoint"] = max(checksums)
            out["checksums"] = checksums
            killer.join()
        finally:
            t1 = time.monotonic()
            trainer.close()
            out["seconds_to_close"] = round(time.monotonic() - t1, 1)
        cluster.add_node(num_cpus=1, resources={"rollout": 1})  # the node is back
        cluster.wait_for_nodes()
        with contextlib.redirect_stdout(io.StringIO()) as resumed:
            trainer = setup(cfg)
        try:
            out["resumed_line"] = [line for line in resumed.getvalue().splitlines() if "resumed from" in line]
            out["resumed_at"] = trainer.step_count
            out["checksum_resumed"] = trainer.policy.weights_checksum()
            out["next_step_loss"] = trainer.step()["train/loss"]
            out["actors_after"] = actor_nodes()
        finally:
            trainer.close()
        out["alive"] = sum(1 for n in ray.nodes() if n["Alive"])
        print(json.dumps(out))
    finally:
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
