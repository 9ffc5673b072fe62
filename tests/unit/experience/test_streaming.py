"""Streaming multi-turn rollouts: the continuous engine fed per episode gives the turn-by-turn loop's
episodes (greedy: token for token), keeps decoding while an environment works, and keeps the
turn-by-turn loop's rules for failing, hung and overflowing episodes."""

from __future__ import annotations

import time

import pytest
import ray
import torch

from nemo_like.distributed.batched_data_dict import BatchedDataDict
from nemo_like.environments.interfaces import EnvironmentInterface, EnvironmentReturn
from nemo_like.experience.rollouts import run_multi_turn_rollout
from nemo_like.experience.streaming import stream_episodes
from nemo_like.models.generation.hf_generation import hf_generate
from nemo_like.models.generation.interfaces import GenerationConfig
from nemo_like.models.generation.slots import Slots
from nemo_like.models.tiny import build_char_tokenizer, build_tiny_llama


class TurnsEnv(EnvironmentInterface):
    """Answers each turn with a note of `pad` characters; terminates with reward 1 after `turns`
    assistant turns (0.25 for each earlier one). Sleeps `delay_s` per call and logs when each call
    started and ended."""

    def __init__(self, config=None):
        self.cfg = config or {}
        self.log: list[tuple[float, float, int]] = []

    def step(self, message_log_batch, metadata):
        t0 = time.time()
        time.sleep(self.cfg.get("delay_s", 0.0))
        obs, meta, rewards, done = [], [], [], []
        for _log, m in zip(message_log_batch, metadata):
            seen = m.get("seen", 0) + 1
            left = m["turns"] - seen
            obs.append({"role": "environment", "content": f"left={left} " + "x" * self.cfg.get("pad", 0)})
            meta.append(m | {"seen": seen})
            rewards.append(1.0 if left <= 0 else 0.25)
            done.append(left <= 0)
        self.log.append((t0, time.time(), len(obs)))
        return EnvironmentReturn(obs, meta, [["!"]] * len(obs), torch.tensor(rewards), torch.tensor(done),
                                 {"num_calls": float(len(obs)), "left_mean": float(sum(m["turns"] for m in meta))})

    def calls(self):
        return self.log


class BrokenEnv(EnvironmentInterface):
    def step(self, message_log_batch, metadata):
        raise RuntimeError("injected fault")


class HangsEnv(EnvironmentInterface):
    def step(self, message_log_batch, metadata):
        time.sleep(60)


GEN = GenerationConfig(max_new_tokens=6, temperature=1.0)


class Turnwise:
    """The turn-by-turn loop over the same model (the reference)."""

    def __init__(self, model, tok, max_total):
        self.model, self.tok, self.max_total = model, tok, max_total

    def generate(self, data, greedy=False):
        return hf_generate(self.model, self.tok, data, GEN, greedy=greedy, max_total_length=self.max_total,
                           micro_batch_size=64, synced=False, device=torch.device("cpu"))


@pytest.fixture(scope="module")
def setup(ray_session):
    tok = build_char_tokenizer()
    torch.manual_seed(0)
    model = build_tiny_llama(tok, hidden_size=32, num_layers=1, num_heads=2, max_position_embeddings=512).eval()
    envs = {"a": ray.remote(TurnsEnv).remote({"pad": 30}), "b": ray.remote(TurnsEnv).remote({"pad": 3}),
            "slow": ray.remote(TurnsEnv).remote({"delay_s": 1.0}), "broken": ray.remote(BrokenEnv).remote(),
            "hang": ray.remote(HangsEnv).options(max_restarts=-1).remote()}
    yield tok, model, envs
    for actor in envs.values():
        ray.kill(actor, no_restart=True)


def _batch(tok, specs):
    logs, infos, tasks = [], [], []
    for task, turns in specs:
        text = tok.apply_chat_template([{"role": "user", "content": f"go {task} {turns}"}], tokenize=False,
                                       add_generation_prompt=True)
        logs.append([{"role": "user", "content": text,
                      "token_ids": torch.tensor(tok(text, add_special_tokens=False)["input_ids"])}])
        infos.append({"turns": turns})
        tasks.append(task)
    return BatchedDataDict(message_log=logs, extra_env_info=infos, task_name=tasks, loss_multiplier=torch.ones(len(logs)))


def _stream(model, tok, batch, envs, *, max_total=400, slots=64, **kw):
    return stream_episodes(model, tok, batch, envs, GEN, greedy=kw.pop("greedy", True), max_total_length=max_total,
                           slots=slots, device=torch.device("cpu"), max_seq_len=max_total, **kw)


