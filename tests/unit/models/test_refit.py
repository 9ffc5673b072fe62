"""Generation apart from training: a RolloutGroup refit from a 2-rank FSDP2 Policy (real Ray, real gloo)."""

from __future__ import annotations

import time

import pytest
import ray
import torch
from _nl_model_test_helpers import tokenized
from transformers import AutoModelForCausalLM, AutoTokenizer

from nemo_like.algorithms.loss_functions import NLLLossFn
from nemo_like.config_sections import GenerationClusterConfig
from nemo_like.distributed.batched_data_dict import BatchedDataDict
from nemo_like.distributed.ray_cluster import RayVirtualCluster
from nemo_like.environments.interfaces import EnvironmentInterface, EnvironmentReturn
from nemo_like.experience.rollouts import run_multi_turn_rollout
from nemo_like.models.generation.collective_refit import bucket_plan
from nemo_like.models.generation.rollout_group import CollectiveTransport, RolloutGroup, per_worker_concurrency
from nemo_like.models.generation.rollout_worker import RolloutWorker
from nemo_like.models.policy import PolicyConfig
from nemo_like.models.policy.lm_policy import Policy

TRAIN_TEXTS = ["12+34=46", "1+1=2", "3+4=7", "40+2=42", "5+5=10", "9+9=18", "2+2=4", "6+1=7"]
PROMPTS = ["12+34=", "1+1=", "999+1=", "7+8=", "5+5="]


def _cfg(model_dir: str, **kw) -> PolicyConfig:
    base = dict(model_name=model_dir, train_global_batch_size=8, train_micro_batch_size=4, logprob_batch_size=4,
                generation_batch_size=8, max_total_sequence_length=40, optimizer={"lr": 1e-2},
                generation={"max_new_tokens": 6, "colocated": False, "refit_chunk_mb": 0.02})
    return PolicyConfig(**(base | kw))


def _batch(tok, texts: list[str]) -> BatchedDataDict:
    return tokenized(tok, texts)


def _train_batch(tok) -> BatchedDataDict:
    data = _batch(tok, TRAIN_TEXTS)
    data["token_mask"] = (torch.arange(data["input_ids"].shape[1])[None] < data["input_lengths"][:, None]).long()
    data["sample_mask"] = torch.ones(len(TRAIN_TEXTS))
    return data


def _gen(n_workers: int = 1) -> GenerationClusterConfig:
    return GenerationClusterConfig(num_workers=n_workers, cpus_per_worker=0.5)


@pytest.fixture(scope="module")
def tok(model_dir):
    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def cluster(ray_session):
    c = RayVirtualCluster(2, cpus_per_worker=1, name="refit-policy")
    yield c
    c.shutdown()


@pytest.fixture(scope="module")
def policy(cluster, model_dir, tok):
    """Two FSDP2 ranks, one optimizer step away from the weights on disk the rollout workers start with."""
    p = Policy(cluster, _cfg(model_dir), seed=0, init_reference_model=False, name_prefix="refit-policy")
    p.train(_train_batch(tok), NLLLossFn())
    yield p
    p.shutdown()


@pytest.fixture(scope="module")
def rollout(ray_session, model_dir):
    g = RolloutGroup(_cfg(model_dir), _gen(1), seed=0, name_prefix="refit-rollout")
    yield g
    g.shutdown()


def _param_bytes(model_dir: str) -> tuple[list[str], int]:
    hf = AutoModelForCausalLM.from_pretrained(model_dir)
    params = list(hf.named_parameters())  # tied weights once, as the export sends them
    return [n for n, _ in params], sum(p.numel() * p.element_size() for _, p in params)


def test_refit_makes_rollout_match_policy(policy, rollout, tok):
    before = rollout.weights_checksums()
    assert before != [policy.weights_checksum()]  # the policy trained a step; the rollout has the base
    metrics = rollout.update_weights_from(policy, version=1)
    assert metrics["timing/weight_sync"] > 0 and metrics["refit/chunks"] > 1
    assert rollout.weights_checksums() == [policy.weights_checksum()]
    data = _batch(tok, PROMPTS)
    ours, theirs = rollout.generate(data, greedy=True), policy.generate(data, greedy=True)
    assert torch.equal(ours["output_ids"], theirs["output_ids"])
    assert torch.equal(ours["generation_lengths"], theirs["generation_lengths"])
    assert torch.allclose(ours["logprobs"], theirs["logprobs"], atol=1e-4)


