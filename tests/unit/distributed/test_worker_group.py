"""RayWorkerGroup on a real local Ray cluster with 2 CPU workers talking gloo."""

import os
import re
import subprocess
import sys
import time

import pytest
import ray
import torch
import torch.distributed as dist

from nemo_like.cli import dead_worker
from nemo_like.distributed import (
    BatchedDataDict,
    RayVirtualCluster,
    RayWorkerGroup,
    init_ray,
    shutdown_ray_if_started,
)

ENV_KEYS = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS",
            "NEMO_LIKE_NUM_THREADS", "EXTRA_FLAG"]


class DistWorker:
    """Joins a gloo process group from the env vars the group sets (env:// rendezvous)."""

    def __init__(self, tag: str, marker_dir: str | None = None) -> None:
        torch.set_num_threads(int(os.environ["NEMO_LIKE_NUM_THREADS"]))
        dist.init_process_group("gloo")
        self.tag = tag
        self.marker_dir = marker_dir

    def info(self) -> dict:
        return {"rank": dist.get_rank(), "world": dist.get_world_size(), "tag": self.tag,
                "threads": torch.get_num_threads(), "env": {k: os.environ.get(k) for k in ENV_KEYS}}

    def all_reduce(self, base: float) -> tuple[int, int, float]:
        t = torch.tensor([base + 10.0 * dist.get_rank()])
        dist.all_reduce(t)
        return dist.get_rank(), dist.get_world_size(), t.item()

    def echo(self, data: BatchedDataDict, scale: int = 1) -> dict:
        return {"rank": dist.get_rank(), "type": type(data).__name__, "ids": (data["ids"] * scale).tolist(),
                "text": data["text"]}

    def fail_on(self, rank: int) -> str:
        if dist.get_rank() == rank:
            raise ValueError(f"boom from rank {rank}")
        return "ok"

    def sleep(self, s: float) -> None:
        time.sleep(s)

    def die(self) -> None:
        if dist.get_rank() == 1:
            os._exit(1)

    def shutdown(self) -> None:
        if self.marker_dir:
            with open(os.path.join(self.marker_dir, f"shutdown-{dist.get_rank()}"), "w") as f:
                f.write("bye")
        dist.destroy_process_group()


def wait_for(pred, timeout: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.1)
    return pred()


def cpus_available() -> float:
    return ray.available_resources().get("CPU", 0.0)


@pytest.fixture(scope="module")
def ray_env(ray_session):
    """The session's Ray; its CPU count, once nothing an earlier module started still holds any."""
    total = ray.cluster_resources()["CPU"]
    assert wait_for(lambda: cpus_available() == total), "an earlier test module left CPUs reserved"
    return total


@pytest.fixture(scope="module")
def group(ray_env):
    # 0.5 CPU per worker: leaves 1 CPU so other tests can build a second group beside this one.
    cluster = RayVirtualCluster(2, cpus_per_worker=0.5, name="wg-test")
    g = RayWorkerGroup(cluster, DistWorker, "hello", name_prefix="tw", env_vars={"EXTRA_FLAG": "on"})
    yield g
    g.shutdown()
    cluster.shutdown()


def test_init_ray_reuses_running_cluster(ray_env):
    assert init_ray(num_cpus=1) is False  # no second cluster
    assert ray.cluster_resources()["CPU"] == ray_env
    shutdown_ray_if_started(False)  # must not stop what it did not start
    assert ray.is_initialized()


def test_init_ray_connects_via_ray_address(ray_env):
    code = ("import ray; from nemo_like.distributed import init_ray;"
            "print(init_ray(num_cpus=7), ray.cluster_resources()['CPU'])")
    env = {**os.environ, "RAY_ADDRESS": ray.get_runtime_context().gcs_address}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-2:] == ["False", str(float(ray_env))]  # connected, did not start a 7-CPU cluster


def test_gloo_all_reduce_and_env(group):
    assert group.world_size == 2 and len(group.workers) == 2
    infos = group.get_all_worker_results(group.run_all_workers_single_data("info"))
    assert [i["rank"] for i in infos] == [0, 1]
    for rank, i in enumerate(infos):
        assert i["world"] == 2 and i["tag"] == "hello" and i["threads"] == 1
        env = i["env"]
        assert env["RANK"] == str(rank) and env["LOCAL_RANK"] == str(rank) and env["WORLD_SIZE"] == "2"
        assert env["MASTER_ADDR"] == "127.0.0.1" and env["EXTRA_FLAG"] == "on"
        assert env["OMP_NUM_THREADS"] == "1" and env["NEMO_LIKE_NUM_THREADS"] == "1"
    assert infos[0]["env"]["MASTER_PORT"] == infos[1]["env"]["MASTER_PORT"]
    results = group.get_all_worker_results(group.run_all_workers_single_data("all_reduce", base=1.5))
    assert results == [(0, 2, 13.0), (1, 2, 13.0)]  # (1.5) + (1.5 + 10)