def test_greedy_episodes_equal_the_turn_by_turn_loop_token_for_token(setup, monkeypatch):
    tok, model, envs = setup
    specs = [("a", 3), ("b", 1), ("a", 1), ("b", 3), ("a", 2), ("b", 2)] * 2
    grown = []
    real_grow = Slots.grow
    monkeypatch.setattr(Slots, "grow", lambda self, c: (grown.append(c), real_grow(self, c)))
    ref, ref_m = run_multi_turn_rollout(Turnwise(model, tok, 400), _batch(tok, specs), tok, envs, max_turns=3,
                                        max_seq_len=400, greedy=True)
    # 5 slots for 12 episodes: rows are refilled with first turns and later turns alike.
    out, m = _stream(model, tok, _batch(tok, specs), envs, slots=5, max_turns=3)
    assert grown, "a later turn's longer prompt should have grown the cache's columns"
    for i, (_task, turns) in enumerate(specs):
        got, want = out["message_log"][i], ref["message_log"][i]
        assert [x["role"] for x in got] == [x["role"] for x in want]
        for g, w in zip(got, want):
            assert torch.equal(g["token_ids"], w["token_ids"]), (i, g["content"], w["content"])
            assert g["content"] == w["content"]
            if g["role"] == "assistant":
                torch.testing.assert_close(g["generation_logprobs"], w["generation_logprobs"], atol=1e-4, rtol=0)
                assert not g["token_ids"].is_inference()
        assert int(out["num_turns"][i]) == turns == out["extra_env_info"][i]["seen"]
    for key in ("total_reward", "num_turns", "truncated", "generation_lengths"):
        assert torch.equal(out[key], ref[key]), key
    assert out["loss_multiplier"].tolist() == [1.0] * len(specs)  # the batch's other fields stay
    # Counters add up to the same totals however the calls were cut.
    assert m["env/a/num_calls"] == ref_m["env/a/num_calls"] == 2 * (3 + 1 + 2)
    assert m["turns_per_sample"] == ref_m["turns_per_sample"]
    assert m["stream/env_calls"] >= 2


def test_decoding_goes_on_while_an_environment_works(setup):
    """Two 1 s calls of a slow grader: the turn-by-turn loop waits for each before the fast episodes'
    next turn; the stream finishes all three turns of the fast episodes during the first one."""
    tok, model, envs = setup
    specs = [("slow", 2)] * 2 + [("b", 3)] * 6
    ray.get(envs["b"].__ray_ready__.remote())
    t0 = time.time()
    out, m = _stream(model, tok, _batch(tok, specs), envs, max_turns=3)
    wall = time.time() - t0
    slow = [c for c in ray.get(envs["slow"].calls.remote()) if c[0] >= t0]
    fast = [c for c in ray.get(envs["b"].calls.remote()) if c[0] >= t0]
    assert len(slow) == 2 and sum(n for *_, n in slow) == 4
    assert sum(n for *_, n in fast) == 18
    # Every fast call (three turns of six episodes) started and ended while the first slow call ran.
    assert max(end for _, end, _ in fast) < slow[0][1]
    assert out["num_turns"].tolist() == [2, 2] + [3] * 6
    assert wall < 2.0 + 1.5  # two slow calls back to back, and the decoding hidden beside them
    assert m["stream/env_wait_s"] > 1.5  # the second slow call had nothing to overlap


def test_failing_hung_and_overflowing_episodes_keep_the_turn_loops_rules(setup):
    tok, model, envs = setup
    specs = [("broken", 2), ("hang", 2), ("a", 3), ("b", 1)]
    out, m = _stream(model, tok, _batch(tok, specs), envs, max_turns=3, max_total=90, step_timeouts={"hang": 1.0})
    rewards = out["total_reward"]
    assert torch.isnan(rewards[0]) and "injected fault" in out["grading_error"][0]
    assert torch.isnan(rewards[1]) and "timed out after 1 s" in out["grading_error"][1]
    assert m["env/broken/step_errors"] == 1.0 and m["env/hang/step_timeouts"] == 1.0
    # "a" answers with a long note: its second observation no longer fits in 90 tokens -> truncated.
    assert bool(out["truncated"][2]) and int(out["num_turns"][2]) < 3
    assert all(sum(len(x["token_ids"]) for x in log) <= 90 for log in out["message_log"])
    assert rewards[3].item() == 1.0 and int(out["num_turns"][3]) == 1


def test_sampled_episodes_record_their_version_and_logprobs(setup):
    tok, model, envs = setup
    specs = [("a", 2), ("b", 2)] * 3
    torch.manual_seed(1)
    out, _ = _stream(model, tok, _batch(tok, specs), envs, max_turns=2, greedy=False, version=7)
    assert out["policy_version"].tolist() == [7] * len(specs)
    for log in out["message_log"]:
        for msg in log:
            if msg["role"] == "assistant":
                lp = msg["generation_logprobs"]
                assert len(lp) == len(msg["token_ids"]) > 0 and bool((lp <= 0).all())


def test_calls_carry_even_shares_and_keep_a_slot_for_the_last(setup):
    """A grader with 4 call slots and 2 s per call; episodes end one at a time (one decoding row). Sending
    each as it ends would take all 4 slots with the first 4 and hold the other 12 for 2 s more."""
    tok, model, _ = setup
    env = ray.remote(TurnsEnv).options(max_concurrency=4).remote({"delay_s": 2.0})
    try:
        ray.get(env.__ray_ready__.remote())
        t0 = time.time()
        out, m = _stream(model, tok, _batch(tok, [("t4", 1)] * 16), {"t4": env}, slots=1, max_turns=1,
                         step_concurrency={"t4": 4})
        wall = time.time() - t0
        sizes = [n for *_, n in ray.get(env.calls.remote())]
        assert sizes == [4, 4, 4, 4] and m["stream/env_calls"] == 4
        assert out["total_reward"].tolist() == [1.0] * 16
        assert wall < 2.0 + 1.8  # the calls overlap each other and the decoding: about one call's wait
    finally:
        ray.kill(env, no_restart=True)
