"""Config loading: defaults inheritance, overrides, and one-line errors that name the key/file."""

from __future__ import annotations

import runpy
import subprocess
import sys
from pathlib import Path

import pytest

from nemo_like.config import ConfigError, apply_overrides, load_config, load_yaml_with_defaults, parse_cli

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "examples" / "configs" / "grpo_math_tiny.yaml"


def test_example_configs_validate():
    tiny = load_config(TINY)
    assert tiny.policy.train_global_batch_size == 128
    assert tiny.grpo.val_period == 25 and tiny.grpo.dynamic_sampling.enabled  # from the tiny file
    assert tiny.loss_fn.ratio_clip_min == 0.2  # inherited from grpo_math_base.yaml
    big = load_config(ROOT / "examples" / "configs" / "grpo_math_1B.yaml")
    assert big.policy.model_name == "Qwen/Qwen2.5-1.5B" and big.policy.precision == "bfloat16"
    assert big.data.train.path.startswith("hf:")


def test_auto_schedule_spans_the_run():
    # 32 prompts x 8 = 256 completions, global batch 128: two optimizer steps per GRPO step.
    assert load_config(TINY).policy.scheduler.total_steps == 250 * 2
    longer = load_config(TINY, ["grpo.max_num_steps=100", "policy.train_global_batch_size=64"])
    assert longer.policy.scheduler.decay == "linear" and longer.policy.scheduler.total_steps == 100 * 4
    assert load_config(TINY, ["grpo.max_num_steps=0"]).policy.scheduler.total_steps == 1  # still a valid schedule
    # grpo.ppo_epochs passes over each batch: that many optimizer steps more.
    assert load_config(TINY, ["grpo.ppo_epochs=3"]).policy.scheduler.total_steps == 250 * 2 * 3
    fixed = load_config(TINY, ["policy.scheduler.total_steps=50"])
    assert fixed.policy.scheduler.total_steps == 50
    with pytest.raises(ConfigError, match="policy.scheduler.total_steps"):
        load_config(TINY, ["policy.scheduler.total_steps=soon"])
    # The critic's: its own global batch and passes (64 x 2 = 128 completions; 2 batches of 64, 2 passes).
    ppo = ROOT / "examples" / "configs" / "ppo_math_tiny.yaml"
    critic = load_config(ppo, ["critic.scheduler.decay=linear", "critic.scheduler.total_steps=auto",
                               "critic.ppo_epochs=2", "critic.train_global_batch_size=64"]).critic
    assert critic.scheduler.total_steps == 100 * 2 * 2
    same_batch = load_config(ppo, ["critic.scheduler.decay=cosine", "critic.scheduler.total_steps=auto"]).critic
    assert same_batch.scheduler.total_steps == 100 * max(1, 128 // load_config(ppo).policy.train_global_batch_size)


def test_defaults_chain_and_cycle(tmp_path):
    (tmp_path / "a.yaml").write_text("x: {y: 1, z: 2}\n")
    (tmp_path / "b.yaml").write_text("defaults: a.yaml\nx: {y: 5}\n")
    assert load_yaml_with_defaults(tmp_path / "b.yaml") == {"x": {"y": 5, "z": 2}}
    (tmp_path / "c.yaml").write_text("defaults: d.yaml\n")
    (tmp_path / "d.yaml").write_text("defaults: c.yaml\n")
    with pytest.raises(ConfigError, match="cycle"):
        load_yaml_with_defaults(tmp_path / "c.yaml")


def test_overrides_parse_yaml_values():
    cfg = load_config(TINY, ["grpo.max_num_steps=7", "policy.optimizer.lr=1e-5", "policy.generation.top_k=5",
                             "loss_fn.ratio_clip_c=3"])
    assert cfg.grpo.max_num_steps == 7
    assert cfg.policy.optimizer.lr == pytest.approx(1e-5)
    assert cfg.policy.generation.top_k == 5  # not in the YAML, but a schema key
    assert cfg.loss_fn.ratio_clip_c == 3


@pytest.mark.parametrize(
    "override, expected",
    [
        # grpo takes the selected estimator's options, so the key is checked when the config is validated.
        ("grpo.num_prompt_per_step=3", r"grpo.num_prompt_per_step: unknown config key \(did you mean grpo.num_prompts_per_step\?\)"),
        ("policy.num_thread=3", r"unknown config key 'policy.num_thread' \(did you mean policy.num_threads\?\)"),
        ("policy.optimizer.lr=abc", r"policy.optimizer.lr: Input should be a valid number.*'abc'"),
        ("++foo.bar=1", r"foo: unknown config key"),
        ("policy.train_global_batch_size=100", r"train_global_batch_size \(100\) is not divisible by grpo.num_generations_per_prompt \(8\)"),
        ("grpo.num_prompts_per_step=3", r"3\) x grpo.num_generations_per_prompt \(8\) = 24 completions per step is not a multiple of policy.train_global_batch_size \(128\)"),
        ("loss_fn.ratio_clip_c=0.5", r"ratio_clip_c"),
        ("grpo.num_generations_per_prompt=1", r"num_generations_per_prompt"),
        ("data.max_input_seq_length=48", r"leaves no room to generate"),
        ("noequals", r"expected key=value"),
    ],
)
def test_bad_overrides_name_the_key(override, expected):
    with pytest.raises(ConfigError, match=expected):
        load_config(TINY, [override])


def test_yaml_syntax_error_names_file_and_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("grpo:\n  seed: 1\n  x: [1, 2\n")
    with pytest.raises(ConfigError, match=rf"{bad}:\d+: invalid YAML"):
        load_config(bad)
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "missing.yaml")


