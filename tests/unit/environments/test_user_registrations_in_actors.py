"""A reward function or a tool registered by name in the user's own module (listed in ``imports:``)
or in the user's script reaches the environment actors that grade with it: an actor is a fresh
process that imported none of the driver's modules, so the names would be unknown there.

Run as a user runs it: a fresh Python in the user's folder (not ours), which reads a config with
``imports: [my_regs]``, starts a real local Ray and steps real environment actors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]

USER_MODULE = '''
from nemo_like.environments.reward_fn_environment import register_reward_fn
from nemo_like.environments.tools import register_tool


@register_reward_fn("shouting")
def shouting(completions, **_):
    return [1.0 if c.isupper() else 0.25 for c in completions]


def shout(text: str) -> str:
    """Upper-case a text.

    Args:
        text: what to shout
    """
    return text.upper()


register_tool(shout)
'''

USER_CONFIG = f'''
defaults: {ROOT / "examples" / "configs" / "grpo_math_tiny.yaml"}
imports: [my_regs]
data:
  train:
    env_name: reward_fn
    reward_fns: [{{fn: shouting, weight: 2.0}}, {{fn: from_script}}]
env:
  tool: {{tools: [shout]}}
'''

SCRIPT = '''
import json, sys

import ray

from nemo_like.algorithms.grpo_setup import env_config
from nemo_like.config import load_config
from nemo_like.distributed.ray_cluster import init_ray
from nemo_like.environments.registry import create_env_actor
from nemo_like.environments.reward_fn_environment import register_reward_fn
from nemo_like.environments.tool_calls import format_tool_call


@register_reward_fn("from_script")  # registered in __main__, as a notebook cell would
def from_script(completions, **_):
    return [0.5 for _ in completions]


cfg = load_config("my_run.yaml")  # imports my_regs, which registers "shouting" and the tool "shout"
init_ray(num_cpus=2)
graded = create_env_actor("reward_fn", env_config(cfg, cfg.data.train))
logs = [[{"role": "user", "content": "say it"}, {"role": "assistant", "content": c}] for c in ("LOUD", "quiet")]
ret = ray.get(graded.step.remote(logs, [{"ground_truth": "x"}, {"ground_truth": "x"}]))
tools = create_env_actor("tool", cfg.env["tool"])
call = [[{"role": "user", "content": "shout hi"},
         {"role": "assistant", "content": format_tool_call("shout", {"text": "hi"})}]]
obs = ray.get(tools.step.remote(call, [{"ground_truth": "HI"}]))
print("RESULT " + json.dumps({"rewards": ret.rewards.tolist(), "metrics": sorted(ret.metrics),
                              "observation": obs.observations[0]}))
ray.shutdown()
'''


def test_names_registered_in_user_modules_and_scripts_reach_the_environment_actors(tmp_path):
    (tmp_path / "my_regs.py").write_text(USER_MODULE)
    (tmp_path / "my_run.yaml").write_text(USER_CONFIG)
    (tmp_path / "run.py").write_text(textwrap.dedent(SCRIPT))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # found from the working directory
    proc = subprocess.run([sys.executable, "run.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    out = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and out, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out[0].removeprefix("RESULT "))
    # shouting (weight 2) gives 1 to "LOUD" and 0.25 to "quiet"; from_script 0.5 to both.
    assert result["rewards"] == [2.5, 1.0]
    assert {"shouting/mean", "from_script/mean"} <= set(result["metrics"])
    assert result["observation"]["role"] == "tool"
    assert result["observation"]["content"] == '<tool_response>"HI"</tool_response>'


def test_what_goes_along_is_the_users_registrations_that_pickle():
    import threading

    from nemo_like.environments.reward_fn_environment import REWARD_FN_REGISTRY, RewardFnEnvironment, register_reward_fn
    from nemo_like.environments.tools import TOOL_REGISTRY
    from nemo_like.environments.user_registrations import user_registrations, with_registrations

    lock = threading.Lock()

    def holds_a_lock(completions, **_):
        with lock:
            return [0.0] * len(completions)

    with REWARD_FN_REGISTRY.isolated(), TOOL_REGISTRY.isolated():
        # The built-ins register themselves in the actor: none goes along. (Other tests of this session
        # may have left registrations of their own: those are the driver's, and would go along.)
        earlier = {name for entries in user_registrations().values() for name, _ in entries}
        assert not earlier & {"math_accuracy", "boxed_format"}
        assert with_registrations(RewardFnEnvironment, {}) is RewardFnEnvironment
        register_reward_fn("by_path", "my_pkg.rewards:score")  # a path travels as it is, imported where used
        register_reward_fn("by_value", lambda completions, **_: [1.0] * len(completions))
        register_reward_fn("unpicklable", holds_a_lock)  # would fail every actor: stays behind
        carried = user_registrations()
        assert [name for name, _ in carried["reward_fn"] if name not in earlier] == ["by_path", "by_value"]
        assert "tool" not in carried or not {name for name, _ in carried["tool"]} - earlier
        wrapped = with_registrations(RewardFnEnvironment, carried)
        assert wrapped.__name__ == "RewardFnEnvironment" and issubclass(wrapped, RewardFnEnvironment)
    with REWARD_FN_REGISTRY.isolated():
        env = wrapped({"reward_fns": [{"fn": "by_value"}]})  # the constructor registers them first
        assert env.reward_fn_names() == ["<lambda>"] and "by_path" in REWARD_FN_REGISTRY
