"""Agent programs run by the agent environment against a real server (tiny model): the in-process
function and the external command, their rewards, failures, time limits and killed process groups."""

from __future__ import annotations

import math
import os
import sys
import textwrap
import time

import pytest

from nemo_like.environments.agent_environment import AgentEnvConfig, AgentEnvironment, episode_result
from nemo_like.models.tiny import build_char_tokenizer, build_tiny_llama
from nemo_like.serve.loading import load_engine
from nemo_like.serve.server import start_server

HERE = os.path.dirname(__file__)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    d = tmp_path_factory.mktemp("agent_env_tiny")
    tok = build_char_tokenizer(d)
    build_tiny_llama(tok, hidden_size=32, num_layers=1, num_heads=4, max_position_embeddings=512, seed=0, save_dir=d)
    engine = load_engine(str(d), max_num_seqs=16)
    handle = start_server(engine, model_name="policy")
    yield handle
    handle.stop()
    engine.close()


def _run(env, server, rows):
    import asyncio

    sessions = [server.sessions.open(tag=i) for i in range(len(rows))]
    out = asyncio.run(env.run_episodes(rows, server.base_url, [s.key for s in sessions], "policy"))
    return out, sessions


def test_fn_episodes_run_concurrently_each_in_its_own_session(server):
    env = AgentEnvironment({"fn": "_nl_agent_programs:echo_length", "max_concurrency": 4})
    rows = [{"messages": [{"role": "user", "content": f"q{i}"}], "k": i} for i in range(6)]
    out, sessions = _run(env, server, rows)
    assert [o["reward"] for o in out] == [float(i) for i in range(6)]
    assert all(o["error"] is None and o["metrics"] == {"chars": pytest.approx(o["metrics"]["chars"])} for o in out)
    assert [len(s.turns) for s in sessions] == [1] * 6  # each episode's request in its own session


def test_failures_and_timeouts_are_results_not_exceptions(server):
    env = AgentEnvironment({"fn": "_nl_agent_programs:misbehave", "episode_timeout_s": 1.0})
    rows = [{"mode": m, "messages": []} for m in ("raise", "hang", "nan", "text", "ok")]
    t0 = time.monotonic()
    out, _ = _run(env, server, rows)
    assert time.monotonic() - t0 < 5
    raised, hung, nan, text, ok = out
    assert raised["reward"] is None and "RuntimeError at _nl_agent_programs.py" in raised["error"]
    assert hung["timed_out"] and "episode_timeout_s=1.0" in hung["error"]
    assert nan["reward"] is None and "nan" in nan["error"]
    assert text["reward"] is None and "str, not a number" in text["error"]
    assert ok["reward"] == 0.5 and ok["error"] is None


def test_a_command_in_any_language_gets_the_endpoint_and_the_row(server, tmp_path):
    script = tmp_path / "agent.py"
    script.write_text(textwrap.dedent("""
        import json, os, sys, openai
        row = json.load(sys.stdin)
        assert json.load(open(os.environ["NEMO_LIKE_ROW"])) == row
        c = openai.OpenAI()  # OPENAI_BASE_URL and OPENAI_API_KEY from the environment
        r = c.chat.completions.create(model=os.environ["OPENAI_MODEL"], messages=row["messages"], max_tokens=3)
        print("some log line")
        print(json.dumps({"reward": row["k"] / 10, "steps": 1}))
    """))
    env = AgentEnvironment({"command": [sys.executable, str(script)]})
    out, sessions = _run(env, server, [{"messages": [{"role": "user", "content": "hi"}], "k": k} for k in (3, 7)])
    assert [o["reward"] for o in out] == [0.3, 0.7] and [o["metrics"] for o in out] == [{"steps": 1.0}] * 2
    assert [len(s.turns) for s in sessions] == [1, 1]


def test_a_command_that_posts_its_reward_or_fails_or_hangs(server, tmp_path):
    post = tmp_path / "post.py"
    post.write_text(textwrap.dedent("""
        import os, httpx
        r = httpx.post(os.environ["OPENAI_BASE_URL"] + "/nemo_like/reward", json={"reward": 0.25},
                       headers={"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"]})
        r.raise_for_status()
    """))
    env = AgentEnvironment({"command": [sys.executable, str(post)]})
    out, sessions = _run(env, server, [{"messages": []}])
    assert out[0]["reward"] is None and out[0]["error"] is None and sessions[0].reward == 0.25

    crash = tmp_path / "crash.py"
    crash.write_text("import sys\nprint('bad things', file=sys.stderr)\nsys.exit(3)\n")
    out, _ = _run(AgentEnvironment({"command": [sys.executable, str(crash)]}), server, [{}])
    assert out[0]["error"] == "the program exited with 3: bad things"

    pidfile = tmp_path / "child.pid"
    hang = tmp_path / "hang.sh"
    hang.write_text(f"#!/bin/sh\nsleep 100 &\necho $! > {pidfile}\nwait\n")
    hang.chmod(0o755)
    t0 = time.monotonic()
    out, _ = _run(AgentEnvironment({"command": [str(hang)], "episode_timeout_s": 1}), server, [{}])
    assert out[0]["timed_out"] and time.monotonic() - t0 < 5
    child = int(pidfile.read_text())
    time.sleep(0.2)
    assert not _alive(child)  # the program's whole process group was killed, its children too

    out, _ = _run(AgentEnvironment({"command": ["/nonexistent/agent"]}), server, [{}])
    assert "cannot start" in out[0]["error"]


