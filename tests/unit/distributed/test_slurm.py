"""The Slurm launcher, examples/cluster/ray.sub: node lists expanded as Slurm does, the plan its
--dry-run prints, its one-line errors, and the wait for nodes against a real Ray cluster."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import ray

from nemo_like.distributed.slurm import NodeListError, expand_nodelist

ROOT = Path(__file__).resolve().parents[3]
SUB = ROOT / "examples" / "cluster" / "ray.sub"


@pytest.mark.parametrize("nodelist, hosts", [
    ("node[01-03]", ["node01", "node02", "node03"]),
    ("a1,b2", ["a1", "b2"]),
    ("gpu-[1,3-4]", ["gpu-1", "gpu-3", "gpu-4"]),
    ("gpu-[1,3-4],login7", ["gpu-1", "gpu-3", "gpu-4", "login7"]),
    ("rack[1-2]-n[08-09]", ["rack1-n08", "rack1-n09", "rack2-n08", "rack2-n09"]),
    ("n[9-11]", ["n9", "n10", "n11"]),
    ("solo", ["solo"]),
])
def test_node_lists_expand_as_slurm_does(nodelist, hosts):
    assert expand_nodelist(nodelist) == hosts


@pytest.mark.parametrize("nodelist, why", [
    ("gpu-[1,3-", "a '\\[' without its '\\]'"), ("gpu-1]", "a '\\]' without its '\\['"),
    ("n[3-1]", "runs backwards"), ("n[a-b]", "not a number or a range"), ("", "empty"),
    ("n[1-2],n2", "names 'n2' twice"), ("bad host", "not a host name"),
])
def test_node_lists_that_cannot_be_parsed_are_named(nodelist, why):
    with pytest.raises(NodeListError, match=why):
        expand_nodelist(nodelist)


def _sub(nodelist: str, num_nodes: str | None, **env: str) -> subprocess.CompletedProcess:
    e = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    e |= {"SLURM_JOB_NODELIST": nodelist, "COMMAND": "uv run examples/run_grpo_math.py --config c.yaml",
          "PYTHON": sys.executable} | env
    if num_nodes is not None:
        e["SLURM_JOB_NUM_NODES"] = num_nodes
    return subprocess.run(["bash", str(SUB), "--dry-run"], env=e, capture_output=True, text=True, timeout=60)


def test_dry_run_prints_head_workers_wait_command_and_stop():
    out = _sub("gpu-[1,3-4]", "3", CPUS_PER_NODE="16", CONTAINER_IMAGE="nvcr.io/x:1")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "[ray.sub] 3 nodes: head gpu-1 (<ip of gpu-1>:6379), workers: gpu-3 gpu-4"
    steps = [ln for ln in lines if ln.startswith("+ srun")]
    assert all("--container-image=nvcr.io/x:1" in s for s in steps)
    head, w3, w4, wait, cmd, *stops = steps
    assert "-w gpu-1" in head and "start --head" in head and "--num-cpus=16" in head and head.endswith("--block &")
    for s, node in ((w3, "gpu-3"), (w4, "gpu-4")):
        assert f"-w {node}" in s and "start --address=<ip of gpu-1>:6379" in s and s.endswith("&")
    assert "-w gpu-1" in wait and "wait-for-nodes <ip of gpu-1>:6379 3 300" in wait
    assert cmd.endswith("env RAY_ADDRESS=<ip of gpu-1>:6379 bash -c uv run examples/run_grpo_math.py --config c.yaml")
    assert [s.split(" -w ")[1].split()[0] for s in stops] == ["gpu-1", "gpu-3", "gpu-4"]
    assert all("stop --force" in s for s in stops)


@pytest.mark.parametrize("nodelist, num, env, message", [
    ("gpu-[1,3-", "3", {}, "error: cannot parse the Slurm node list 'gpu-[1,3-': a '[' without its ']'"),
    ("node[01-03]", "2", {}, "error: SLURM_JOB_NODELIST=node[01-03] names 3 nodes but SLURM_JOB_NUM_NODES=2"),
    ("node[01-03]", None, {"COMMAND": ""}, "error: COMMAND is not set"),
])
def test_dry_run_refuses_bad_allocations_in_one_line(nodelist, num, env, message):
    out = _sub(nodelist, num, **env)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines()[0].startswith(message), out.stderr
    assert len(out.stderr.strip().splitlines()) == 1 and "+ srun" not in out.stdout


def test_wait_for_nodes_against_a_real_cluster(ray_session):
    address = ray.get_runtime_context().gcs_address
    cmd = [sys.executable, "-m", "nemo_like.distributed.slurm", "wait-for-nodes", address]
    ok = subprocess.run([*cmd, "1", "30"], capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0 and f"1 Ray nodes alive at {address}" in ok.stdout, ok.stderr
    short = subprocess.run([*cmd, "2", "1"], capture_output=True, text=True, timeout=120)
    assert short.returncode == 2
    assert f"error: 1 of 2 Ray nodes joined {address} within 1 s" in short.stderr


def test_the_kuberay_job_runs_an_existing_config_on_as_many_gpus_as_it_asks_for():
    import yaml

    from nemo_like.config import load_config

    job = yaml.safe_load((ROOT / "examples" / "cluster" / "rayjob.yaml").read_text())
    assert job["apiVersion"] == "ray.io/v1" and job["kind"] == "RayJob"
    words = job["spec"]["entrypoint"].split()
    script, config = words[2], words[words.index("--config") + 1]
    assert (ROOT / script).is_file()
    cfg = load_config(ROOT / config)
    gpus = sum(g["replicas"] * int(g["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"])
               for g in job["spec"]["rayClusterSpec"]["workerGroupSpecs"])
    assert gpus == cfg.cluster.num_workers * cfg.cluster.gpus_per_worker
    assert job["spec"]["rayClusterSpec"]["rayVersion"].split()[0] == ray.__version__