def test_sharded_dispatch_gives_each_worker_its_shard(group):
    data = BatchedDataDict(ids=torch.arange(8), text=[f"t{i}" for i in range(8)])
    out = group.get_all_worker_results(group.run_all_workers_sharded_data("echo", data, batch_size=4, scale=2))
    assert [o["rank"] for o in out] == [0, 1]
    assert all(o["type"] == "BatchedDataDict" for o in out)
    assert out[0]["ids"] == [0, 2, 8, 10] and out[0]["text"] == ["t0", "t1", "t4", "t5"]
    assert out[1]["ids"] == [4, 6, 12, 14] and out[1]["text"] == ["t2", "t3", "t6", "t7"]
    out = group.get_all_worker_results(group.run_all_workers_sharded_data("echo", data))
    assert out[0]["ids"] == [0, 1, 2, 3] and out[1]["ids"] == [4, 5, 6, 7]
    with pytest.raises(ValueError, match="8 is not divisible by batch_size 3"):
        group.run_all_workers_sharded_data("echo", data, batch_size=3)
    with pytest.raises(TypeError, match="must be a BatchedDataDict"):
        group.run_all_workers_sharded_data("echo", {"ids": [1, 2]})
    with pytest.raises(AttributeError, match="DistWorker has no method 'nope'"):
        group.run_all_workers_single_data("nope")


def test_worker_exception_names_rank_and_method(group):
    with pytest.raises(RuntimeError, match=r"(?s)tw rank 1 raised in 'fail_on'.*ValueError: boom from rank 1"):
        group.get_all_worker_results(group.run_all_workers_single_data("fail_on", 1))
    with pytest.raises(TimeoutError, match=r"ranks \[0, 1\] did not finish within 0.2s"):
        group.get_all_worker_results(group.run_all_workers_single_data("sleep", 1.0), timeout=0.2)
    # the group is still usable after a raised (not crashed) worker
    assert group.get_all_worker_results(group.run_all_workers_single_data("fail_on", 5)) == ["ok", "ok"]


def test_cluster_too_big_fails_fast(ray_env, group):
    total = int(ray_env)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=rf"asked for {total + 1} worker\(s\).*whole Ray cluster has only \{{CPU: {total}\}}"):
        RayVirtualCluster(total + 1, cpus_per_worker=1)
    assert time.monotonic() - t0 < 5
    # fits the cluster but not what is free next to `group` (it holds 1 CPU): bounded wait, then a clear error
    before = cpus_available()
    with pytest.raises(RuntimeError, match=rf"could not reserve {total} worker\(s\).*within 1s.*available now: \{{CPU: {total - 1}\}}"):
        RayVirtualCluster(total, cpus_per_worker=1, ready_timeout_s=1)
    assert wait_for(lambda: cpus_available() == before)  # the pending group was removed
    with pytest.raises(ValueError, match="num_workers must be a positive int"):
        RayVirtualCluster(0)


def test_dead_worker_reported_and_shutdown_frees_everything(ray_env, group, tmp_path):
    before = cpus_available()
    assert before == ray_env - 1.0  # all but what `group` holds
    cluster = RayVirtualCluster(2, cpus_per_worker=0.5)
    g = RayWorkerGroup(cluster, DistWorker, "second", marker_dir=str(tmp_path))
    assert g.get_all_worker_results(g.run_all_workers_single_data("all_reduce", 0.0)) == [(0, 2, 10.0), (1, 2, 10.0)]
    with pytest.raises(RuntimeError, match=r"^worker rank 1 died in 'die': \w*(ActorDied|RayActor)Error") as died:
        g.get_all_worker_results(g.run_all_workers_single_data("die"))
    # The CLI's one line: a worker that died on a live node is named without a node, and at once (Ray's
    # verdict on the actor comes within a second; only a lost node is waited for).
    t0 = time.monotonic()
    assert re.fullmatch(r"a DistWorker \(worker-1-\w+\) died", dead_worker(died.value))
    assert time.monotonic() - t0 < 10
    workers, pg = g.workers, cluster.placement_group
    g.shutdown(timeout=5)
    g.shutdown()  # idempotent
    assert (tmp_path / "shutdown-0").read_text() == "bye"  # the live rank got its shutdown() call
    with pytest.raises(RuntimeError, match="has been shut down"):
        g.run_all_workers_single_data("info")
    cluster.shutdown()
    cluster.shutdown()
    for w in workers:
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(w.__ray_ready__.remote(), timeout=15)
    assert wait_for(lambda: ray.util.placement_group_table(pg)["state"] == "REMOVED")
    assert wait_for(lambda: cpus_available() == before)
