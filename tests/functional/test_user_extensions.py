"""A contributor's exercise, from outside the package: a policy-loss surrogate, an advantage estimator,
an environment, a generation backend and a training worker, each one file of
``examples/extensions/my_extensions`` with its registration (and an options model, or a config check,
of its own), reach a GRPO run through the CLI's ``--import`` with no edit to a schema of ours. One run
uses all five (each says where it ran in a trace file); each kind's test then checks its own evidence,
and that its options are checked before Ray starts."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from nemo_like.algorithms.advantages import ADVANTAGE_ESTIMATORS
from nemo_like.algorithms.policy_losses import POLICY_LOSSES
from nemo_like.config import ConfigError, load_config
from nemo_like.environments.registry import ENV_REGISTRY
from nemo_like.models.generation.backends import GENERATION_BACKENDS
from nemo_like.models.policy.backends import POLICY_BACKENDS

# One shared GRPO run (over 15 s) that every test here reads: run by `uv run pytest -m slow`.
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
EXT = ROOT / "examples" / "extensions"
CONFIG = ROOT / "examples" / "configs" / "grpo_math_tiny.yaml"
MODULES = "my_extensions.soft_clip_loss,my_extensions.median_baseline,my_extensions.exact_answer_env," \
          "my_extensions.chunked_backend,my_extensions.frozen_embeddings_worker"
SMALL = [
    "grpo.num_prompts_per_step=2", "grpo.num_generations_per_prompt=4", "grpo.dynamic_sampling.enabled=false",
    "grpo.max_num_steps=2", "grpo.val_period=0", "grpo.max_val_samples=4",
    "policy.train_global_batch_size=8", "policy.train_micro_batch_size=8",
    "policy.logprob_batch_size=8", "policy.generation_batch_size=8", "policy.generation.max_new_tokens=8",
    "data.train.generator.num_samples=40", "data.validation.generator.num_samples=4",
    "logger.tensorboard_enabled=false", "checkpointing.enabled=false",
    "cluster.cpus_per_worker=1", "cluster.generation.cpus_per_worker=0.5",
]
USE_ALL = [
    "loss_fn.policy_loss=soft_clip", "loss_fn.tau=0.5",
    "grpo.advantage_estimator=median_baseline", "grpo.median_scale=2.0",
    "data.train.env_name=exact_answer", "data.train.processor=math",
    "data.validation.env_name=exact_answer", "data.validation.processor=math",
    "++env.exact_answer.format_reward=0.25",
    "policy.generation.colocated=false", "policy.generation.backend=chunked", "policy.generation.chunk_rows=3",
    "policy.backend=frozen_embeddings",
]


@pytest.fixture(scope="module")
def run(tmp_path_factory, model_dir):
    """The CLI, started in the user's folder (not ours), with the five modules imported by --import."""
    tmp = tmp_path_factory.mktemp("ext")
    trace = tmp / "trace.txt"
    env = dict(os.environ, MY_EXTENSIONS_TRACE=str(trace))
    env.pop("PYTHONPATH", None)  # the modules are found from the working directory, as a user's are
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "run_grpo_math.py"), "--import", MODULES, *SMALL, *USE_ALL,
         # The untrained tiny model (no bootstrap SFT, ~6 s): each extension's evidence is where and
         # with which options it ran, not what the model learned.
         f"policy.model_name={model_dir}", f"logger.log_dir={tmp / 'logs'}"],
        cwd=EXT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [line.split(" ", 2) for line in trace.read_text().splitlines()]
    rows = [json.loads(line) for line in (tmp / "logs" / "metrics.jsonl").read_text().splitlines()]
    saved = yaml.safe_load((tmp / "logs" / "config.yaml").read_text())
    # The estimator runs in the driver: its pid is the driver's.
    driver = {int(pid) for kind, pid, _ in lines if kind == "estimator"}
    assert len(driver) == 1, lines
    return {"trace": lines, "rows": rows, "config": saved, "driver": driver.pop()}


def _kinds(run, kind: str) -> list[tuple[int, str]]:
    return [(int(pid), detail) for k, pid, detail in run["trace"] if k == kind]


def _load(*overrides: str):
    with POLICY_LOSSES.isolated(), ADVANTAGE_ESTIMATORS.isolated(), ENV_REGISTRY.isolated(), \
            GENERATION_BACKENDS.isolated(), POLICY_BACKENDS.isolated():
        sys.path.insert(0, str(EXT))
        try:
            return load_config(CONFIG, [f"imports+={m}" for m in MODULES.split(",")] + list(overrides))
        finally:
            sys.path.remove(str(EXT))
            for name in [m for m in sys.modules if m.startswith("my_extensions")]:
                del sys.modules[name]  # the next test imports (and so registers) them again


def test_a_policy_loss_with_its_own_option(run):
    calls = _kinds(run, "policy_loss")
    assert calls and {d for _, d in calls} == {"tau=0.5"}  # called in the training worker, with the typed option
    assert all(pid != run["driver"] for pid, _ in calls)
    assert run["config"]["loss_fn"]["policy_loss"] == "soft_clip" and run["config"]["loss_fn"]["tau"] == 0.5
    assert _load("loss_fn.policy_loss=soft_clip").loss_fn.tau == 0.2  # the declared default
    with pytest.raises(ConfigError, match=r"loss_fn\.tau: Input should be greater than 0.*soft_clip"):
        _load("loss_fn.policy_loss=soft_clip", "loss_fn.tau=0")
    with pytest.raises(ConfigError, match=r"loss_fn\.taux: unknown config key \(did you mean loss_fn\.tau\?\)"):
        _load("loss_fn.policy_loss=soft_clip", "loss_fn.taux=1")


