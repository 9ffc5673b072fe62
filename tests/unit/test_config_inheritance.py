"""`defaults:` inheritance and overrides across a change of what a section selects (a generator's kind,
an estimator, a loss, a generation backend), and errors that say which file and line (or the command
line) a key came from. Every YAML is written into tmp_path and inherits the real default recipe."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from pydantic import BaseModel, ConfigDict, Field

from nemo_like.algorithms.advantages import ADVANTAGE_ESTIMATORS, register_advantage_estimator
from nemo_like.algorithms.policy_losses import POLICY_LOSSES, register_policy_loss
from nemo_like.config import SELECTING_KEYS, ConfigError, MasterConfig, load_config, load_yaml_with_provenance
from nemo_like.config_loading import load_yaml_with_defaults, selectors_of
from nemo_like.data.datasets import ArithmeticConfig
from nemo_like.data.reasoning_gym_tasks import ReasoningGymConfig
from nemo_like.models.generation.backends import GENERATION_BACKENDS, register_generation_backend

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "examples" / "configs" / "grpo_math_tiny.yaml"
BOXED = '"{} Put your final answer in \\\\boxed{{}}."'  # as YAML text: a format string asking for \boxed


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def letters_child(tmp_path: Path, dataset: str = "letter_counting") -> Path:
    """The issue's file: the default recipe with its datasets switched to a reasoning-gym generator."""
    return write(tmp_path, f"{dataset}.yaml", f"""defaults: {TINY}
data:
  train:
    generator: {{kind: reasoning_gym, dataset: {dataset}, split: train, num_samples: 100, seed: 1}}
    env_name: reasoning_gym
    task_name: letters
    prompt: {BOXED}
  validation:
    generator: {{kind: reasoning_gym, dataset: letter_counting, split: validation, num_samples: 20, seed: 2}}
    env_name: reasoning_gym
    task_name: letters
    prompt: {BOXED}
""")


def line_of(path: Path, text: str) -> int:
    return next(i for i, line in enumerate(path.read_text().splitlines(), start=1) if text in line)


# --- a generator's kind ------------------------------------------------------------------------
def test_a_child_that_switches_the_generator_kind_replaces_the_parents_generator(tmp_path):
    cfg = load_config(letters_child(tmp_path))  # was: data.train.generator.min_value: unknown config key
    gen = cfg.data.train.generator
    assert isinstance(gen, ReasoningGymConfig)
    assert (gen.dataset, gen.split, gen.num_samples, gen.seed) == ("letter_counting", "train", 100, 1)
    assert isinstance(cfg.data.validation.generator, ReasoningGymConfig)
    # The rest of the dataset entry still merges: the parent's keys outside the generator are kept.
    assert cfg.data.train.answer_key == "expected_answer" and cfg.data.max_input_seq_length == 32


def test_a_child_that_keeps_the_kind_still_merges_into_the_parents_generator(tmp_path):
    child = write(tmp_path, "wider.yaml", f"defaults: {TINY}\ndata:\n  train:\n    generator: {{max_value: 50}}\n")
    gen = load_config(child).data.train.generator
    assert isinstance(gen, ArithmeticConfig)
    assert (gen.max_value, gen.num_samples, gen.ops) == (50, 8000, ["+"])  # the rest from the recipe
    # Naming the parent's kind (left out there: arithmetic) is no change either.
    same = write(tmp_path, "same.yaml", f"defaults: {TINY}\ndata:\n  train:\n    generator: {{kind: arithmetic}}\n")
    assert load_config(same).data.train.generator.num_samples == 8000


def test_the_generator_kind_on_the_command_line_starts_a_new_generator_whatever_the_order(tmp_path):
    rg = ["data.train.generator.dataset=letter_counting", "data.train.generator.split=train",
          "data.train.generator.num_samples=50", "data.train.env_name=reasoning_gym", "data.train.task_name=letters",
          f"data.train.prompt={BOXED}", "data.validation=null"]
    cfg = load_config(TINY, rg + ["data.train.generator.kind=reasoning_gym"])  # the kind last: applied first
    gen = cfg.data.train.generator
    assert isinstance(gen, ReasoningGymConfig) and (gen.dataset, gen.num_samples) == ("letter_counting", 50)
    # Only the kind: the parent's min_value is gone, and what the new kind requires is asked for.
    with pytest.raises(ConfigError) as e:
        load_config(TINY, ["data.train.generator.kind=reasoning_gym"])
    assert "min_value" not in str(e.value)
    assert "data.train.generator.dataset: Field required" in str(e.value)