def _alive(pid: int) -> bool:
    """Running (a zombie waiting for a parent that does not reap it counts as dead)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_config_errors_name_the_key():
    with pytest.raises(ValueError, match="exactly one of fn"):
        AgentEnvConfig.model_validate({})
    with pytest.raises(ValueError, match="not an async function"):
        AgentEnvConfig.model_validate({"fn": "_nl_agent_programs:not_async"})
    with pytest.raises(ValueError, match="cannot import module 'no_such_pkg.agent'"):
        AgentEnvConfig.model_validate({"fn": "no_such_pkg.agent:solve"})


@pytest.mark.parametrize("value,want", [(1, (1.0, {}, None)), ({"reward": 0.5, "n": 2}, (0.5, {"n": 2.0}, None)),
                                        (True, None), (math.inf, None), ("1", None), ({"score": 1}, None)])
def test_episode_result(value, want):
    got = episode_result(value)
    if want is None:
        assert got[0] is None and got[2]
    else:
        assert got == want


def test_stream_episodes_yields_each_episode_as_it_ends(server):
    # The trainer ends an episode's session when its result arrives, so the batcher stops waiting for
    # its requests: a result must not wait for slower episodes.
    import asyncio

    env = AgentEnvironment({"fn": "_nl_agent_programs:misbehave", "episode_timeout_s": 1.0})
    rows = [{"mode": m, "messages": []} for m in ("hang", "ok", "raise")]
    sessions = [server.sessions.open(tag=i) for i in range(len(rows))]

    async def collect():
        t0, got = time.monotonic(), []
        async for i, res in env.stream_episodes(rows, server.base_url, [s.key for s in sessions], "policy"):
            got.append((i, res, time.monotonic() - t0))
        return got
    got = asyncio.run(collect())
    assert sorted(i for i, _, _ in got) == [0, 1, 2]
    assert got[-1][0] == 0 and got[-1][1]["timed_out"]  # the hung one, at its time limit
    assert all(t < 0.8 for i, _, t in got if i != 0) and got[-1][2] >= 1.0
    assert {i: r["reward"] for i, r, _ in got}[1] == 0.5


def test_num_actors_deals_the_episodes_among_actors(server, ray_session):
    import ray

    from nemo_like.environments.registry import create_env_actor

    env = create_env_actor("agent", {"fn": "_nl_agent_programs:where", "num_actors": 2})
    try:
        rows = [{"messages": [{"role": "user", "content": f"q{i}"}], "k": i} for i in range(6)]
        sessions = [server.sessions.open(tag=i) for i in range(6)]
        got = {}
        for ref in env.stream_episodes.remote(rows, server.base_url, [s.key for s in sessions], "policy"):
            i, res = ray.get(ref)
            got[i] = res
        assert sorted(got) == list(range(6))
        assert [got[i]["reward"] for i in range(6)] == [float(i) for i in range(6)]
        assert len({got[i]["metrics"]["pid"] for i in range(6)}) == 2  # two processes ran them
        assert all(len(s.turns) == 1 for s in sessions)
        # An actor that dies mid-batch: its unfinished episodes are unscorable, the others stand.
        rows = [{"messages": [{"role": "user", "content": "x"}], "k": i, "die": i == 1} for i in range(4)]
        sessions = [server.sessions.open(tag=i) for i in range(4)]
        out = ray.get(env.run_episodes.remote(rows, server.base_url, [s.key for s in sessions], "policy"))
        assert [o["reward"] for o in out[0::2]] == [0.0, 2.0]  # this actor's share (rows 0 and 2)
        assert all(o["reward"] is None and "agent actor running it failed" in o["error"] for o in out[1::2])
        # ... and is back for the next batch.
        sessions = [server.sessions.open(tag=i) for i in range(4)]
        rows = [{"messages": [{"role": "user", "content": "y"}], "k": i} for i in range(4)]
        out = ray.get(env.run_episodes.remote(rows, server.base_url, [s.key for s in sessions], "policy"))
        assert [o["reward"] for o in out] == [0.0, 1.0, 2.0, 3.0]
    finally:
        ray.kill(env, no_restart=True)