def test_an_advantage_estimator_with_its_own_option(run):
    calls = _kinds(run, "estimator")
    assert len(calls) >= 2 and {d for _, d in calls} == {"median_scale=2.0"}  # once a step, or more
    # Rewards are 0, 0.25 or 1 and the scale is 2: every advantage is a difference of two of them, times 2.
    assert all(abs(r["train/advantage_abs_mean"]) <= 2.0 for r in run["rows"] if "train/advantage_abs_mean" in r)
    with pytest.raises(ConfigError, match=r"grpo\.median_scale: Input should be greater than 0"):
        _load("grpo.advantage_estimator=median_baseline", "grpo.median_scale=-1")
    with pytest.raises(ConfigError, match=r"grpo\.median_scale: unknown config key"):
        _load("grpo.median_scale=2.0")  # an option of an estimator the run does not use


def test_an_environment_with_its_own_config(run):
    calls = _kinds(run, "environment")
    assert calls and {d for _, d in calls} == {"format_reward=0.25"}  # built in its actor with the typed config
    assert all(pid != run["driver"] for pid, _ in calls)
    rewards = [r["train/reward_mean"] for r in run["rows"] if "train/reward_mean" in r]
    assert len(rewards) == 2 and all(0.0 <= x <= 1.0 for x in rewards)
    with pytest.raises(ConfigError, match=r"env\.exact_answer\.format_rewad: unknown config key "
                                          r"\(did you mean env\.exact_answer\.format_reward\?\)"):
        _load("data.train.env_name=exact_answer", "data.train.processor=math", "++env.exact_answer.format_rewad=1")


def test_a_generation_backend_with_its_own_option(run):
    calls = _kinds(run, "backend")
    assert calls and all(d.startswith("chunk_rows=3 ") for _, d in calls)
    # 8 samples a step in chunks of 3: 3 chunks; validation's 4 in 2.
    assert {d for _, d in calls} >= {"chunk_rows=3 rows=8 chunks=3"}
    assert all(pid != run["driver"] for pid, _ in calls)
    with pytest.raises(ConfigError, match=r"policy\.generation\.chunk_rows: Input should be greater than 0"):
        _load("policy.generation.colocated=false", "policy.generation.backend=chunked", "policy.generation.chunk_rows=0")
    with pytest.raises(ConfigError, match=r"backend 'chunked' cannot stream episodes"):
        _load("policy.generation.colocated=false", "policy.generation.backend=chunked",
              "policy.generation.stream_episodes=true")


def test_a_training_worker_with_its_own_checks(run):
    built = [(pid, dict(kv.split("=") for kv in d.split())) for pid, d in _kinds(run, "training_worker")
             if d.startswith("frozen=")]
    trained = [(pid, d) for pid, d in _kinds(run, "training_worker") if d.startswith("embeddings_unchanged=")]
    assert built and all(pid != run["driver"] for pid, _ in built + trained)  # in the policy's worker
    # The optimizer holds every weight but the (tied) embeddings, and they did not move in either step.
    assert all(int(d["optimized"]) == int(d["total"]) - int(d["frozen"]) > 0 for _, d in built)
    assert len(trained) >= 2 and {d for _, d in trained} == {"embeddings_unchanged=True"}
    assert run["config"]["policy"]["backend"] == "frozen_embeddings"
    with pytest.raises(ConfigError, match=r"policy\.backend=frozen_embeddings .* use policy\.backend=hf"):
        _load("policy.backend=frozen_embeddings", "policy.lora.enabled=true")
    with pytest.raises(ConfigError, match=r"unknown policy backend 'frozen_embedding' \(did you mean 'frozen_embeddings'"):
        _load("policy.backend=frozen_embedding")


def _documented_metrics() -> list[re.Pattern]:
    """The names docs/reference/metrics.md lists, as patterns: ``<task>`` is any one path part, a
    trailing ``...`` anything, and a bare ``accuracy`` after ``train/<task>/reward_mean`` shares its prefix."""
    patterns = []
    for line in (ROOT / "docs" / "reference" / "metrics.md").read_text().splitlines():
        if not line.startswith("| `"):
            continue
        prefix = ""
        for token in re.findall(r"`([^`]+)`", line.split(" | ")[0]):
            if "/" in token:
                prefix = token.rsplit("/", 1)[0]
            else:
                token = f"{prefix}/{token}"
            body = re.escape(token).replace(re.escape("..."), ".+")
            patterns.append(re.compile(re.sub(r"<[a-z]+>", "[^/]+", body.replace(r"\<", "<").replace(r"\>", ">")) + "$"))
    return patterns


def test_every_metric_the_run_wrote_is_documented(run):
    patterns = _documented_metrics()
    names = {k for row in run["rows"] for k, v in row.items() if not isinstance(v, list)} - {"step"}
    assert all(isinstance(r["prompt_ids"], list) for r in run["rows"] if "timing/total" in r)  # the record field
    assert len(names) > 30
    undocumented = sorted(n for n in names if not any(p.match(n) for p in patterns))
    assert not undocumented, f"add these to docs/reference/metrics.md: {undocumented}"