def test_a_list_of_datasets_replaces_the_parents_list_whole(tmp_path):
    parent = write(tmp_path, "two.yaml", f"""defaults: {TINY}
data:
  train:
    - {{task_name: a, generator: {{split: train, num_samples: 50, seed: 1, min_value: 0, max_value: 9}}}}
    - {{task_name: b, generator: {{split: train, num_samples: 50, seed: 2, min_value: 0, max_value: 9}}}}
""")
    child = write(tmp_path, "child.yaml", f"""defaults: two.yaml
data:
  train:
    - {{task_name: letters, env_name: reasoning_gym, prompt: {BOXED},
       generator: {{kind: reasoning_gym, dataset: letter_counting, split: train, num_samples: 50}}}}
""")
    assert [d.task_name for d in load_config(parent).data.train_list] == ["a", "b"]
    train = load_config(child).data.train_list
    assert [d.task_name for d in train] == ["letters"] and isinstance(train[0].generator, ReasoningGymConfig)


def test_a_misspelled_dataset_in_the_file_gets_the_did_you_mean_the_command_line_gets(tmp_path):
    bad = letters_child(tmp_path, dataset="leter_counting")
    with pytest.raises(ConfigError) as from_file:
        load_config(bad)
    with pytest.raises(ConfigError) as from_cli:
        load_config(letters_child(tmp_path), ["data.train.generator.dataset=leter_counting"])
    message = "data.train.generator: dataset: reasoning-gym has no dataset 'leter_counting' (did you mean " \
              "'letter_counting'"
    assert message in str(from_file.value) and message in str(from_cli.value)
    assert f"(set in {bad}:{line_of(bad, 'leter_counting')})" in str(from_file.value)
    assert str(from_cli.value).endswith("(command line)")


# --- sections that take the options of what they select ---------------------------------------
class ShiftOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    shift: float = Field(0.0, ge=0)


def _shifted(rewards, group_ids, *, config, token_mask=None):
    return rewards - config.shift


def test_a_child_that_changes_the_estimator_drops_the_parents_estimator_options(tmp_path):
    with ADVANTAGE_ESTIMATORS.isolated():
        register_advantage_estimator("shifted", _shifted, options=ShiftOptions)
        parent = write(tmp_path, "parent.yaml", f"defaults: {TINY}\ngrpo: {{advantage_estimator: shifted, shift: 0.5}}\n")
        assert load_config(parent).grpo.model_extra == {"shift": 0.5}
        child = write(tmp_path, "child.yaml", "defaults: parent.yaml\ngrpo: {advantage_estimator: rloo}\n")
        cfg = load_config(child)  # was: grpo.shift: unknown config key
        assert cfg.grpo.advantage_estimator == "rloo" and cfg.grpo.model_extra == {}
        assert cfg.grpo.num_prompts_per_step == 32 and cfg.grpo.dynamic_sampling.enabled  # its own keys stay
        assert load_config(parent, ["grpo.advantage_estimator=rloo"]).grpo.model_extra == {}
        # Keeping the estimator keeps its options.
        keep = write(tmp_path, "keep.yaml", "defaults: parent.yaml\ngrpo: {max_num_steps: 3}\n")
        assert load_config(keep).grpo.model_extra == {"shift": 0.5}


class TauOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    tau: float = Field(1.0, gt=0)


def _soft(curr, prev, advantages, mask, config):
    return -advantages * (curr - prev).exp(), None


def test_a_child_that_changes_the_policy_loss_drops_the_parents_loss_options(tmp_path):
    with POLICY_LOSSES.isolated():
        register_policy_loss("soft", _soft, options=TauOptions)
        parent = write(tmp_path, "parent.yaml", f"defaults: {TINY}\nloss_fn: {{policy_loss: soft, tau: 0.5}}\n")
        assert load_config(parent).loss_fn.model_extra == {"tau": 0.5}
        child = write(tmp_path, "child.yaml", "defaults: parent.yaml\nloss_fn: {policy_loss: ppo_clip}\n")
        cfg = load_config(child)  # was: loss_fn.tau: unknown config key
        assert cfg.loss_fn.policy_loss == "ppo_clip" and cfg.loss_fn.model_extra == {}
        assert cfg.loss_fn.ratio_clip_min == 0.2  # the section's own keys are kept (from grpo_math_base.yaml)
        assert load_config(parent, ["loss_fn.policy_loss=ppo_clip"]).loss_fn.model_extra == {}


