"""Roles on resource pools: the config's rules (each a one-line error naming the key), the placement of
a role's workers as Ray itself reports it from inside each actor, and a two-pool GRPO step with a
reward model that makes the same update as the one-pool step with the same seed."""

from __future__ import annotations

import os

import pytest
import ray

from nemo_like.config import ConfigError, load_config
from nemo_like.config_sections import ClusterConfig
from nemo_like.distributed.resource_pools import PlacementError, ResourcePool, RolePlacement, place_roles
from nemo_like.distributed.worker_group import RayWorkerGroup

CONFIGS = os.path.join(os.path.dirname(__file__), "..", "..", "..", "examples", "configs")
CONFIG = os.path.join(CONFIGS, "grpo_math_tiny.yaml")


def _cfg(*overrides: str):
    return load_config(CONFIG, list(overrides))


@pytest.mark.parametrize(("overrides", "words"), [
    (["++cluster.roles.policy=main"], ["cluster.roles names pools", "cluster.resource_pools is empty"]),
    (["++cluster.resource_pools.main.cpus_per_node=2", "++cluster.roles.polcy=main"],
     ["cluster.roles.polcy: no such role", "reward_model"]),
    (["++cluster.resource_pools.main.cpus_per_node=2", "++cluster.roles.policy=mian"],
     ["cluster.roles.policy: no pool 'mian'", "['main']"]),
    (["++cluster.resource_pools.main.cpus_per_node=2", "++cluster.resource_pools.spare.nodes=2",
      "++cluster.roles.policy=main"], ["cluster.resource_pools.spare: no role runs on it"]),
    (["++cluster.resource_pools.main.cpus_per_node=2", "++cluster.roles.critic=main"],
     ["cluster.roles.policy: this run has a policy role but no pool"]),
    (["++cluster.resource_pools.main.cpus_per_node=2", "++cluster.roles.policy=main", "++cluster.roles.critic=main"],
     ["cluster.roles.critic: this run has no critic role", "critic section"]),
    (["++cluster.resource_pools.main.cpus_per_node=2", "++cluster.resource_pools.other.cpus_per_node=1",
      "++cluster.roles.policy=main", "++cluster.roles.reference=other", "loss_fn.reference_policy_kl_penalty=0.01"],
     ["cluster.roles.reference='other'", "inside the policy's workers"]),
    (["++cluster.resource_pools.main.cpus_per_node=2", "++cluster.resource_pools.main.nodes=2",
      "++cluster.roles.policy=main"], ["cluster.num_workers=1 does not spread evenly", "multiple of 2"]),
    (["++cluster.resource_pools.main.cpus_per_node=4", "++cluster.roles.policy=main"],
     ["cluster.cpus_per_worker=2: on pool 'main' each policy worker gets 4 CPU(s)"]),
    (["++cluster.resource_pools.main.cpus_per_node=2", "++cluster.roles.policy=main", "cluster.gpus_per_worker=1"],
     ["cluster.roles.policy='main': cluster.gpus_per_worker=1 asks for a GPU", "gpus_per_node"]),
    (["++cluster.resource_pools.main.cpus_per_node=2", "++cluster.resource_pools.main.gpus_per_node=2",
      "++cluster.roles.policy=main"], ["cluster.num_workers=1: pool 'main' has 1 node(s) x 2 GPU(s)",
                                       "cluster.num_workers=2"]),
    (["++cluster.resource_pools.main.cpus_per_node=2", "++cluster.roles.policy=main", "++cluster.roles.generation=main",
      "policy.generation.colocated=false", "grpo.async_rollouts.enabled=true", "grpo.dynamic_sampling.enabled=false",
      "loss_fn.use_importance_sampling_correction=true"],
     ["cluster.roles.generation='main': with grpo.async_rollouts", "pool of its own"]),
    (["++cluster.resource_pools.main.cpus_per_node=2", "++cluster.resource_pools.main.gpus_per_node=1",
      "++cluster.roles.policy=main", "++cluster.roles.generation=main", "policy.generation.colocated=false",
      "policy.generation.refit_transport=collective"],
     ["policy.generation.refit_transport=collective: the policy and the rollout workers share the GPUs"]),
])
def test_bad_pools_and_roles_are_one_line_naming_the_key(overrides, words):
    with pytest.raises(ConfigError) as e:
        _cfg(*overrides)
    msg = str(e.value)
    assert "\n" not in msg and all(w in msg for w in words), msg


