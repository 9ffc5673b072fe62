"""Environments of installed packages (entry-point group ``nemo_like.environments``).

The first tests give a registry of their own group real distributions: a ``*.dist-info`` folder with
an ``entry_points.txt`` on ``sys.path`` is what ``pip``/``uv`` leave behind, and what
``importlib.metadata`` reads. The last ones install ``examples/environment_package`` and a broken
package with ``uv`` into a folder (never into the project's .venv) and run, as a user would, fresh
Pythons with that folder on their path: the listing command, a config that names the environment,
and its Ray actor grading a batch
in the test session's cluster."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import ray

from nemo_like.environments.registry import EnvironmentLoadError, EnvRegistry

ROOT = Path(__file__).resolve().parents[3]
GROUP = "nemo_like_test.environments"
BUILTINS = {"math": "nemo_like.environments.math_environment.MathEnvironment"}

GOOD_MODULE = '''
IMPORTS = globals().get("IMPORTS", 0) + 1


class EchoEnv:
    def step(self, message_log_batch, metadata):
        return "echo"


class OtherEnv:
    def step(self, message_log_batch, metadata):
        return "other"


class NoStep:
    pass


def helper():
    return None
'''


def _distribution(root: Path, name: str, version: str, entry_points: dict[str, str],
                  modules: dict[str, str]) -> None:
    """``name`` installed into ``root``, as a wheel install lays it out."""
    dist = root / f"{name.replace('-', '_')}-{version}.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    lines = [f"[{GROUP}]"] + [f"{k} = {v}" for k, v in entry_points.items()]
    (dist / "entry_points.txt").write_text("\n".join(lines) + "\n")
    for module, source in modules.items():
        (root / f"{module}.py").write_text(source)


@pytest.fixture
def site(tmp_path, monkeypatch):
    """A folder on sys.path to install distributions into; their modules are forgotten afterwards."""
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    for module in [m for m in sys.modules if m.startswith("nl_ep_")]:
        del sys.modules[module]


def test_entry_points_are_read_on_first_lookup_and_imported_on_use(site):
    reg = EnvRegistry(group=GROUP, builtins=BUILTINS)
    # Installed after the registry exists (as after `import nemo_like`): it is found all the same.
    _distribution(site, "good-envs", "1.2", {"echo": "nl_ep_good:EchoEnv", "other": "nl_ep_good.OtherEnv"},
                  {"nl_ep_good": GOOD_MODULE})
    assert reg.names() == ["echo", "math", "other"]
    assert "nl_ep_good" not in sys.modules  # listed, not imported
    assert reg.package("echo") == "good-envs 1.2" and reg.package("math") is None
    echo = reg.get("echo")
    assert echo().step([], []) == "echo" and reg.get("other")().step([], []) == "other"
    assert sys.modules["nl_ep_good"].IMPORTS == 1
    # Registering the same class again in code (the package's module may do it too) is a no-op.
    reg.register("echo", "nl_ep_good.EchoEnv")
    assert reg.get("echo") is echo and reg.package("echo") == "good-envs 1.2"


def test_broken_entry_points_name_their_package_and_spare_the_rest(site):
    _distribution(site, "good-envs", "1.2", {"echo": "nl_ep_good:EchoEnv"}, {"nl_ep_good": GOOD_MODULE})
    _distribution(site, "broken-envs", "0.3", {
        "boom": "nl_ep_boom:Env",  # its module raises on import
        "nofn": "nl_ep_good:helper",  # not a class
        "nostep": "nl_ep_good:NoStep",
        "gone": "nl_ep_good:Missing",
        "math": "nl_ep_good:EchoEnv",  # a built-in's name
        "echo": "nl_ep_good:OtherEnv",  # a name another package declares too
        "bad": "not a path!",
    }, {"nl_ep_boom": "open(__file__ + '.imports', 'a').write('x')\nimport nl_ep_not_installed_dependency\n"})
    reg = EnvRegistry(group=GROUP, builtins=BUILTINS)
    with pytest.warns(RuntimeWarning) as caught:
        names = reg.names()
    messages = sorted(str(w.message) for w in caught)
    assert len(messages) == 3 and all("package broken-envs 0.3" in m for m in messages), messages
    assert "'bad'" in messages[0] and "'not a path!' is not an import path" in messages[0]
    # Two packages, one name: the first by package name keeps it, whatever the order of sys.path.
    assert "'echo' of package good-envs 1.2" in messages[1] and "taken by package broken-envs 0.3, which is kept" in messages[1]
    assert "'math'" in messages[2] and "'math' is a built-in environment, which is kept" in messages[2]
    assert names == ["boom", "echo", "gone", "math", "nofn", "nostep"]
    assert reg.get("math").__name__ == "MathEnvironment" and reg.get("echo")().step([], []) == "other"

    causes = {"boom": "importing nl_ep_boom raised ModuleNotFoundError: No module named 'nl_ep_not_installed_dependency'",
              "nofn": "helper is a function, not an environment class",
              "nostep": "class NoStep has no step() method",
              "gone": "module nl_ep_good has no attribute 'Missing'"}
    for name, cause in causes.items():
        with pytest.raises(EnvironmentLoadError) as e:
            reg.get(name)
        assert isinstance(e.value, ImportError) and isinstance(e.value, ValueError)
        message = str(e.value)
        assert message.startswith(f"environment {name!r} of the installed package broken-envs 0.3 (")
        assert cause in message and "\n" not in message
    with pytest.raises(EnvironmentLoadError, match="broken-envs 0.3"):
        reg.get("boom")  # the same answer again, without importing the module a second time
    assert (site / "nl_ep_boom.py.imports").read_text() == "x"
    assert reg.names() == names


def test_code_and_entry_points_share_names_explicitly(site):
    _distribution(site, "good-envs", "1.2", {"echo": "nl_ep_good:EchoEnv"}, {"nl_ep_good": GOOD_MODULE})
    reg = EnvRegistry(group=GROUP, builtins=BUILTINS)
    reg.register("mine", "nl_ep_good:OtherEnv")  # reads the group first: no silent double
    with pytest.raises(ValueError, match=r"'echo' is already registered by the installed package good-envs 1\.2 "
                                         r"\(nl_ep_good:EchoEnv\); pass overwrite=True"):
        reg.register("echo", "nl_ep_good:OtherEnv")
    with reg.isolated():
        reg.register("echo", "nl_ep_good:OtherEnv", overwrite=True)
        assert reg.get("echo")().step([], []) == "other" and reg.package("echo") is None
    # The block undid the code's registration, not the package's.
    assert reg.get("echo")().step([], []) == "echo" and reg.package("echo") == "good-envs 1.2"


# ---------------------------------------------------------------------------------------------
# The example package, installed
# ---------------------------------------------------------------------------------------------
BROKEN_PYPROJECT = '''
[project]
name = "nemo-like-broken-env"
version = "0.0.1"

[project.entry-points."nemo_like.environments"]
broken_env = "nemo_like_broken_env.env:BrokenEnvironment"
math = "nemo_like_broken_env.env:BrokenEnvironment"

[build-system]
requires = ["setuptools>=61"]
build-backend = "setuptools.build_meta"
'''

RUN = '''
import contextlib, io, json, warnings

out = {}
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    from nemo_like.environments.catalog import main

    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        out["list_rc"] = main(["--json", "reverse_text", "broken_env", "math"])
    out["listing"], out["list_stderr"] = json.loads(stdout.getvalue()), stderr.getvalue()
out["warnings"] = [str(w.message) for w in caught]

import ray

from nemo_like.algorithms.grpo_setup import env_config
from nemo_like.config import ConfigError, load_config
from nemo_like.distributed.ray_cluster import init_ray
from nemo_like.environments.registry import create_env_actor

cfg = load_config("my_run.yaml")
for key, overrides in {"bad_option": ["env.reverse_text.partial_reward=2"],
                       "broken_env": ["data.train.env_name=broken_env"]}.items():
    try:
        load_config("my_run.yaml", overrides)
        out[key] = "loaded"
    except ConfigError as e:
        out[key] = str(e)
out["config"] = env_config(cfg, cfg.data.train)
init_ray()  # RAY_ADDRESS: the test session's cluster, joined as a job of its own
actor = create_env_actor(cfg.data.train.env_name, out["config"])
logs = [[{"role": "user", "content": "Spell 'hello' backwards."}, {"role": "assistant", "content": c}]
        for c in ("olleh", "OLLEH", "hello", "world")]
ret = ray.get(actor.step.remote(logs, [{"ground_truth": "olleh"}] * 4))
out["rewards"] = ret.rewards.tolist()
print("RESULT " + json.dumps(out))
'''


def test_an_installed_package_is_listed_configured_and_graded_by_its_actor(tmp_path, ray_session):
    """As a user runs it: the packages installed with uv, then a fresh Python in the user's folder
    lists the environments, loads configs that name them and steps the environment's Ray actor."""
    uv = os.environ.get("UV") or shutil.which("uv")
    if uv is None:
        pytest.skip("uv is needed to install the example package (uv run pytest sets UV)")
    # A copy: building writes *.egg-info and build/ beside the sources, which must not land in the checkout.
    example = shutil.copytree(ROOT / "examples" / "environment_package", tmp_path / "example",
                              ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    broken = tmp_path / "broken"
    (broken / "nemo_like_broken_env").mkdir(parents=True)
    (broken / "pyproject.toml").write_text(BROKEN_PYPROJECT)
    (broken / "nemo_like_broken_env" / "__init__.py").write_text("")
    (broken / "nemo_like_broken_env" / "env.py").write_text("import nemo_like_missing_dependency  # noqa\n")
    site = tmp_path / "site"
    # Offline, built by the setuptools of our .venv, into a folder of its own: no network, and the
    # .venv stays as uv.lock says.
    subprocess.run([uv, "pip", "install", "--offline", "--no-deps", "--no-build-isolation", "--python", sys.executable,
                    "--target", str(site), str(example), str(broken)], check=True, capture_output=True, timeout=120)
    user = tmp_path / "user"
    user.mkdir()
    (user / "my_run.yaml").write_text(textwrap.dedent(f'''
        defaults: {ROOT / "examples" / "configs" / "grpo_math_tiny.yaml"}
        data:
          train: {{task_name: reverse, env_name: reverse_text, processor: math}}
        env:
          reverse_text: {{ignore_case: true, partial_reward: 0.5}}
        '''))
    (user / "run.py").write_text(RUN)
    # Its actors start in workers of its own job, which see the user's sys.path (the packages), and
    # end with it.
    env = dict(os.environ, PYTHONPATH=str(site), RAY_ADDRESS=ray.get_runtime_context().gcs_address)
    proc = subprocess.run([sys.executable, "run.py"], cwd=user, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))[7:])

    # The listing: the package's environment with its keys, their defaults and help text.
    assert out["list_rc"] == 0, out["list_stderr"]
    rows = {r["name"]: r for r in out["listing"]}
    reverse = rows["reverse_text"]
    assert reverse["source"] == "package nemo-like-reverse 0.1.0" and reverse["error"] is None
    assert reverse["target"] == "nemo_like_reverse.environment.ReverseTextEnvironment" and reverse["checked"]
    keys = {k["name"]: k for k in reverse["keys"]}
    assert list(keys) == ["ignore_case", "partial_reward"]
    assert (keys["ignore_case"]["type"], keys["ignore_case"]["default"]) == ("bool", False)
    assert (keys["partial_reward"]["type"], keys["partial_reward"]["default"]) == ("float", 0.0)
    assert keys["partial_reward"]["help"].startswith("Reward of an answer with the right letters in another order")
    # The broken package: its environment listed with the cause, the built-in name it claimed left alone.
    assert rows["broken_env"]["source"] == "package nemo-like-broken-env 0.0.1"
    assert "No module named 'nemo_like_missing_dependency'" in rows["broken_env"]["error"]
    assert rows["math"]["source"] == "built-in" and rows["math"]["error"] is None
    assert "warning: environment 'broken_env' of the installed package nemo-like-broken-env 0.0.1" in out["list_stderr"]
    assert len(out["warnings"]) == 1, out["warnings"]
    assert "'math' of package nemo-like-broken-env 0.0.1" in out["warnings"][0]
    assert "'math' is a built-in environment, which is kept" in out["warnings"][0]

    # A config that names it: its options checked against the package's config model, before Ray.
    assert out["config"] == {"ignore_case": True, "partial_reward": 0.5}
    assert "env.reverse_text.partial_reward" in out["bad_option"]
    # One that names the broken package's environment: a one-line error naming the package and why.
    assert out["broken_env"].startswith("invalid config: ") and "\n" not in out["broken_env"]
    assert "environment 'broken_env' of the installed package nemo-like-broken-env 0.0.1" in out["broken_env"]
    assert "No module named 'nemo_like_missing_dependency'" in out["broken_env"]
    # The environment actor (a fresh process) grades with the package's class and the config's options.
    assert out["rewards"] == [1.0, 1.0, 0.5, 0.0]


def test_any_environment_that_cannot_be_imported_is_a_load_error():
    # A built-in whose library is missing fails config validation in one line too, not with a traceback.
    reg = EnvRegistry(group=None, builtins={"needs_lib": "nl_ep_missing_library.env.Environment"})
    with pytest.raises(EnvironmentLoadError, match=r"environment 'needs_lib' .*No module named 'nl_ep_missing_library'"):
        reg.get("needs_lib")