class EchoWorker:
    """The shape of a generation backend (a real one wraps an inference engine)."""

    def __init__(self, config, *, seed=0): ...
    def generate(self, data, greedy=False): ...
    def update_weights(self, chunk_refs, version): ...
    def weights_checksum(self): ...
    def policy_version(self): ...
    def pad_token_id(self): ...
    def release_generation_memory(self): ...


class EchoOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    echo_depth: int = 1


def test_a_child_that_changes_the_generation_backend_drops_the_parents_backend_options(tmp_path):
    with GENERATION_BACKENDS.isolated():
        register_generation_backend("echo", EchoWorker, options=EchoOptions)
        parent = write(tmp_path, "parent.yaml", f"""defaults: {TINY}
policy:
  generation: {{backend: echo, colocated: false, echo_depth: 3}}
""")
        assert load_config(parent).policy.generation.model_extra == {"echo_depth": 3}
        child = write(tmp_path, "child.yaml", "defaults: parent.yaml\npolicy:\n  generation: {backend: hf}\n")
        gen = load_config(child).policy.generation  # was: policy.generation.echo_depth: unknown config key
        assert gen.backend == "hf" and gen.model_extra == {} and gen.colocated is False and gen.max_new_tokens == 16
        assert load_config(parent, ["policy.generation.backend=hf"]).policy.generation.model_extra == {}


def test_the_selectors_are_found_in_the_schema():
    sel = selectors_of(MasterConfig, SELECTING_KEYS)
    for path in (("data", "train", "generator"), ("data", "validation", "generator"), ("bootstrap", "data", "generator")):
        assert sel[path].keys == ("kind",) and sel[path].defaults == ("arithmetic",) and sel[path].keep is None
    assert sel[("grpo",)].keys == ("advantage_estimator",) and "num_prompts_per_step" in sel[("grpo",)].keep
    assert sel[("loss_fn",)].keys == ("name", "policy_loss") and sel[("policy", "generation")].keys == ("backend",)
    # Without a schema (or for a section it does not describe) a plain merge, as before.
    assert load_yaml_with_defaults(TINY)["data"]["train"]["generator"]["max_value"] == 99


# --- where a key came from ----------------------------------------------------------------------
def test_an_inherited_bad_key_names_the_parent_file_and_line(tmp_path):
    parent = write(tmp_path, "parent.yaml", f"defaults: {TINY}\npolicy:\n  num_thread: 2\n")
    child = write(tmp_path, "child.yaml", "defaults: parent.yaml\ngrpo: {max_num_steps: 3}\n")
    with pytest.raises(ConfigError, match=re.escape(f"policy.num_thread: unknown config key (inherited from "
                                                    f"{parent}:3)")):
        load_config(child)
    with pytest.raises(ConfigError, match=re.escape(f"policy.num_thread: unknown config key (set in {parent}:3)")):
        load_config(parent)


def test_an_override_is_named_as_the_command_line_and_each_key_of_a_message_gets_its_origin(tmp_path):
    with pytest.raises(ConfigError, match=re.escape("policy.optimizer.lr: Input should be a valid number, unable "
                                                    "to parse string as a number (got 'abc') (command line)")):
        load_config(TINY, ["policy.optimizer.lr=abc"])
    with pytest.raises(ConfigError) as e:
        load_config(TINY, ["grpo.num_generations_per_prompt=3"])
    line = line_of(TINY, "train_global_batch_size")
    assert re.search(rf"policy.train_global_batch_size: set in \S*grpo_math_tiny.yaml:{line}; ", str(e.value))
    assert "grpo.num_generations_per_prompt: command line" in str(e.value)