def test_parse_cli():
    assert parse_cli(["--config", "x.yaml", "a.b=1", "++c=2"], "d.yaml") == ("x.yaml", ["a.b=1", "++c=2"])
    assert parse_cli([], "d.yaml") == ("d.yaml", [])
    with pytest.raises(ConfigError, match="unexpected argument"):
        parse_cli(["oops"], "d.yaml")


def test_apply_overrides_force_adds_nested():
    assert apply_overrides({"a": {}}, ["++a.b.c=[1, 2]"]) == {"a": {"b": {"c": [1, 2]}}}


@pytest.fixture
def cli(tmp_path, monkeypatch, capsys):
    """examples/run_grpo_math.py's main(argv), run in this process from tmp_path: (exit code, stderr).
    Each case fails before Ray or a worker starts, so no process is needed (see the test below)."""
    import ray

    main = runpy.run_path(str(ROOT / "examples" / "run_grpo_math.py"))["main"]
    monkeypatch.chdir(tmp_path)

    def run(*args: str) -> tuple[int, str]:
        capsys.readouterr()
        ray_was_up = ray.is_initialized()  # (a full run's session Ray may be up already)
        code = main(list(args))
        assert ray.is_initialized() == ray_was_up  # it stopped at the config: no Ray of its own
        return code, capsys.readouterr().err

    return run


@pytest.mark.parametrize(
    "args, message",
    [
        (["grpo.max_num_step=3"], "grpo.max_num_step: unknown config key (did you mean grpo.max_num_steps?)"),
        (["data.train.path=/nonexistent/rows.jsonl", "++data.train.generator=null"], "/nonexistent/rows.jsonl: file not found"),
        # Environment options are typed too (env.<name> against the environment's config_model).
        (["env.math.timeout=3"], "env.math.timeout: unknown config key (did you mean env.math.timeout_s?)"),
        (["env.math.timeout_s=abc"], "env.math.timeout_s: Input should be a valid number (got 'abc')"),
        (["env.math.step_timeout_s=0"], "env.math.step_timeout_s: Input should be greater than 0"),
        (["loss_fn.name=clipped_pgg"], "loss_fn.name: unknown loss 'clipped_pgg' (did you mean 'clipped_pg'?)"),
        (["grpo.advantage_estimator=rlo"], "grpo.advantage_estimator: unknown advantage estimator 'rlo' (did you mean 'rloo'?)"),
        (["grpo.dynamic_sampling.max_gen_batche=2"], "did you mean grpo.dynamic_sampling.max_gen_batches?"),
        # A user module that does not import is named, before anything starts.
        (["--import", "no_such_module_xyz"], "imports: cannot import 'no_such_module_xyz': ModuleNotFoundError"),
        (["loss_fn.policy_loss=soft_clip"], "loss_fn.policy_loss: unknown policy loss 'soft_clip'"),
    ],
)
def test_cli_exits_2_with_one_line(args, message, tmp_path, cli):
    code, err = cli(*args, f"logger.log_dir={tmp_path}")
    assert code == 2, err
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], err


def test_the_cli_script_as_a_process_exits_2_with_one_line(tmp_path):
    # The cases above call the script's main() in this process (a fresh interpreter importing torch
    # cost ~2.7 s a case); this one runs the script itself: sys.exit carries main's code out, and
    # nothing else the process imports writes to stderr.
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "run_grpo_math.py"), "grpo.max_num_step=3",
                           f"logger.log_dir={tmp_path}"], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert "grpo.max_num_step: unknown config key (did you mean grpo.max_num_steps?)" in lines[0], proc.stderr


def test_cli_malformed_jsonl_names_line(tmp_path, cli):
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"problem": "1+1=", "expected_answer": "2"}\n{"problem": oops}\n')
    code, err = cli(f"data.train.path={rows}", "++data.train.generator=null", f"logger.log_dir={tmp_path}")
    assert code == 2
    assert f"{rows}:2: invalid JSON" in err


@pytest.fixture
def own_env_registry():
    """Environments registered by a test stay in that test."""
    from nemo_like.environments.registry import ENV_REGISTRY

    with ENV_REGISTRY.isolated():
        yield