def test_chunks_respect_the_limit_and_carry_every_parameter(policy, rollout, model_dir):
    names, total = _param_bytes(model_dir)
    limit = 20_000  # smaller than most of the tiny model's matrices: many chunks, several of one tensor
    refs, nbytes = policy.export_weights(limit)
    assert nbytes == total
    seen, sizes = [], []
    for ref in refs:
        chunk = ray.get(ref)
        size = sum(t.numel() * t.element_size() for _, t in chunk)
        assert size <= limit or len(chunk) == 1, (size, [n for n, _ in chunk])
        seen += [n for n, _ in chunk]
        sizes.append(size)
    assert sorted(seen) == sorted(names) and sum(sizes) == total and len(refs) > 10
    del refs
    one, _ = policy.export_weights(1 << 30)
    assert len(one) == 1
    # The group's own refit (refit_chunk_mb=0.02) moves the same bytes in many chunks.
    m = rollout.update_weights_from(policy, version=2)
    assert m["refit/bytes"] == total and m["refit/chunks"] > 10
    assert rollout.weights_checksums() == [policy.weights_checksum()]


def _refit_by_hand(rollout: RolloutGroup, chunks: list[list[tuple[str, torch.Tensor]]], version: int):
    refs = [ray.put(c) for c in chunks]
    return rollout.workers.get_all_worker_results(
        rollout.workers.run_all_workers_single_data("update_weights", refs, version))


def test_bad_chunk_is_refused_naming_the_tensor(policy, rollout, model_dir, tok):
    rollout.update_weights_from(policy, version=3)
    good = rollout.weights_checksums()
    emb = "model.embed_tokens.weight"
    hf = AutoModelForCausalLM.from_pretrained(model_dir)
    shape = tuple(hf.get_parameter(emb).shape)
    with pytest.raises(RuntimeError, match=rf"tensor '{emb}' \(chunk 0\) has shape \(3, 64\), but the rollout "
                                           rf"model's parameter has shape \({shape[0]}, {shape[1]}\)"):
        _refit_by_hand(rollout, [[(emb, torch.zeros(3, 64))]], 9)
    with pytest.raises(RuntimeError, match=r"tensor 'model.layers.0.mlp.no_such_proj.weight' \(chunk 1\) is not a "
                                           r"parameter of the rollout model"):
        _refit_by_hand(rollout, [[], [("model.layers.0.mlp.no_such_proj.weight", torch.zeros(2))]], 9)
    # Nothing was copied: the weights and version are untouched and it still generates.
    assert rollout.weights_checksums() == good and rollout.worker_versions() == [3]
    # One good tensor, then nothing: the others were never sent, and the weights are now a mix.
    with pytest.raises(RuntimeError, match=r"parameter\(s\) of the rollout model were never sent: \['lm_head"
                                           r"|parameter\(s\) of the rollout model were never sent: \['model"):
        _refit_by_hand(rollout, [[(emb, hf.get_parameter(emb).detach())]], 9)
    with pytest.raises(RuntimeError, match="weights are a mix of two versions, refit before generating"):
        rollout.generate(_batch(tok, PROMPTS[:2]), greedy=True)
    rollout.update_weights_from(policy, version=4)  # a whole refit repairs it
    assert rollout.weights_checksums() == good and rollout.worker_versions() == [4]


