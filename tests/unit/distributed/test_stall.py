"""The stall watch: a phase past its limit prints every process's stacks and stops the run with one line
naming what the driver waited for; a worker-group wait raises at once, a driver blocked elsewhere is
interrupted. Limits from the median of the phases before, nested phases off the outer clock."""

from __future__ import annotations

import glob
import os
import threading
import time

import pytest
import ray

from nemo_like.distributed import RayVirtualCluster, RayWorkerGroup, stall
from nemo_like.distributed.stall import StalledError, StallWatch


class Napper:
    def nap(self, seconds: float) -> float:
        time.sleep(seconds)
        return seconds

    def pid(self) -> int:
        return os.getpid()


def _watch(**kw) -> StallWatch:
    return StallWatch(**({"factor": 3.0, "min_s": 0.4, "after": 2, "poll_s": 0.05, "grace_s": 0.3} | kw))


def _two_quick_steps(w: StallWatch) -> None:
    """Steps 1 and 2 of 0.05 s: the median the next step is held to (at least min_s)."""
    for i in range(2):
        with w.phase("step", f"step {i + 1}"):
            time.sleep(0.05)


def test_limits_follow_the_median_of_the_phases_before():
    w = _watch(first_s=5.0)
    assert w.limit("step") == 5.0  # the first phases: first_s
    w.history["step"] += [0.1, 0.3, 0.2]
    assert w.limit("step") == pytest.approx(0.6)  # 3 x the median 0.2
    w.history["step"] += [0.01] * 10
    assert w.limit("step") == 0.4  # at least min_s
    assert w.limit("validation") == 5.0  # each kind its own
    assert _watch(factor=None).limit("step") is None and not _watch(factor=None).enabled


def test_a_nested_phase_is_timed_apart_from_the_one_it_is_in():
    w = _watch()
    with w.phase("step", "step 1"):
        time.sleep(0.05)
        with w.phase("validation", "the validation at step 1"):
            time.sleep(0.3)
    assert w.history["validation"][0] >= 0.3 and w.history["step"][0] < 0.2
    with pytest.raises(ValueError), w.phase("step", "step 2"):
        raise ValueError("a failed step is not timed")
    assert len(w.history["step"]) == 1


def test_a_driver_blocked_outside_worker_waits_is_interrupted_with_one_line(capfd):
    w = _watch().start()
    try:
        _two_quick_steps(w)
        t0 = time.monotonic()
        with pytest.raises(StalledError) as e, w.phase("step", "step 3"):
            threading.Event().wait(30)  # blocked in a lock, not in a worker-group wait
        assert time.monotonic() - t0 < 5
    finally:
        w.close()
    msg = str(e.value)
    assert msg.startswith("stalled: step 3 ran past 0 s (grpo.stall_watch: 3 x the median step of 0.1 s, at "
                          "least min_s 0.4 s) waiting for ") and "\n" not in msg
    assert "waiting for nothing a worker group was asked" in msg
    err = capfd.readouterr().err
    assert "step 3 has run" in err and "--- driver thread MainThread" in err  # the driver's threads' stacks
    assert "in test_a_driver_blocked_outside_worker_waits" in err
    assert stall.active() is None


def test_a_wait_with_a_deadline_of_its_own_is_not_a_stall_before_it(capfd):
    w = _watch().start()
    try:
        _two_quick_steps(w)
        with w.phase("step", "step 3"), stall.waiting_for(lambda: "a grader", time.monotonic() + 1.2):
            threading.Event().wait(1.0)  # past the 0.4 s limit, within the wait's own deadline
        assert "has run" not in capfd.readouterr().err
        with pytest.raises(StalledError, match="waiting for a grader"), w.phase("step", "step 4"), \
                stall.waiting_for(lambda: "a grader", time.monotonic() + 0.6):
            threading.Event().wait(30)  # past its deadline too: a stall
    finally:
        w.close()


def test_only_the_stalled_phases_thread_is_stopped():
    """An async producer thread's waits poll check() too: they must not swallow the stop."""
    w = _watch(grace_s=0.5).start()
    other: list = []

    def producer():
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:
            try:
                stall.check()
            except StalledError as e:
                other.append(e)
            time.sleep(0.02)

    t = threading.Thread(target=producer)
    try:
        _two_quick_steps(w)
        t.start()
        with pytest.raises(StalledError), w.phase("step", "step 3"):
            threading.Event().wait(30)
    finally:
        t.join()
        w.close()
    assert other == []


def test_a_pid_file_of_another_process_gets_no_signal(tmp_path, monkeypatch):
    import subprocess
    import sys

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        monkeypatch.setattr(stall, "_stacks_dir", str(tmp_path))
        (tmp_path / str(child.pid)).write_text("12345")  # a start time that is not this child's
        assert stall._stack_pids() == []
        (tmp_path / str(child.pid)).write_text(stall.process_start_time(child.pid))
        assert stall._stack_pids() == [child.pid]
    finally:
        child.kill()
        child.wait()


def test_a_slow_phase_that_ends_within_the_grace_goes_on_and_the_watch_stays_armed(capfd):
    w = _watch(grace_s=2.0).start()
    try:
        _two_quick_steps(w)
        with w.phase("step", "step 3"):
            threading.Event().wait(0.9)  # past the 0.4 s limit, done before the interrupt
        assert w.tripped is None
        err = capfd.readouterr().err
        assert "step 3 has run" in err and "step 3 finished after all; the run goes on" in err
        with pytest.raises(StalledError, match="stalled: step 4 ran past"), w.phase("step", "step 4"):
            threading.Event().wait(30)
    finally:
        w.close()


def test_a_stalled_worker_group_wait_names_the_rank_and_every_worker_prints_its_stacks(ray_session, capfd):
    cluster = RayVirtualCluster(2, cpus_per_worker=0.5, name="stall-test")
    g = RayWorkerGroup(cluster, Napper, name_prefix="napper")
    w = _watch(grace_s=30.0).start()  # the wait itself must raise, long before an interrupt
    try:
        pids = g.get_all_worker_results(g.run_all_workers_single_data("pid"))
        for i in range(2):
            with w.phase("step", f"step {i + 1}"):
                g.get_all_worker_results(g.run_all_workers_single_data("nap", 0.05))
        refs = [g.workers[0].nap.remote(0.05), g.workers[1].nap.remote(6.0)]
        refs = [g._track(r, rank, "nap") for rank, r in enumerate(refs)]
        t0 = time.monotonic()
        with pytest.raises(StalledError) as e, w.phase("step", "step 3"):
            g.get_all_worker_results(refs)
        assert time.monotonic() - t0 < 4
        msg = str(e.value)
        assert "waiting for napper rank 1 (Napper napper-1-" in msg and "in 'nap'" in msg
        assert "napper rank 0" not in msg and "\n" not in msg
        # Each worker got SIGUSR1 and printed its stacks (into its Ray log); it lived on.
        assert ray.get(refs[1]) == 6.0
        logs = os.path.join(ray._private.worker._global_node.get_session_dir_path(), "logs")
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            dumped = {p for p in pids for f in glob.glob(os.path.join(logs, f"worker-*-{p}.err"))
                      if "most recent call first" in open(f, errors="replace").read()}
            if dumped == set(pids):
                break
            time.sleep(0.2)
        assert dumped == set(pids)
        assert "--- driver thread MainThread" in capfd.readouterr().err  # and the driver its own
    finally:
        w.close()
        g.shutdown()
        cluster.shutdown()