_POOL = "++cluster.resource_pools.main.cpus_per_node=2"


@pytest.mark.parametrize(("overrides", "words"), [
    # The reward model trained is the policy role (sized by cluster.num_workers, as before pools).
    ([_POOL, "++cluster.roles.reward_model=main"],
     ["cluster.roles.reward_model: reward-model training has no reward_model role", "cluster.roles.policy"]),
    ([_POOL, "++cluster.roles.policy=main", "++cluster.roles.critic=main"],
     ["cluster.roles.critic: reward-model training has no critic role", "policy (the reward model trained)"]),
    ([_POOL], ["cluster.resource_pools.main: no role runs on it"]),
    (["++cluster.roles.policy=main"], ["cluster.roles names pools", "cluster.resource_pools is empty"]),
    ([_POOL, "++cluster.resource_pools.main.nodes=2", "++cluster.roles.policy=main"],
     ["cluster.num_workers=1 does not spread evenly over pool 'main'", "multiple of 2"]),
    (["++cluster.resource_pools.main.cpus_per_node=4", "++cluster.roles.policy=main"],
     ["cluster.cpus_per_worker=2: on pool 'main' each policy worker gets 4 CPU(s)"]),
    (["cluster.reward_model.num_workers=2"], ["cluster.reward_model: reward-model training starts no",
                                              "cluster.num_workers"]),
    (["cluster.num_workers=3"], ["reward_model.train_global_batch_size=64 does not divide over cluster.num_workers=3"]),
])
def test_reward_model_training_is_placed_by_the_same_rules(overrides, words):
    from nemo_like.algorithms.rm import load_rm_config

    with pytest.raises(ConfigError) as e:
        load_rm_config(os.path.join(CONFIGS, "rm_math_tiny.yaml"), overrides)
    msg = str(e.value)
    assert "\n" not in msg and all(w in msg for w in words), msg


@pytest.mark.parametrize(("overrides", "words"), [
    # The collectors are the gym run's only workers: the generation role, sized by env.num_collectors.
    ([_POOL, "++cluster.roles.policy=main"], ["cluster.roles.policy: a gym run has no policy role", "driver process",
                                              "cluster.roles.generation"]),
    ([_POOL, "++cluster.roles.generation=main", "++cluster.roles.critic=main"], ["cluster.roles.critic"]),
    ([_POOL, "++cluster.roles.generation=mian"], ["cluster.roles.generation: no pool 'mian'", "['main']"]),
    (["++cluster.roles.generation=main"], ["cluster.roles names pools", "cluster.resource_pools is empty"]),
    ([_POOL, "++cluster.resource_pools.other.cpus_per_node=1", "++cluster.roles.generation=main"],
     ["cluster.resource_pools.other: no role runs on it"]),
    (["++cluster.resource_pools.main.nodes=2", "++cluster.roles.generation=main", "env.num_collectors=3"],
     ["env.num_collectors=3 does not spread evenly over pool 'main'", "multiple of 2"]),
    (["++cluster.resource_pools.main.cpus_per_node=4", "++cluster.roles.generation=main"],
     ["env.cpus_per_collector=1: on pool 'main' each collector gets 2 CPU(s)", "env.cpus_per_collector=2",
      "cluster.resource_pools.main.cpus_per_node=2"]),
    ([_POOL, "++cluster.resource_pools.main.gpus_per_node=1", "++cluster.roles.generation=main"],
     ["cluster.resource_pools.main.gpus_per_node=1: the collectors run", "without GPUs"]),
])
def test_gym_agents_are_placed_by_the_same_rules(overrides, words):
    from nemo_like.gym.config import load_gym_config

    with pytest.raises(ConfigError) as e:
        load_gym_config(os.path.join(CONFIGS, "grpo_cartpole.yaml"), overrides)
    msg = str(e.value)
    assert "\n" not in msg and all(w in msg for w in words), msg