def test_two_workers_split_and_reassemble_in_order(policy, rollout, model_dir, tok):
    rollout.update_weights_from(policy, version=5)
    two = RolloutGroup(_cfg(model_dir), _gen(2), seed=0, name_prefix="refit-rollout2")
    try:
        m = two.update_weights_from(policy, version=5)
        assert m["refit/bytes"] == _param_bytes(model_dir)[1]
        assert two.weights_checksums() == [policy.weights_checksum()] * 2
        data = _batch(tok, PROMPTS)  # 5 rows: pieces of 3 and 2
        handle = two.generate_async(data, greedy=True)
        assert handle.ranks == [0, 1]
        a, b = two.collect(handle), rollout.generate(data, greedy=True)
        assert a.size == 5 and torch.equal(a["output_ids"], b["output_ids"])
        assert torch.equal(a["unpadded_sequence_lengths"], b["unpadded_sequence_lengths"])
        # Fewer rows than workers: the idle worker is not called.
        one_row = two.generate(data.slice(0, 1), greedy=True)
        assert torch.equal(one_row["output_ids"][0, : int(one_row["unpadded_sequence_lengths"][0])],
                           b["output_ids"][0, : int(b["unpadded_sequence_lengths"][0])])
    finally:
        two.shutdown()


class EchoTurnsEnv(EnvironmentInterface):
    """Answers with the turn count; ends the episode after `turns` assistant turns with reward 1."""

    def step(self, message_log_batch, metadata):
        seen = [m.get("seen", 0) + 1 for m in metadata]
        done = [s >= m["turns"] for s, m in zip(seen, metadata)]
        return EnvironmentReturn([{"role": "environment", "content": f"turn {s}"} for s in seen],
                                 [m | {"seen": s} for s, m in zip(seen, metadata)], [None] * len(seen),
                                 torch.tensor([float(d) for d in done]), torch.tensor(done), {})


def _episodes(tok, turns: list[int]) -> BatchedDataDict:
    logs = []
    for i in range(len(turns)):
        text = tok.apply_chat_template([{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}], tokenize=False,
                                       add_generation_prompt=True)
        logs.append([{"role": "user", "content": text, "token_ids": torch.tensor(tok(text)["input_ids"])}])
    return BatchedDataDict(message_log=logs, extra_env_info=[{"turns": t} for t in turns],
                           task_name=["echo"] * len(turns), idx=torch.arange(len(turns)))


def test_two_workers_stream_episodes_equal_to_turn_by_turn(policy, rollout, model_dir, tok):
    """Each rollout worker streams its share of the episodes (the engine takes next turns as their
    environment answers); greedy, the episodes equal the turn-by-turn loop's on one worker."""
    rollout.update_weights_from(policy, version=6)
    gen = {"max_new_tokens": 6, "colocated": False, "stream_episodes": True}
    two = RolloutGroup(_cfg(model_dir, generation=gen), _gen(2), seed=0, name_prefix="refit-stream")
    env = ray.remote(EchoTurnsEnv).remote()
    try:
        two.update_weights_from(policy, version=6)
        assert two.streams_episodes() and not rollout.streams_episodes() and not policy.streams_episodes()
        kw = dict(max_turns=3, max_seq_len=40, greedy=True)
        turns = [1, 3, 2, 3, 1]
        ours, m = run_multi_turn_rollout(two, _episodes(tok, turns), tok, {"echo": env}, **kw)
        ref, _ = run_multi_turn_rollout(rollout, _episodes(tok, turns), tok, {"echo": env}, **kw)
        assert ours["idx"].tolist() == list(range(5))  # the batch's own fields, in batch order
        assert ours["policy_version"].tolist() == [6] * 5
        for a, b in zip(ours["message_log"], ref["message_log"]):
            assert [x["role"] for x in a] == [x["role"] for x in b]
            assert all(torch.equal(x["token_ids"], y["token_ids"]) for x, y in zip(a, b))
        assert torch.equal(ours["total_reward"], ref["total_reward"]) and torch.equal(ours["num_turns"], ref["num_turns"])
        assert m["turns_per_sample"] == float(ref["num_turns"].float().mean())
    finally:
        ray.kill(env)
        two.shutdown()


