"""Slow environments first: per-task call times, the waves they give, and a turn-by-turn rollout whose
slow grader works while the other tasks generate (real Ray actors, a real tiny HF model)."""

from __future__ import annotations

import time

import pytest
import ray
import torch
from _nl_rollout_helpers import CountdownEnv, LocalHF, _batch, rollout_setup

from nemo_like.experience.env_waves import EnvTimes
from nemo_like.experience.rollouts import run_multi_turn_rollout


def test_waves_put_slow_tasks_first_slowest_first_and_never_split_a_task():
    times = EnvTimes(threshold_s=0.5)
    names = ["a", "tool", "code", "a", "tool", "new"]
    assert times.waves(names, 0) == [[0, 1, 2, 3, 4, 5]]  # nothing timed yet: one wave, in order
    times.observe("code", 0, 0.6)
    times.observe("tool", 0, 2.0)
    times.observe("a", 0, 0.1)
    times.observe("tool", 1, 0.05)  # the call after a tool task's second turn only grades it
    assert times.waves(names, 0) == [[1, 4], [2], [0, 3, 5]]
    assert times.waves(names, 1) == [[0, 1, 2, 3, 4, 5]]
    assert times.waves(["a", "new"], 0) == [[0, 1]]
    times.observe("code", 0, 0.2)  # moving average: 0.6 + 0.5 * (0.2 - 0.6) = 0.4, now below the bar
    assert times.seconds[("code", 0)] == pytest.approx(0.4)
    assert times.waves(names, 0) == [[1, 4], [0, 2, 3, 5]]
    times.observe("b", 0, 9.0, first=True)  # a first call (an actor's start-up) is left out
    assert ("b", 0) not in times.seconds
    times.observe("b", 0, 0.1, first=True)
    assert times.seconds[("b", 0)] == pytest.approx(0.1)
    with pytest.raises(ValueError, match="threshold_s must be positive"):
        EnvTimes(0.0)


class SlowEnv(CountdownEnv):
    """CountdownEnv that takes ``delay_s`` per call and logs when each call ran."""

    def __init__(self, config=None):
        super().__init__(config)
        self.delay, self.log = config["delay_s"], []

    def step(self, message_log_batch, metadata):
        t0 = time.time()
        time.sleep(self.delay)
        out = super().step(message_log_batch, metadata)
        self.log.append((t0, time.time()))
        return out

    def calls(self):
        return self.log


class TimedHF(LocalHF):
    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.ran: list[tuple[float, float]] = []

    def generate(self, data, greedy=False):
        t0 = time.time()
        out = super().generate(data, greedy)
        self.ran.append((t0, time.time()))
        return out


@pytest.fixture(scope="module")
def setup(ray_session):
    envs = {"a": ray.remote(CountdownEnv).remote({"name": "A"}), "b": ray.remote(CountdownEnv).remote({"name": "B"}),
            "slow": ray.remote(SlowEnv).remote({"name": "S", "delay_s": 0.8})}
    ray.get([e.__ray_ready__.remote() for e in envs.values()])
    with rollout_setup(envs) as s:
        yield s


def test_a_slow_grader_works_while_the_other_tasks_generate(setup):
    envs, tok, model = setup
    specs = [("a", 1), ("slow", 2), ("b", 2), ("slow", 2), ("a", 2)]
    kw = dict(max_turns=3, max_seq_len=200, greedy=True)
    ref, _ = run_multi_turn_rollout(LocalHF(model, tok), _batch(tok, specs), tok, envs, **kw)
    times = EnvTimes(threshold_s=0.4)
    run_multi_turn_rollout(LocalHF(model, tok), _batch(tok, specs), tok, envs, env_times=times, **kw)
    assert not times.seconds  # the first call of each task and turn is not counted
    first = TimedHF(model, tok)
    out, m = run_multi_turn_rollout(first, _batch(tok, specs), tok, envs, env_times=times, **kw)
    # Nothing was timed before: one generate call per turn, as without env_times; now it knows (the
    # times come from a callback that may run just after the rollout has its answers).
    assert [c.size for c in first.calls] == [5, 4] and m["env_waves"] == 1.0
    end = time.time() + 5.0
    while len(times.seconds) < 4 and time.time() < end:
        time.sleep(0.01)
    assert times.seconds[("slow", 0)] >= 0.8 and times.seconds[("a", 0)] < 0.4 and times.seconds[("b", 1)] < 0.4
    again = TimedHF(model, tok)
    t0 = time.time()
    out2, m2 = run_multi_turn_rollout(again, _batch(tok, specs), tok, envs, env_times=times, **kw)
    # Each turn: the slow task's samples first, then the rest while its call runs.
    assert [c.size for c in again.calls] == [2, 3, 2, 2] and m2["env_waves"] == 2.0
    slow_calls = [c for c in ray.get(envs["slow"].calls.remote()) if c[0] >= t0]
    assert len(slow_calls) == 2
    assert all("go slow" in tok.decode(row) for row in again.calls[0]["input_ids"])
    for turn, (_start, end) in enumerate(slow_calls):
        assert again.ran[2 * turn + 1][1] < end  # the other wave was generated before the slow call returned
    # The same episodes, token for token, and the same rewards and metrics.
    for o in (out, out2):
        for i in range(len(specs)):
            got, want = o["message_log"][i], ref["message_log"][i]
            assert [x["content"] for x in got] == [x["content"] for x in want]
            assert all(torch.equal(g["token_ids"], w["token_ids"]) for g, w in zip(got, want))
        assert torch.equal(o["total_reward"], ref["total_reward"]) and torch.equal(o["num_turns"], ref["num_turns"])
    assert m2["env/slow/num_calls"] == m["env/slow/num_calls"] == 4