def test_provenance_follows_keys_through_the_chain_and_forgets_replaced_ones(tmp_path):
    child = letters_child(tmp_path)
    _, prov = load_yaml_with_provenance(child, MasterConfig, SELECTING_KEYS)
    assert prov.describe("data.train.generator.dataset") == f"set in {child}:{line_of(child, 'letter_counting')}"
    assert prov.describe("data.train.generator.min_value") is None  # replaced with the parent's generator
    base = ROOT / "examples" / "configs" / "grpo_math_base.yaml"
    assert prov.describe("loss_fn.ratio_clip_min").startswith("inherited from ") and base.name in \
        prov.describe("loss_fn.ratio_clip_min")


def test_a_cpus_per_worker_the_user_did_not_write_says_what_to_set_and_where_it_came_from(tmp_path):
    child = write(tmp_path, "pools.yaml", f"""defaults: {TINY}
cluster:
  num_workers: 2
  resource_pools: {{main: {{nodes: 1, cpus_per_node: 2}}}}
  roles: {{policy: main}}
""")
    with pytest.raises(ConfigError) as e:
        load_config(child)
    msg = str(e.value)
    assert "cluster.cpus_per_worker=2: on pool 'main' each policy worker gets 1 CPU(s)" in msg
    assert "set cluster.cpus_per_worker=1" in msg and "cluster.resource_pools.main.cpus_per_node=4" in msg
    assert "remove the key" not in msg
    line = line_of(TINY, "cpus_per_worker")
    assert re.search(rf"cluster.cpus_per_worker: inherited from \S*examples/configs/grpo_math_tiny.yaml:{line}; ", msg)
    assert f"cluster.resource_pools.main.cpus_per_node: set in {child}:4" in msg
    # Either fix loads.
    assert load_config(child, ["cluster.cpus_per_worker=1"]).cluster.cpus_per_worker == 1
    assert load_config(child, ["cluster.resource_pools.main.cpus_per_node=4"]).cluster.cpus_per_worker == 2


def test_a_bad_key_in_an_item_of_a_list_of_datasets_is_named_with_its_index_and_line(tmp_path):
    child = write(tmp_path, "list.yaml", f"""defaults: {TINY}
data:
  train:
    - {{task_name: a, generator: {{split: train, num_samples: 50, seed: 1, max_value: 9}}}}
    - {{task_name: b, generator: {{kind: tool, split: train, num_samples: 50, seed: 1, min_value: 3}}}}
""")
    # Not pydantic's other branch of `DatasetConfig | list[DatasetConfig]` ("should be a valid dictionary").
    with pytest.raises(ConfigError, match=re.escape(f"invalid config: data.train.1.generator.min_value: unknown "
                                                    f"config key (set in {child}:5)")):
        load_config(child)


def test_gym_and_reward_model_configs_name_where_a_bad_key_came_from(tmp_path):
    from nemo_like.algorithms.rm import load_rm_config
    from nemo_like.gym.config import load_gym_config

    examples = Path(__file__).resolve().parents[2] / "examples" / "configs"
    (tmp_path / "gym.yaml").write_text(f"defaults: {examples / 'grpo_cartpole.yaml'}\ngrpo:\n  max_num_stepz: 3\n")
    with pytest.raises(ConfigError, match=r"grpo.max_num_stepz: unknown config key.*grpo.max_num_stepz: set in .*gym.yaml:3"):
        load_gym_config(tmp_path / "gym.yaml")
    (tmp_path / "rm.yaml").write_text(f"defaults: {examples / 'rm_math_tiny.yaml'}\n")
    with pytest.raises(ConfigError, match=r"\(command line\)"):
        load_rm_config(tmp_path / "rm.yaml", ["reward_model.train_global_batch_size=-1"])


def test_a_gym_child_leaves_gae_by_turning_the_inherited_value_loss_off(tmp_path):
    from nemo_like.gym.config import load_gym_config

    ppo = Path(__file__).resolve().parents[2] / "examples" / "configs" / "ppo_cartpole.yaml"
    (tmp_path / "grpo.yaml").write_text(f"defaults: {ppo}\ngrpo: {{advantage_estimator: mean_std}}\n"
                                        "loss_fn: {vf_coef: null}\n")
    cfg = load_gym_config(tmp_path / "grpo.yaml")  # was refused: an inherited vf_coef could not be removed
    assert cfg.grpo.advantage_estimator == "mean_std" and "vf_coef" not in cfg.loss_fn
    with pytest.raises(ConfigError, match=r"set loss_fn.vf_coef: null \(or leave it out\)"):
        load_gym_config(ppo, ["grpo.advantage_estimator=mean_std"])