def test_reward_model_and_gym_configs_without_pools_keep_their_meaning():
    from nemo_like.algorithms.rm import load_rm_config
    from nemo_like.gym.config import load_gym_config

    rm = load_rm_config(os.path.join(CONFIGS, "rm_math_tiny.yaml"))
    assert (rm.cluster.num_workers, rm.cluster.cpus_per_worker, rm.cluster.num_cpus) == (1, 2.0, 2)
    assert rm.cluster.resource_pools == {} and rm.cluster.role_workers("policy") is rm.cluster
    for name in ("grpo_cartpole", "grpo_acrobot", "grpo_catch", "ppo_cartpole"):
        gym = load_gym_config(os.path.join(CONFIGS, f"{name}.yaml"))
        placed = gym.placement_cluster()
        assert placed.resource_pools == {} and placed.generation.num_workers == gym.env.num_collectors == 2
    # On a pool that does not set it, the pool sizes each collector (2 CPUs a node over 2 collectors).
    gym = load_gym_config(os.path.join(CONFIGS, "grpo_cartpole.yaml"),
                          ["++cluster.resource_pools.cpu.cpus_per_node=4", "++cluster.roles.generation=cpu",
                           "env.cpus_per_collector=2"])
    assert gym.placement_cluster().pool_sharing() == {"cpu": ["generation"]}


def test_the_default_run_on_a_pool_validates_and_keeps_the_old_sections_meaning():
    cfg = _cfg("++cluster.resource_pools.main.cpus_per_node=2", "++cluster.roles.policy=main",
               "policy.generation.colocated=false", "++cluster.roles.generation=main")
    assert cfg.cluster.pool_sharing() == {"main": ["policy", "generation"]}
    assert cfg.cluster.role_workers("generation") is cfg.cluster.generation


def test_a_pool_larger_than_the_cluster_fails_naming_the_key(ray_session):
    nodes = sum(1 for n in ray.nodes() if n["Alive"])
    cluster = ClusterConfig(resource_pools={"wide": {"nodes": nodes + 1, "cpus_per_node": 1}}, roles={"policy": "wide"},
                            num_workers=nodes + 1)
    with pytest.raises(PlacementError, match=rf"cluster.resource_pools.wide.nodes={nodes + 1}: the Ray cluster has "
                                             rf"{nodes} live node\(s\) with 1 CPU"):
        place_roles(cluster, ["policy"])
    big = ClusterConfig(resource_pools={"big": {"cpus_per_node": 512}}, roles={"policy": "big"})
    with pytest.raises(PlacementError, match=r"cluster.resource_pools.big.nodes=1: the Ray cluster has 0 live node"):
        place_roles(big, ["policy"])
    named = ClusterConfig(resource_pools={"rm": {"node_resource": "no_such_label"}}, roles={"policy": "rm"},
                          cpus_per_worker=1)
    with pytest.raises(PlacementError, match="resource 'no_such_label'"):
        place_roles(named, ["policy"])


class _Where:
    """Reports what Ray itself says about the actor: its node, placement group, reserved resources."""

    def where(self) -> dict:
        ctx = ray.get_runtime_context()
        return {"node": ctx.get_node_id(), "pg": ctx.get_placement_group_id(),
                "resources": ctx.get_assigned_resources(), "threads": os.environ["OMP_NUM_THREADS"],
                "rank": int(os.environ["RANK"]), "local_rank": int(os.environ["LOCAL_RANK"])}


def test_roles_on_one_pool_share_its_bundle_and_split_its_cpus(ray_session):
    cluster = ClusterConfig(resource_pools={"main": {"cpus_per_node": 2}}, roles={"policy": "main", "critic": "main"},
                            num_workers=2, critic={"num_workers": 1})
    plan = place_roles(cluster, ["policy", "critic"])
    groups = []
    try:
        pol, cri = plan["policy"], plan["critic"]
        assert isinstance(pol, RolePlacement) and pol.placement_group.id == cri.placement_group.id
        groups = [RayWorkerGroup(pol, _Where, name_prefix="policy"), RayWorkerGroup(cri, _Where, name_prefix="critic")]
        seen = [g.get_all_worker_results(g.run_all_workers_single_data("where")) for g in groups]
        pg = pol.placement_group.id.hex()
        assert {w["pg"] for ws in seen for w in ws} == {pg}
        # Two policy ranks: 1 CPU each alone, half that reserved beside the critic; the critic: 2 and 1.
        assert [w["threads"] for w in seen[0]] == ["1", "1"] and [w["threads"] for w in seen[1]] == ["2"]
        assert [w["resources"]["CPU"] for w in seen[0]] == [0.5, 0.5] and seen[1][0]["resources"]["CPU"] == 1.0
        assert [(w["rank"], w["local_rank"]) for w in seen[0]] == [(0, 0), (1, 1)]
        lines = plan.describe()
        assert lines[0].startswith("policy -> pool 'main' (1 node(s) x 2 CPU, shared with critic) -> node ")
        assert lines[0].endswith("ranks 0,1") and lines[1].endswith("ranks 0")
    finally:
        for g in groups:
            g.shutdown()
        plan.shutdown()


