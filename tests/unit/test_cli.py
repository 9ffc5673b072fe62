"""The CLI's exits: a worker that died stops the run with one line and code 4 (resume by running the
same command again); any other error is not swallowed."""

from __future__ import annotations

import itertools
import os
import re
import signal
import time

import pytest
import ray

from nemo_like.cli import dead_worker, run_cli
from nemo_like.config import load_config

CONFIG = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "configs", "grpo_math_tiny.yaml")


@ray.remote(max_restarts=0)
class RolloutWorker:  # named like the real one: the message names the class
    def pid(self) -> int:
        return os.getpid()

    def work(self) -> int:
        return 1


_names = itertools.count()


@pytest.fixture
def died(ray_session):
    """The error a caller gets from a worker killed with SIGKILL, as a chaos kill or the OOM killer leaves it."""
    a = RolloutWorker.options(name=f"rollout-0-{os.getpid()}-{next(_names)}").remote()
    os.kill(ray.get(a.pid.remote()), signal.SIGKILL)
    with pytest.raises(ray.exceptions.RayActorError) as e:
        ray.get(a.work.remote(), timeout=60)
    return e.value


def test_dead_worker_names_the_class_through_wrapping_errors(died):
    assert re.fullmatch(r"a RolloutWorker \(rollout-0-[\d-]+, the generation role\) died", dead_worker(died))
    try:  # as the async runner re-raises a failed rollout
        try:
            raise died
        except ray.exceptions.RayActorError as inner:
            raise RuntimeError("the rollout of batch 3 failed 2 times") from inner
    except RuntimeError as outer:
        assert dead_worker(outer) == dead_worker(died)
    assert dead_worker(RuntimeError("CUDA out of memory")) is None


def test_run_cli_exits_4_with_one_line_on_a_dead_worker_and_reraises_anything_else(died, capsys, tmp_path):
    def run(config):
        raise RuntimeError("refit failed") from died

    args = [f"checkpointing.checkpoint_dir={tmp_path / 'ckpt'}"]
    assert run_cli(["--config", CONFIG, *args], CONFIG, run) == 4
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: stopped: {dead_worker(died)}; run the same command again to resume "
                   f"from the newest checkpoint in {tmp_path / 'ckpt'}"]
    assert load_config(CONFIG, args).checkpointing.enabled

    def broken(config):
        raise ValueError("a bug")

    with pytest.raises(ValueError, match="a bug"):
        run_cli(["--config", CONFIG], CONFIG, broken)


def test_help_prints_the_usage_and_succeeds(capsys):
    from nemo_like.config import parse_cli

    with pytest.raises(SystemExit) as e:
        parse_cli(["--help"], "examples/configs/grpo_math_tiny.yaml")
    assert e.value.code == 0
    assert capsys.readouterr().out.startswith("usage: [--config PATH]")


def test_dead_worker_names_a_worker_group_actor_from_its_id_alone(ray_session):
    # A node lost during a call can surface as ActorUnavailableError, whose text has only the actor id:
    # the worker groups' record names it, and says the node when Ray reports that node dead.
    from nemo_like.distributed.worker_registry import record_worker

    alive = ray.get_runtime_context().get_node_id()
    aid = "ab" * 16
    record_worker(aid, "RolloutWorker", "rollout-0-1234-abcd", alive)
    lost = ray.exceptions.ActorUnavailableError("connection lost", bytes.fromhex(aid))
    t0 = time.monotonic()
    assert dead_worker(lost) == "a RolloutWorker (rollout-0-1234-abcd, the generation role) died"
    assert time.monotonic() - t0 < 10  # an actor Ray never knew: no verdict to wait for (it waited 45 s)
    record_worker(aid, "RolloutWorker", "rollout-0-1234-abcd", "cd" * 28)  # a node Ray does not list alive
    try:
        raise RuntimeError("the rollout failed") from lost
    except RuntimeError as outer:
        assert dead_worker(outer) == f"a RolloutWorker (rollout-0-1234-abcd, the generation role) died with its node {'cd' * 4}"
    # An id no worker group started: as before, a worker process.
    other = ray.exceptions.ActorUnavailableError("connection lost", bytes.fromhex("ef" * 16))
    assert dead_worker(other) == "a worker process died"
