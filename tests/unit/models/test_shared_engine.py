"""One engine shared by a rollout worker's concurrent calls: streams decode together and give what
each gives alone; weight changes land between steps and later turns say so; a call waits for the
weights it needs, and a refit that fails ends the streams decoding on a mix."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import ray
import torch

from nemo_like.distributed.batched_data_dict import BatchedDataDict
from nemo_like.environments.interfaces import EnvironmentInterface, EnvironmentReturn
from nemo_like.experience.streaming import close_stream, open_stream, stream_episodes
from nemo_like.models.generation import shared_engine
from nemo_like.models.generation.engine import ContinuousBatcher
from nemo_like.models.generation.interfaces import GenerationConfig
from nemo_like.models.generation.shared_engine import SharedEngine
from nemo_like.models.tiny import build_char_tokenizer, build_tiny_llama

GEN = GenerationConfig(max_new_tokens=6, temperature=1.0)
CPU = torch.device("cpu")


class SlowTurnsEnv(EnvironmentInterface):
    """Ends an episode after ``turns`` assistant turns; sleeps ``delay_s`` per call and logs when
    each call started and ended."""

    def __init__(self, delay_s: float = 0.0):
        self.delay_s, self.log = delay_s, []

    def step(self, message_log_batch, metadata):
        t0 = time.time()
        time.sleep(self.delay_s)
        obs, meta, rewards, done = [], [], [], []
        for m in metadata:
            seen = m.get("seen", 0) + 1
            obs.append({"role": "environment", "content": f"left={m['turns'] - seen}"})
            meta.append(m | {"seen": seen})
            rewards.append(1.0 if seen >= m["turns"] else 0.0)
            done.append(seen >= m["turns"])
        self.log.append((t0, time.time()))
        return EnvironmentReturn(obs, meta, [["!"]] * len(obs), torch.tensor(rewards), torch.tensor(done), {})

    def calls(self):
        return self.log


@pytest.fixture(scope="module")
def setup(ray_session):
    tok = build_char_tokenizer()
    torch.manual_seed(0)
    model = build_tiny_llama(tok, hidden_size=32, num_layers=1, num_heads=2, max_position_embeddings=512).eval()
    envs = {name: ray.remote(SlowTurnsEnv).remote(0.5) for name in ("x", "y", "z")}
    ray.get([e.__ray_ready__.remote() for e in envs.values()])
    yield tok, model, envs
    for actor in envs.values():
        ray.kill(actor, no_restart=True)


def _batch(tok, task: str, turns: list[int]) -> BatchedDataDict:
    logs = []
    for k in turns:
        text = tok.apply_chat_template([{"role": "user", "content": f"go {task} {k}"}], tokenize=False,
                                       add_generation_prompt=True)
        logs.append([{"role": "user", "content": text,
                      "token_ids": torch.tensor(tok(text, add_special_tokens=False)["input_ids"])}])
    return BatchedDataDict(message_log=logs, extra_env_info=[{"turns": k} for k in turns],
                           task_name=[task] * len(turns))


def _engine(model, tok, check=lambda: None) -> SharedEngine:
    def make() -> ContinuousBatcher:
        return ContinuousBatcher(model, tok, None, GEN, greedy=False, max_total_length=400, slots=8, device=CPU)
    return SharedEngine(model, make, check)


def _shared(engine, tok, batch, envs, greedy: bool):
    src = open_stream(batch, tok, envs, max_turns=3, max_seq_len=400, greedy=greedy)
    t0 = time.perf_counter()
    engine.stream(src)
    return close_stream(src, time.perf_counter() - t0)


def _solo(model, tok, batch, envs):
    return stream_episodes(model, tok, batch, envs, GEN, greedy=True, max_total_length=400, slots=8, device=CPU,
                           max_turns=3, max_seq_len=400)


def _assert_same_episodes(got, want):
    assert got["num_turns"].tolist() == want["num_turns"].tolist()
    assert torch.equal(got["total_reward"], want["total_reward"])
    for g_log, w_log in zip(got["message_log"], want["message_log"]):
        assert [m["role"] for m in g_log] == [m["role"] for m in w_log]
        for g, w in zip(g_log, w_log):
            assert torch.equal(g["token_ids"], w["token_ids"]), (g["content"], w["content"])
            if g["role"] == "assistant":
                torch.testing.assert_close(g["generation_logprobs"], w["generation_logprobs"], atol=1e-4, rtol=0)
                assert not g["token_ids"].is_inference()


def test_streams_decode_together_and_give_what_each_gives_alone(setup, monkeypatch):
    """Two greedy batches and a sampled one join at once: each greedy batch's episodes equal its solo
    run token for token (the sampled rows beside them change nothing), and the second batch's tool
    calls run while the first's wait: a worker taking one call at a time would start them after."""
    tok, model, envs = setup
    monkeypatch.setattr(shared_engine, "RECYCLE_AFTER", 10)  # a fresh batcher mid-run changes nothing either
    bx, by, bz = _batch(tok, "x", [2, 1, 2, 2]), _batch(tok, "y", [2, 2, 1]), _batch(tok, "z", [1, 2] * 3)
    (want_x, _), (want_y, _) = _solo(model, tok, bx, {"x": envs["x"]}), _solo(model, tok, by, {"y": envs["y"]})
    t_start = time.time()
    engine = _engine(model, tok)
    with ThreadPoolExecutor(3) as pool:
        fx = pool.submit(_shared, engine, tok, bx, envs, True)
        fy = pool.submit(_shared, engine, tok, by, envs, True)
        fz = pool.submit(_shared, engine, tok, bz, envs, False)
        (got_x, mx), (got_y, my), (got_z, _) = fx.result(), fy.result(), fz.result()
    _assert_same_episodes(got_x, want_x)
    _assert_same_episodes(got_y, want_y)
    assert got_z["num_turns"].tolist() == [1, 2] * 3 and got_z["total_reward"].tolist() == [1.0] * 6
    calls_x = [c for c in ray.get(envs["x"].calls.remote()) if c[0] >= t_start]
    calls_y = [c for c in ray.get(envs["y"].calls.remote()) if c[0] >= t_start]
    assert min(s for s, _ in calls_y) < max(e for _, e in calls_x)  # y's tools ran while x's were still waiting
    # Each stream's own generation time excludes its waits on its tools (two 0.5 s calls in a row).
    assert mx["stream/env_wait_s"] > 0.5 and my["stream/env_wait_s"] > 0.5
    assert mx["generation_s"] >= 0 and mx["stream/env_calls"] >= 2