def test_env_options_are_checked_against_the_environment_config_model(own_env_registry):
    from pydantic import Field

    from nemo_like.environments import registry
    from nemo_like.environments.env_config import EnvConfig
    from nemo_like.environments.math_environment import MathEnvironment

    assert load_config(TINY, ["env.math.timeout_s=3"]).env["math"] == {"timeout_s": 3}

    class Untyped(MathEnvironment):  # a user environment that takes its mapping unchecked
        config_model = None

    registry.register_env("untyped", Untyped)
    assert load_config(TINY, ["++env.untyped.anything=1"]).env["untyped"] == {"anything": 1}

    class TypedConfig(EnvConfig):
        rounds: int = Field(3, ge=1)

    class Typed(MathEnvironment):
        config_model = TypedConfig

    registry.register_env("typed", Typed)
    assert load_config(TINY, ["++env.typed.rounds=2"]).env["typed"] == {"rounds": 2}
    with pytest.raises(ConfigError, match=r"env.typed.rounds: Input should be greater than or equal to 1 \(got 0\)"):
        load_config(TINY, ["++env.typed.rounds=0"])
    with pytest.raises(ConfigError, match=r"env.typed.round: unknown config key \(did you mean env.typed.rounds\?\)"):
        load_config(TINY, ["++env.typed.round=2"])
    # Not registered (yet): nothing to check it against, so the options pass as they are.
    assert load_config(TINY, ["++env.later.x=1"]).env["later"] == {"x": 1}


def test_a_dataset_whose_processor_nobody_registered_is_a_config_error(own_env_registry):
    from nemo_like.environments import registry
    from nemo_like.environments.math_environment import MathEnvironment

    registry.register_env("my_task", MathEnvironment)
    # A processor named but not registered: found here, not deep in setup after Ray started.
    with pytest.raises(ConfigError, match=r"data.train.processor \(task 'math'\): no data processor 'my_tsk' is "
                                          r"registered; set data.train.processor=math"):
        load_config(TINY, ["data.train.env_name=my_task", "data.train.processor=my_tsk"])
    # None given: an environment of the user's without a processor of its name grades prompt-only rows.
    assert load_config(TINY, ["data.train.env_name=my_task"]).data.train_list[0].processor == "math"
    cfg = load_config(TINY, ["data.train.env_name=my_task", "data.train.processor=math",
                             "data.validation.env_name=my_task", "data.validation.processor=math"])
    assert cfg.data.train_list[0].processor == "math"


def test_your_own_model_turns_the_bootstrap_off_out_loud(tmp_path, capsys):
    folder = tmp_path / "my_model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    cfg = load_config(TINY, [f"policy.model_name={folder}"])
    assert cfg.bootstrap is not None and not cfg.bootstrap.enabled and cfg.policy.model_name == str(folder)
    err = capsys.readouterr().err
    assert f"policy.model_name={folder}: training that model; bootstrap.enabled set to false" in err
    # The default names the bootstrapped model and builds it; nothing printed.
    assert load_config(TINY).bootstrap.enabled and "bootstrap" not in capsys.readouterr().err
    # The tiny model's placeholder with the bootstrap off is an error that says what to do.
    with pytest.raises(ConfigError, match="'bootstrap:tiny-math' names the embedded tiny model, .* set "
                                          "bootstrap.enabled=true, or name your model"):
        load_config(TINY, ["bootstrap.enabled=false"])


def test_own_model_on_the_cli_trains_that_model_not_the_tiny_one(tmp_path, cli):
    # A missing model folder now fails as that folder (before Ray), proving the bootstrap did not replace it.
    code, err = cli(f"policy.model_name={tmp_path / 'nope'}", f"logger.log_dir={tmp_path}")
    assert code == 2, err
    assert "bootstrap.enabled set to false" in err
    assert f"error: invalid config: policy.model_name: {tmp_path / 'nope'}" in err


def test_own_model_wins_in_a_config_built_from_objects(tmp_path, capsys):
    from nemo_like.config import BootstrapConfig, MasterConfig
    from nemo_like.models.policy.interfaces import PolicyConfig

    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    tiny = load_config(TINY)
    cfg = MasterConfig(policy=PolicyConfig(model_name=str(folder)), data=tiny.data, bootstrap=BootstrapConfig())
    assert not cfg.bootstrap.enabled and "bootstrap.enabled set to false" in capsys.readouterr().err


def test_a_saved_run_of_the_bootstrapped_model_keeps_the_bootstrap_on(tmp_path, capsys):
    # setup() records the bootstrapped folder as policy.model_name; resuming must not read it as "your model".
    cache = tmp_path / "cache"
    built = cache / "tiny-math-0123456789ab"
    built.mkdir(parents=True)
    (built / "config.json").write_text("{}")
    cfg = load_config(TINY, [f"bootstrap.cache_dir={cache}", f"policy.model_name={built}"])
    assert cfg.bootstrap.enabled and "bootstrap.enabled set to false" not in capsys.readouterr().err
