"""More than one Ray node: a three-node cluster on this machine (ray.cluster_utils.Cluster, one CPU a
node, two of them named `trainer`, one `rollout`), the tiny default joining it with its roles on pools:
the policy's two FSDP workers on the trainer nodes, gloo between them, the rollout worker on the third. The rollout node's raylet is then killed mid-run: the run stops
with one line naming the dead worker, and resumes from its last checkpoint once the node is back.
In a process of its own: the test session's Ray is a one-node cluster."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

CHILD = Path(__file__).with_name("multinode_child.py")


@pytest.mark.slow  # over 15 s: run by `uv run pytest -m slow` (CI runs it after the default suite)
def test_roles_on_pools_of_a_three_node_cluster_and_a_lost_node(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.run([sys.executable, str(CHILD), str(tmp_path)], capture_output=True, text=True, timeout=600,
                          env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # Ray's raylets may print after the child's one JSON line; that line is the one that starts with it.
    out = json.loads(next(line for line in reversed(proc.stdout.splitlines()) if line.startswith('{"named"')))
    trainer_nodes = {n for n, names in out["named"].items() if names == ["trainer"]}
    rollout_node = next(n for n, names in out["named"].items() if names == ["rollout"])
    # Where Ray says each actor lives: one policy rank on each trainer node, the rollout worker on the third.
    policy = {name: node for name, node in out["actors"].items() if name.startswith("policy-")}
    rollout = [node for name, node in out["actors"].items() if name.startswith("rollout-")]
    assert len(policy) == 2 and set(policy.values()) == trainer_nodes and rollout == [rollout_node]
    # The printed plan says the same, one line a role.
    assert out["plan"][1].startswith("  policy -> pool 'trainer' (2 node(s) x 1 CPU) -> node ")
    assert out["plan"][1].count("; trainer) ranks") == 2
    assert out["plan"][2].startswith(f"  generation -> pool 'gen' (1 node(s) x 1 CPU) -> node {rollout_node[:8]} ")
    # The lost node stops the run with the CLI's one line, naming the worker that was on it...
    assert out["stopped"] is not None and out["stopped"].startswith("a RolloutWorker (rollout-0-"), out["stopped"]
    assert out["stopped"].endswith(f", the generation role) died with its node {rollout_node[:8]}")
    assert out["seconds_to_stop"] < 60
    # ... and with the node back the run resumes from its last checkpoint, with that checkpoint's weights.
    last = out["last_checkpoint"]
    assert 2 <= last < 12 and out["resumed_at"] == last
    assert out["resumed_line"] and out["resumed_line"][0].endswith(f"step_{last} at step {last}")
    checksums = out["checksums"]
    assert len(set(checksums.values())) == len(checksums)  # every step's weights differ: the check can fail
    assert out["checksum_resumed"] == checksums[str(last)]
    assert isinstance(out["next_step_loss"], float) and out["alive"] == 3
    assert rollout_node not in out["actors_after"].values()  # the new rollout worker is on the new node