def test_weights_changed_between_steps_move_later_turns_to_the_new_version(setup):
    """A refit (here: a copy of other weights and ``set_version``) lands while the episodes wait on
    their tools: their second turns start on version 1 and say so; each episode's version is its
    oldest turn's; a call needing version 2 waits for it."""
    tok, model, envs = setup
    torch.manual_seed(1)
    other = build_tiny_llama(tok, hidden_size=32, num_layers=1, num_heads=2, max_position_embeddings=512).eval()
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    engine = _engine(model, tok)
    batch = _batch(tok, "x", [2, 2, 2])

    def refit(version: int) -> None:
        with torch.no_grad():
            for p, q in zip(model.parameters(), other.parameters()):
                p.copy_(q)
        engine.set_version(version)
    try:
        with ThreadPoolExecutor(1) as pool:
            fut = pool.submit(_shared, engine, tok, batch, envs, True)
            deadline = time.time() + 10
            while engine.steps < 3 and time.time() < deadline:  # first turns decoded, tools called
                time.sleep(0.02)
            time.sleep(0.1)
            engine.call(refit, 1)
            out, _ = fut.result()
        versions = [[m["policy_version"] for m in log if m["role"] == "assistant"] for log in out["message_log"]]
        assert versions == [[0, 1]] * 3 and out["policy_version"].tolist() == [0, 0, 0]
        # The second turns are the new weights' (a solo run on them from the same first turns agrees).
        second = _batch(tok, "x", [1, 1, 1])
        second["message_log"] = [log[:3] for log in out["message_log"]]
        again, _ = _solo(model, tok, second, {"x": envs["x"]})
        for log, ref in zip(out["message_log"], again["message_log"]):
            assert torch.equal(log[3]["token_ids"], ref[3]["token_ids"])

        waited = []
        t = threading.Thread(target=lambda: (engine.wait_for_version(2, 30, lambda: None), waited.append(time.time())))
        t.start()
        time.sleep(0.3)
        assert not waited  # version 1 < 2
        t_set = time.time()
        engine.call(engine.set_version, 2)
        t.join(5)
        assert waited and waited[0] >= t_set
        with pytest.raises(TimeoutError, match="version 3 did not arrive within 0.2 s"):
            engine.wait_for_version(3, 0.2, lambda: None)
        with pytest.raises(RuntimeError, match="waiting for weights version 3: the refit failed"):
            engine.wait_for_version(3, 30, lambda: "the refit failed")
    finally:
        model.load_state_dict(saved)


