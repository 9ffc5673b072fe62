"""``python -m nemo_like.environments``: every environment a config can name, where it comes from, and
its ``env.<name>`` keys with types, defaults and help text; one that cannot be loaded is listed with
the reason instead of ending the listing."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from nemo_like.environments.catalog import describe_env, main
from nemo_like.environments.math_environment import MathEnvConfig
from nemo_like.environments.registry import ENV_REGISTRY, builtin_envs

USER_MODULE = '''
from typing import Literal

from pydantic import Field

from nemo_like.environments import EnvConfig, register_env


class ShoutConfig(EnvConfig):
    # How the answer is compared: "exact" or "upper" (upper-cased first).
    mode: Literal["exact", "upper"] = "upper"
    # Words that earn nothing.
    banned: list[str] = Field(default_factory=lambda: ["quiet"])
    # The reward of a right answer; no default: every config must say.
    reward: float


@register_env("nl_cat_shout")
class ShoutEnvironment:
    """Rewards an upper-case answer.

    More text that the listing leaves out."""

    config_model = ShoutConfig

    def step(self, message_log_batch, metadata):
        raise NotImplementedError


@register_env("nl_cat_loose")
class LooseEnvironment:
    def step(self, message_log_batch, metadata):
        raise NotImplementedError


register_env("nl_cat_missing", "nl_cat_not_a_module.Environment")
'''


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "nl_cat_user_envs.py").write_text(USER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    with ENV_REGISTRY.isolated():
        yield "nl_cat_user_envs"
    sys.modules.pop("nl_cat_user_envs", None)


def test_builtin_keys_defaults_and_help_come_from_the_config_model():
    info = describe_env("math")
    assert (info.source, info.target, info.error, info.checked) == (
        "built-in", "nemo_like.environments.math_environment.MathEnvironment", None, True)
    keys = {k.name: k for k in info.keys}
    # Every field of the model but the one all environments share (listed once, under the table).
    assert list(keys) == [n for n in MathEnvConfig.model_fields if n != "step_timeout_s"]
    assert all(k.default == MathEnvConfig.model_fields[k.name].default and not k.required for k in keys.values())
    assert (keys["timeout_s"].type, keys["timeout_s"].help) == ("float", "Wall-clock limit of one symbolic (or custom) check.")
    assert keys["verifier"].type == "str | null"


def test_import_lists_a_users_environments_and_the_errors_of_those_that_fail(user_module, capsys):
    assert main(["--import", user_module, "nl_cat_shout", "nl_cat_loose", "nl_cat_missing"]) == 0
    out, err = capsys.readouterr()
    shout, loose, missing, common = out.split("\n\n")
    assert shout.splitlines() == [
        "nl_cat_shout  (registered in code; nl_cat_user_envs.ShoutEnvironment)",
        "    Rewards an upper-case answer.",
        '    env.nl_cat_shout.mode: "exact" | "upper", default "upper"',
        '        How the answer is compared: "exact" or "upper" (upper-cased first).',
        '    env.nl_cat_shout.banned: list[str], default ["quiet"]',
        "        Words that earn nothing.",
        "    env.nl_cat_shout.reward: float, required",
        "        The reward of a right answer; no default: every config must say.",
    ]
    assert loose.splitlines()[1] == ("    env.nl_cat_loose: not checked (the class declares no config_model; "
                                     "any mapping is passed on)")
    assert missing.splitlines()[0] == "nl_cat_missing  (registered in code; nl_cat_not_a_module.Environment)"
    assert "error: " in missing and "No module named 'nl_cat_not_a_module'" in missing
    assert err.count("warning: ") == 1 and "nl_cat_missing" in err
    assert common.startswith("Every env.<name> also takes: step_timeout_s (Wall-clock limit of one ``step`` call")

    assert main(["--json", "nl_cat_shout"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert row["keys"][1] == {"name": "banned", "type": "list[str]", "default": ["quiet"], "required": False,
                              "help": "Words that earn nothing."}


def test_the_full_listing_has_every_environment_even_one_that_fails(user_module, capsys):
    assert main(["--import", user_module]) == 0
    out = capsys.readouterr().out
    heads = [line.split("  (")[0] for line in out.splitlines() if line and not line.startswith((" ", "Every"))]
    assert heads == sorted(builtin_envs() + ["nl_cat_loose", "nl_cat_missing", "nl_cat_shout"])


def test_a_builtin_replaced_in_code_is_not_called_built_in(user_module):
    assert describe_env("math").source == "built-in"
    ENV_REGISTRY.register("math", "nl_cat_user_envs.LooseEnvironment", overwrite=True)
    info = describe_env("math")
    assert (info.source, info.target, info.checked) == ("registered in code", "nl_cat_user_envs.LooseEnvironment", False)


def test_unknown_names_and_modules_are_one_line_errors(capsys):
    assert main(["maht"]) == 2
    assert capsys.readouterr().err.startswith("error: unknown environment 'maht' (did you mean 'math'?)")
    assert main(["--import", "nl_cat_no_such_module"]) == 2
    assert capsys.readouterr().err.startswith("error: --import: cannot import 'nl_cat_no_such_module': ModuleNotFoundError")


def test_module_entry_point_runs_the_listing():
    proc = subprocess.run([sys.executable, "-m", "nemo_like.environments", "--help"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0 and proc.stdout.startswith("usage: python -m nemo_like.environments")
