"""More than one Ray node: a three-node cluster on this machine (ray.cluster_utils.Cluster, one CPU a
node), a GRPO step of the tiny default joining it through cluster.address, its policy's two FSDP
workers (and the bootstrap's two SFT workers) on different nodes, gloo between them. In a process of
its own: the test session's Ray is a one-node cluster."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

CHILD = Path(__file__).with_name("multinode_child.py")


def test_a_grpo_step_on_two_nodes_of_a_three_node_cluster(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.run([sys.executable, str(CHILD), str(tmp_path)], capture_output=True, text=True, timeout=600,
                          env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["alive"] == 3 and out["bootstrapped"]
    assert len(out["policy_nodes"]) == 2 and len(set(out["policy_nodes"])) == 2  # one worker a node
    assert all(math.isfinite(v) for v in out["metrics"].values())