def test_streams_on_one_engine_share_a_tasks_call_slots(setup):
    """Two batches stream on one engine against one environment that takes one call at a time (0.5 s
    each) under a 0.8 s limit. With a slot per stream the second call waited in the actor's queue
    while its limit ran, timed out and restarted the actor; sharing the worker's one slot, each call
    is sent when the other has returned and nothing times out."""
    tok, model, _ = setup
    env = ray.remote(SlowTurnsEnv).options(max_restarts=-1, max_task_retries=0).remote(0.5)
    ray.get(env.__ray_ready__.remote())  # started: its first call must not pay for the process
    engine, shared = _engine(model, tok), {}

    def run(task_batch):
        src = open_stream(task_batch, tok, {"x": env}, max_turns=1, max_seq_len=400, greedy=True,
                          step_timeouts={"x": 0.8}, step_concurrency={"x": 1}, calls_in_flight=shared)
        engine.stream(src)
        return close_stream(src, 0.0)

    try:
        with ThreadPoolExecutor(2) as pool:
            results = list(pool.map(run, [_batch(tok, "x", [1, 1]), _batch(tok, "x", [1, 1, 1])]))
        for out, metrics in results:
            assert out["total_reward"].tolist() == [1.0] * out.size, metrics
            assert metrics.get("env/x/step_timeouts", 0) == 0
        assert shared == {"x": 0}
    finally:
        ray.kill(env, no_restart=True)


def test_a_turn_queued_before_a_refit_and_prefilled_after_it_says_the_new_version(setup):
    """Two decoding rows and more turns than that: the refit lands while some wait in the queue. Those
    are generated wholly by the new weights and must say so (they were tagged with the old version,
    over-reporting their staleness); the turns already decoding keep the old one."""
    tok, model, envs = setup
    engine = SharedEngine(model, lambda: ContinuousBatcher(model, tok, None, GEN, greedy=True, max_total_length=400,
                                                           slots=2, device=CPU), lambda: None)
    batch = _batch(tok, "x", [1] * 6)
    src = open_stream(batch, tok, envs, max_turns=1, max_seq_len=400, greedy=True)
    queued_eps: set[int] = set()

    def refit() -> None:  # on the engine thread, between two steps (no weight change is needed to test the tags)
        queued_eps.update(src.request_of[r] for r in engine._batcher.pending if r in src.request_of)
        engine.set_version(1)

    with ThreadPoolExecutor(1) as pool:
        fut = pool.submit(engine.stream, src)
        deadline = time.time() + 10
        while engine._batcher is None or not engine._batcher.pending:
            assert time.time() < deadline
            time.sleep(0.001)
        engine.call(refit)
        fut.result()
    out, _ = close_stream(src, 0.0)
    versions = [[m["policy_version"] for m in log if m["role"] == "assistant"][0] for log in out["message_log"]]
    assert queued_eps, "no turn was queued when the refit landed"
    assert [v for i, v in enumerate(versions) if i in queued_eps] == [1] * len(queued_eps)
    assert 0 in versions  # the turns decoding at the refit started on the old weights


def test_weights_left_unusable_fail_the_streams_decoding_and_refuse_new_ones(setup):
    """A task that leaves the weights half loaded (``check`` raises afterwards) ends every stream in
    the engine with that error instead of sampling from a mix; a stream joining later is refused,
    and once the weights are whole again streams run."""
    tok, model, envs = setup
    state = {"dirty": None}

    def check():
        if state["dirty"]:
            raise RuntimeError(f"weights are a mix of two versions ({state['dirty']})")
    engine = _engine(model, tok, check)
    with ThreadPoolExecutor(2) as pool:
        fx = pool.submit(_shared, engine, tok, _batch(tok, "x", [3, 3]), envs, True)
        fy = pool.submit(_shared, engine, tok, _batch(tok, "y", [3]), envs, False)
        deadline = time.time() + 10
        while engine.steps < 3 and time.time() < deadline:
            time.sleep(0.02)
        engine.call(state.update, dirty="chunk 3 of 9 was refused")
        for fut in (fx, fy):
            with pytest.raises(RuntimeError, match=r"mix of two versions \(chunk 3 of 9"):
                fut.result(timeout=30)
    with pytest.raises(RuntimeError, match="mix of two versions"):
        _shared(engine, tok, _batch(tok, "z", [1]), envs, True)
    state["dirty"] = None
    out, _ = _shared(engine, tok, _batch(tok, "z", [1, 1]), envs, True)
    assert out["total_reward"].tolist() == [1.0, 1.0]


def test_a_task_runs_on_the_engine_thread_and_its_error_reaches_the_caller(setup):
    tok, model, _ = setup
    engine = _engine(model, tok)
    names = [engine.call(lambda: threading.current_thread().name) for _ in range(2)]
    assert names == ["nemo-like-engine"] * 2
    with pytest.raises(ValueError, match="bad chunk"):
        engine.call(lambda: (_ for _ in ()).throw(ValueError("bad chunk")))
    assert engine.call(lambda: 41 + 1) == 42  # the thread lives on
