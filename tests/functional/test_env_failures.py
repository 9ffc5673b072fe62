"""Runs that cannot learn stop, loudly: an environment that cannot start fails setup, grading that
fails for every sample step after step stops the run (exit code 1, one line), and a hung grader
costs one time-limited call, not the run. Real Ray, the real trainer and real actors; the faults
are injected by environments registered here, as a user would register their own."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from nemo_like import GRPOExperiment
from nemo_like.environments import registry
from nemo_like.environments.interfaces import EnvironmentInterface
from nemo_like.environments.math_environment import MathEnvConfig, MathEnvironment
from nemo_like.environments.supervision import EnvironmentStartError
from nemo_like.models.policy.backends import POLICY_BACKENDS, register_policy_backend
from nemo_like.models.policy.hf_worker import HFPolicyWorker

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "examples" / "configs" / "grpo_math_tiny.yaml"


def _overrides(tmp: Path, model: str, *extra: str) -> list[str]:
    """``model``: ``policy.model_name=<model_dir>`` (the untrained tiny model: these runs check what
    happens to grading, not what is learned, so no base model is bootstrapped) or a bootstrap.cache_dir."""
    return [
        "grpo.num_prompts_per_step=2", "grpo.num_generations_per_prompt=4", "grpo.dynamic_sampling.enabled=false",
        "grpo.max_num_steps=3",
        "grpo.val_period=0", "grpo.val_at_start=false", "grpo.val_at_end=false",
        "policy.train_global_batch_size=8", "policy.train_micro_batch_size=8",
        "policy.logprob_batch_size=8", "policy.generation_batch_size=8",
        "data.train.generator.num_samples=50", "data.validation.generator.num_samples=4",
        "bootstrap.model.hidden_size=32", "bootstrap.model.num_layers=1",
        "bootstrap.sft.num_steps=2", "bootstrap.sft.batch_size=16", "bootstrap.sft.micro_batch_size=16",
        "bootstrap.num_workers=1", model,
        f"logger.log_dir={tmp / 'logs'}", "logger.tensorboard_enabled=false",
        f"checkpointing.checkpoint_dir={tmp / 'ckpt'}", "checkpointing.enabled=false",
        *extra,
    ]


@pytest.fixture
def own_registry():
    """Environments registered by a test stay in that test."""
    with registry.ENV_REGISTRY.isolated():
        yield


class FailsToStart(MathEnvironment):
    def __init__(self, config=None):
        raise RuntimeError("the grading service is unreachable")


class HangsOnceConfig(MathEnvConfig):
    hang_marker: str


class HangsOnce(MathEnvironment):
    """Grades like the math environment, except that its first call ever (a marker file) hangs."""

    config_model = HangsOnceConfig  # a user environment with its own typed option

    def __init__(self, config):
        config = dict(config)
        self.marker = config.pop("hang_marker")
        super().__init__(config)

    def step(self, message_log_batch, metadata):
        if not os.path.exists(self.marker):
            open(self.marker, "w").close()
            time.sleep(3600)
        return super().step(message_log_batch, metadata)


def _live_actors() -> int:
    from ray._private.state import actors

    return sum(1 for a in actors().values() if a["State"] != "DEAD")


def test_environment_that_cannot_start_fails_setup_naming_it(ray_session, tmp_path, own_registry):
    registry.register_env("math", FailsToStart, overwrite=True)
    before = _live_actors()
    t0 = time.monotonic()
    fresh = tmp_path / "fresh_cache"  # no base model built yet
    with pytest.raises(EnvironmentStartError) as info:
        GRPOExperiment(str(CONFIG), _overrides(tmp_path, f"bootstrap.cache_dir={fresh}"))
    assert str(info.value) == ("environment 'math' (task 'math') failed to start: "
                               "RuntimeError: the grading service is unreachable")
    assert time.monotonic() - t0 < 120  # at setup, not after a run of zero rewards
    # Checked first: before the base model is built (minutes on a first run) or the workers start.
    assert not fresh.exists() or not any(fresh.iterdir())
    deadline = time.monotonic() + 20
    while _live_actors() > before and time.monotonic() < deadline:  # ray.kill is asynchronous
        time.sleep(0.2)
    assert _live_actors() == before  # setup freed what it had started


@pytest.mark.parametrize("stream", [False, True], ids=["turn-by-turn", "streamed"])
def test_hung_grader_is_cut_off_and_the_run_goes_on(ray_session, tmp_path, model_dir, own_registry, stream):
    registry.register_env("math", HangsOnce, overwrite=True)
    model = f"policy.model_name={model_dir}"
    with GRPOExperiment(str(CONFIG), _overrides(tmp_path, model, "++env.math.step_timeout_s=3", "grpo.max_num_steps=2",
                                                 f"++env.math.hang_marker={tmp_path / 'hung'}",
                                                 f"policy.generation.stream_episodes={str(stream).lower()}")) as exp:
        assert exp.trainer.generator.streams_episodes() is stream
        t0 = time.monotonic()
        first = exp.step()
        assert time.monotonic() - t0 < 60
        assert (tmp_path / "hung").exists()
        timeouts = first["train/env/math/step_timeouts"]
        if stream:  # only the samples of the hung call are lost; the rest go to the restarted actor
            assert 1 <= timeouts <= 8 and first["train/unscorable_frac"] == timeouts / 8
        else:
            assert timeouts == 8.0  # every sample of the step, counted
            assert first["train/unscorable_frac"] == 1.0 and first["train/advantage_abs_mean"] == 0.0
        second = exp.step()  # graded by the restarted actor
        assert "train/env/math/step_timeouts" not in second and second["train/unscorable_frac"] == 0.0


class Down(EnvironmentInterface):
    def __init__(self, config=None):
        pass

    def step(self, message_log_batch, metadata):
        raise ConnectionError("grader service down")


def test_run_whose_grading_keeps_failing_exits_1_naming_the_task_and_error(ray_session, tmp_path, model_dir,
                                                                           own_registry, capsys):
    from nemo_like.cli import run_cli, run_grpo

    # What a user's script does (register the environment, then the CLI's run_cli), in this process on
    # the session's Ray: a script of its own started a second Ray and took ~30 s.
    registry.register_env("math", Down, overwrite=True)
    code = run_cli(_overrides(tmp_path, f"policy.model_name={model_dir}", "grpo.max_num_steps=10",
                              "grpo.max_consecutive_env_failures=2"), str(CONFIG), run_grpo)
    err = capsys.readouterr().err
    assert code == 1, err[-3000:]
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert errors == ["error: task 'math': grading failed for every sample in 2 consecutive steps "
                      "(grpo.max_consecutive_env_failures=2); first error: ConnectionError: grader service down"]
    # It stopped at the second step: one step was trained (on nothing: every sample unscorable).
    rows = [json.loads(line) for line in (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "train/unscorable_frac" in r]
    assert [r["step"] for r in steps] == [1] and steps[0]["train/unscorable_frac"] == 1.0
    assert steps[0]["train/env/math/step_errors"] == 8.0



class TrainHangsAtTheThirdStep(HFPolicyWorker):
    """The HF worker, except that its third training call never returns (as a rank stuck in a
    collective would)."""

    trained = 0

    def train(self, *args, **kwargs):
        type(self).trained += 1
        if type(self).trained == 3:
            time.sleep(3600)
        return super().train(*args, **kwargs)


def test_a_run_that_stops_making_progress_prints_stacks_and_exits_5_naming_its_wait(
        ray_session, tmp_path, model_dir, own_registry, capfd):
    """A policy worker that hangs in its third update: the stall watch trips at 3 x the median step (at
    least 3 s), the stacks are printed, and the run ends with one line
    naming the rank and method it waited for, exit code 5; nothing stays running."""
    from nemo_like.cli import run_cli, run_grpo

    before = _live_actors()
    t0 = time.monotonic()
    with POLICY_BACKENDS.isolated():
        register_policy_backend("hangs", TrainHangsAtTheThirdStep)
        code = run_cli(_overrides(tmp_path, f"policy.model_name={model_dir}", "grpo.max_num_steps=10",
                                  "policy.backend=hangs", "grpo.stall_watch.factor=3", "grpo.stall_watch.min_s=3",
                                  "grpo.stall_watch.after=2"), str(CONFIG), run_grpo)
    err = capfd.readouterr().err
    assert code == 5, err[-3000:]
    assert time.monotonic() - t0 < 120
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and errors[0].startswith("error: stalled: step 3 ran past "), errors
    assert "waiting for policy rank 0 (TrainHangsAtTheThirdStep policy-0-" in errors[0] and "in 'train'" in errors[0]
    assert errors[0].endswith("resume from the start: checkpointing is off")
    assert "step 3 has run" in err and "--- driver thread MainThread" in err and "in get_all_worker_results" in err
    rows = [json.loads(line) for line in (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "train/loss" in r] == [1, 2]
    deadline = time.monotonic() + 20
    while _live_actors() > before and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _live_actors() == before