def test_a_pool_that_cannot_be_reserved_beside_another_says_which(ray_session):
    free = int(ray.cluster_resources()["CPU"])  # the whole node: waits for CPUs an earlier test still frees
    first = ResourcePool("first", ClusterConfig(resource_pools={"first": {"cpus_per_node": free}}, roles={"policy": "first"})
                         .resource_pools["first"])
    try:
        with pytest.raises(PlacementError, match=r"cluster.resource_pools.second: could not reserve 1 node\(s\) x 1 CPU"):
            ResourcePool("second", first.cfg.model_copy(update={"cpus_per_node": 1.0}), ready_timeout_s=2)
        # The pool that could not be placed leaves no pending group behind to grab the CPUs later.
        left = [p["state"] for p in ray.util.placement_group_table().values() if p["name"] == "pool-second"]
        assert left and set(left) == {"REMOVED"}
    finally:
        first.shutdown()


def _grpo_step_with_a_reward_model(tmp_path, cache, rm_dir, pools: list[str]) -> tuple[dict, str, str, list[str]]:
    from nemo_like.algorithms.grpo_run import setup

    cfg = _cfg(
        "grpo.num_prompts_per_step=4", "grpo.num_generations_per_prompt=4", "grpo.dynamic_sampling.enabled=false",
        "grpo.max_num_steps=1", "grpo.val_period=0", "grpo.val_at_start=false", "grpo.val_at_end=false",
        "policy.train_global_batch_size=16", "policy.train_micro_batch_size=16", "policy.logprob_batch_size=16",
        "policy.generation_batch_size=16", "data.train.generator.num_samples=40",
        "data.validation.generator.num_samples=8", "bootstrap.model.hidden_size=32", "bootstrap.model.num_layers=1",
        "bootstrap.sft.num_steps=2", "bootstrap.sft.batch_size=16", "bootstrap.sft.micro_batch_size=16",
        "bootstrap.num_workers=1", f"bootstrap.cache_dir={cache}", "logger.tensorboard_enabled=false",
        f"logger.log_dir={tmp_path / ('logs' + str(len(pools)))}", "checkpointing.enabled=false",
        f"reward_model.model_name={rm_dir}", "reward_model.weight=1.0",
        *[f"++cluster.resource_pools.{p}.cpus_per_node=2" for p in pools],
        f"++cluster.roles.policy={pools[0]}", f"++cluster.roles.reward_model={pools[-1]}")
    trainer = setup(cfg)
    try:
        before = trainer.policy.weights_checksum()
        m = trainer.step()
        return m, before, trainer.policy.weights_checksum(), trainer_pgs(trainer)
    finally:
        trainer.close()


def trainer_pgs(trainer) -> list[str]:
    """The placement group of the policy's and of the reward model's worker group."""
    return [trainer.policy.cluster.placement_group.id.hex(),
            trainer.rm_scorer.rm.worker_group.cluster.placement_group.id.hex()]


@pytest.mark.slow  # over 15 s: run by `uv run pytest -m slow` (CI runs it after the default suite)
def test_a_two_pool_run_makes_the_same_update_as_the_one_pool_run(ray_session, tmp_path, model_dir, base_model_cache):
    from transformers import AutoTokenizer

    from nemo_like.models.reward_model import load_reward_model

    rm_dir = tmp_path / "rm"
    load_reward_model(model_dir).save_pretrained(rm_dir)
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(rm_dir)
    one, before1, after1, pgs1 = _grpo_step_with_a_reward_model(tmp_path, base_model_cache, rm_dir, ["main"])
    two, before2, after2, pgs2 = _grpo_step_with_a_reward_model(tmp_path, base_model_cache, rm_dir, ["train", "scorer"])
    assert pgs1[0] == pgs1[1] and pgs2[0] != pgs2[1]  # one pool shared, then one pool a role
    assert before1 == before2 and after1 != before1  # the same start, and the step moved the weights
    assert after2 == after1  # ... to the same weights
    for k in ("train/loss", "train/grad_norm", "train/reward_mean", "rm/score_mean", "rm/score_std"):
        assert two[k] == one[k], k