def test_collective_refit_broadcasts_the_gathered_weights_to_every_worker(policy, model_dir, tok):
    """gloo between the FSDP policy's rank 0 and two rollout workers: the group is made once, and a
    refit after another optimizer step reuses it; a tiny bucket size cuts the stream into many."""
    gen = {"max_new_tokens": 6, "colocated": False, "refit_chunk_mb": 0.02, "refit_transport": "collective"}
    group = RolloutGroup(_cfg(model_dir, generation=gen), _gen(2), seed=0, name_prefix="refit-coll")
    try:
        assert isinstance(group.transport, CollectiveTransport) and group.transport.backend == "gloo"
        m = group.update_weights_from(policy, version=11)
        assert m["refit/bytes"] == _param_bytes(model_dir)[1] and m["refit/chunks"] > 1
        assert group.weights_checksums() == [policy.weights_checksum()] * 2 and group.worker_versions() == [11, 11]
        policy.train(_train_batch(tok), NLLLossFn())
        assert group.weights_checksums() != [policy.weights_checksum()] * 2
        joined = group.transport._joined
        group.update_weights_from(policy, version=12)
        assert group.transport._joined == joined  # the same group, not a new one
        assert group.weights_checksums() == [policy.weights_checksum()] * 2 and group.worker_versions() == [12, 12]
        data = _batch(tok, PROMPTS)
        assert torch.equal(group.generate(data, greedy=True)["output_ids"], policy.generate(data, greedy=True)["output_ids"])
        # A manifest this model cannot take is refused by every receiver before anything is sent.
        bad = [("model.not_a_layer.weight", (2, 2), torch.float32)]
        with pytest.raises(ray.exceptions.RayTaskError, match="not_a_layer"):
            ray.get(group.workers.workers[0].check_manifest.remote(bad))
    finally:
        group.shutdown()


def test_bucket_plan_aligns_every_tensor_and_keeps_to_the_limit():
    manifest = [("a", (3,), torch.bfloat16), ("b", (5, 2), torch.float32), ("c", (100,), torch.float32),
                ("d", (1,), torch.int64)]
    plan = bucket_plan(manifest, max_bytes=64)
    assert [[i for i, _ in b] for b in plan] == [[0, 1], [2], [3]]  # c (400 bytes) goes alone
    assert all(off % 16 == 0 for b in plan for _, off in b)
    assert plan[0] == [(0, 0), (1, 16)]  # 6 bytes of bf16, then the next aligned offset


def test_policy_version_tags_every_sample(policy, rollout, tok):
    rollout.update_weights_from(policy, version=7)
    out = rollout.generate(_batch(tok, PROMPTS), greedy=False)
    assert out["policy_version"].dtype == torch.int64
    assert out["policy_version"].tolist() == [7] * len(PROMPTS)
    assert rollout.policy_version == 7 and rollout.worker_versions() == [7]


class _OneTensorSource:
    """A policy whose export sends one tensor of the model and nothing else (a refit that fails)."""

    def __init__(self, name: str, tensor: torch.Tensor):
        self.name, self.tensor = name, tensor

    def export_weights(self, chunk_bytes: int):
        return [ray.put([(self.name, self.tensor)])], self.tensor.numel() * self.tensor.element_size()


def test_refit_without_waiting_lands_between_calls(policy, rollout, model_dir, tok):
    """wait=False returns once the weights are exported: a call already sent runs on the old weights
    or the new (the worker's calls run side by side; its samples say which), every later one on the
    new, and finish_refit reports (or raises) what the load did."""
    rollout.update_weights_from(policy, version=20)
    policy.train(_train_batch(tok), NLLLossFn())  # the policy moves on: version 21 differs
    data = _batch(tok, PROMPTS)
    before = rollout.generate_async(data, greedy=True)  # in flight (or queued) at the refit
    m = rollout.update_weights_from(policy, version=21, wait=False)
    assert m["refit/bytes"] == _param_bytes(model_dir)[1] and rollout.policy_version == 21
    assert "refit/load_seconds_max" not in m  # nothing was pending before this one
    after = rollout.generate(data, greedy=True)
    assert rollout.collect(before)["policy_version"].tolist() in ([20] * len(PROMPTS), [21] * len(PROMPTS))
    assert after["policy_version"].tolist() == [21] * len(PROMPTS)
    assert torch.equal(after["output_ids"], policy.generate(data, greedy=True)["output_ids"])
    done = rollout.finish_refit()
    assert done["refit/bytes"] == _param_bytes(model_dir)[1] and rollout.finish_refit() == {}
    assert rollout.weights_checksums() == [policy.weights_checksum()]
    # The next refit without waiting returns the load time of the one before it.
    rollout.update_weights_from(policy, version=22, wait=False)
    assert rollout.update_weights_from(policy, version=23, wait=False)["refit/load_seconds_max"] > 0
    assert rollout.worker_versions() == [23]
    # A load that fails shows at the next check, and the worker refuses to generate meanwhile.
    emb = "model.embed_tokens.weight"
    bad = _OneTensorSource(emb, AutoModelForCausalLM.from_pretrained(model_dir).get_parameter(emb).detach())
    rollout.update_weights_from(bad, version=24, wait=False)  # returns: the load has not been checked
    with pytest.raises(RuntimeError, match="weights are a mix of two versions"):
        rollout.generate(data, greedy=True)
    with pytest.raises(RuntimeError, match=r"refit to version 24: .*never sent"):
        rollout.finish_refit()
    rollout.update_weights_from(policy, version=25)  # a whole refit repairs it
    assert rollout.weights_checksums() == [policy.weights_checksum()] and rollout.worker_versions() == [25]


class _StuckWorker(RolloutWorker):
    """A rollout worker whose generate call holds the model for a minute (a fault: a refit queues
    behind it on the engine's thread)."""

    def generate(self, data, greedy=False, min_version=0):
        self._engine.call(time.sleep, 60)
        return super().generate(data, greedy, min_version)


def test_shutdown_does_not_wait_for_a_refit_stuck_behind_a_call(policy, model_dir, tok):
    g = RolloutGroup(_cfg(model_dir), _gen(1), seed=0, worker_cls=_StuckWorker, name_prefix="refit-stuck")
    stuck = False
    try:
        g.generate_async(_batch(tok, PROMPTS[:1]), greedy=True)  # never waited for
        g.update_weights_from(policy, version=1, wait=False)  # returns: the load waits behind the call
        t0 = time.monotonic()
        with pytest.warns(UserWarning, match="the last refit was still loading at shutdown"):
            g.shutdown(refit_timeout_s=0.5)
        stuck = True
        assert time.monotonic() - t0 < 30
    finally:
        if not stuck:
            g.shutdown(refit_timeout_s=0.0)


def test_lora_refit_sends_merged_weights(policy, cluster, rollout, model_dir, tok, tmp_path):
    """The adapter trains under FSDP2 (its A/B are shards too); the rollout model, a plain HF model,
    computes what the policy computes once the merged weights arrive."""
    policy.shutdown()  # one worker group per cluster
    cfg = _cfg(model_dir, lora={"enabled": True, "rank": 4, "alpha": 8})
    p = Policy(cluster, cfg, seed=0, init_reference_model=False, name_prefix="refit-lora")
    try:
        p.train(_train_batch(tok), NLLLossFn())
        refs, total = p.export_weights(1 << 30)
        names, plain_total = _param_bytes(model_dir)
        exported = dict(ray.get(refs[0]))
        assert sorted(exported) == sorted(names) and total == plain_total  # no adapter names
        # The merge equals peft's own (Policy.export_merged writes a merge_and_unload'ed model).
        p.export_merged(str(tmp_path / "merged"))
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
        for n, t in merged.named_parameters():
            assert torch.allclose(exported[n], t, atol=1e-6), n
        q = "model.layers.0.self_attn.q_proj.weight"
        base = AutoModelForCausalLM.from_pretrained(model_dir).get_parameter(q)
        assert not torch.allclose(exported[q], base)  # the adapter trained and is in there
        del refs, exported
        m = rollout.update_weights_from(p, version=11)
        assert m["refit/bytes"] == plain_total
        assert rollout.weights_checksums() == [p.weights_checksum()]
        data = _batch(tok, PROMPTS)
        ours, theirs = rollout.generate(data, greedy=True), p.generate(data, greedy=True)
        assert torch.equal(ours["output_ids"], theirs["output_ids"])
        assert torch.allclose(ours["logprobs"], theirs["logprobs"], atol=1e-4)
    finally:
        p.shutdown()


def test_streaming_workers_share_a_tasks_environment_calls():
    assert per_worker_concurrency({"tool": 4, "math": 1, "code": 3}, 2) == {"tool": 2, "math": 1, "code": 1}
    assert per_worker_concurrency({"tool": 4}, 1) == {"tool": 4}
