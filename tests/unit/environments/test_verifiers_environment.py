"""verifiers environments (built from verifiers' own classes) played by the verifiers environment against
a real server over a tiny model: a single-turn taskset scored by weighted reward functions, a multi-turn
tool taskset whose calculator runs as an MCP tool server, tasks that break their rewards, and the
one-line errors of an environment that cannot load.

Each episode runs verifiers' own harness program (its chat loop, in a subprocess), so the episodes here
take seconds each; the module shares one server and runs its episodes in few batches."""

from __future__ import annotations

import asyncio
import os
import sys
import time

import pytest
import torch

from nemo_like.data.errors import DataError
from nemo_like.data.verifiers_tasks import VerifiersConfig, generate_verifiers_dataset
from nemo_like.environments.verifiers_environment import VerifiersEnvConfig, VerifiersEnvironment
from nemo_like.models.generation.interfaces import GenerationConfig
from nemo_like.models.tiny import build_char_tokenizer, build_tiny_llama
from nemo_like.serve.engines import LocalEngine
from nemo_like.serve.server import start_server

pytest.importorskip("verifiers.v1")

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
FUNCTIONAL = os.path.join(ROOT, "tests", "functional")
if FUNCTIONAL not in sys.path:  # _nl_vf_helpers, the user's module of these environments
    sys.path.insert(0, FUNCTIONAL)
EXAMPLE = os.path.join(ROOT, "examples", "verifiers_env")

# ChatML listing the tools' names in a system line (a template with tool support, as Qwen's).
TEMPLATE = (
    "{%- if tools -%}{{- '<|im_start|>system\\nTools:' -}}{%- for t in tools -%}{{- ' ' + t['function']['name'] -}}"
    "{%- endfor -%}{{- '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- for m in messages -%}{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' -}}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)
CALC = {"environment": "nl-calculator", "paths": [EXAMPLE], "validation_percent": 0,
        "args": {"taskset": {"num_tasks": 1}, "agent": {"harness": {"id": "null"}}}}


@pytest.fixture(scope="module")
def calc_row():
    """The example calculator environment's one task (an installed-package id, found on ``paths``)."""
    [row] = _rows(**CALC)
    return row


@pytest.fixture(scope="module")
def server(tmp_path_factory, calc_row):
    """A tiny model taught the calculator task's tool conversation (call add, then answer from its
    result), served."""
    a, b = (int(x) for x in calc_row["problem"].rstrip("?").split("+"))
    call = f'<tool_call>{{"name": "add", "arguments": {{"a": {a}, "b": {b}}}}}</tool_call>'
    d = tmp_path_factory.mktemp("vf_tiny")
    tok = build_char_tokenizer(d, extra_tokens=["<tool_call>", "</tool_call>"])
    tok.chat_template = TEMPLATE
    model = build_tiny_llama(tok, hidden_size=32, num_layers=1, num_heads=4, max_position_embeddings=256, seed=0)
    tools = [{"type": "function", "function": {"name": "add"}}]
    user = [{"role": "user", "content": calc_row["problem"]}]
    rows = []
    for msgs, reply in [(user, call), (user + [{"role": "assistant", "content": call},
                                               {"role": "tool", "content": str(a + b)}], f"\\boxed{{{a + b}}}")]:
        p = tok(tok.apply_chat_template(msgs, tools=tools, tokenize=False, add_generation_prompt=True),
                add_special_tokens=False)["input_ids"]
        rows.append((p, tok(reply, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a 32-wide model: more threads only contend
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch.manual_seed(0)
    for _ in range(150):
        for p, r in rows:
            model(input_ids=torch.tensor([p + r]), labels=torch.tensor([[-100] * len(p) + r])).loss.backward()
            opt.step()
            opt.zero_grad()
    torch.set_num_threads(threads)
    model.eval().requires_grad_(False)
    # Sampled at the engine's temperature whatever the harness asks (as the trainer serves): at 1.0 the
    # taught reply came out misspelt on one CI run (boxedd{12}).
    engine = LocalEngine(model, tok, GenerationConfig(max_new_tokens=64, temperature=0.2), context_length=256,
                         slots=8)
    handle = start_server(engine, model_name="policy", fixed_sampling=True)
    yield handle
    handle.stop()
    engine.close()


def _rows(**kw):
    cfg = VerifiersConfig.model_validate({"kind": "verifiers", "split": "train", **kw})
    return [dict(r) for r in generate_verifiers_dataset(cfg)]


def _run(env, server, rows):
    sessions = [server.sessions.open(tag=i) for i in range(len(rows))]
    out = asyncio.run(env.run_episodes(rows, server.base_url, [s.key for s in sessions], "policy"))
    return out, sessions


def test_single_turn_episodes_are_scored_by_the_rubric_and_each_function_is_a_metric(server, capsys):
    rows = _rows(environment="_nl_vf_helpers:load_environment", args={"num_tasks": 12, "missing_every": 4,
                                                                       "raise_every": 5},
                 num_samples=8, seed=3)
    assert all(isinstance(r["problem"], str) and r["problem"].endswith("=") for r in rows)
    env = VerifiersEnvironment({"max_concurrency": 8, "episode_timeout_s": 120})
    out, sessions = _run(env, server, rows)
    lacking = [r["vf_index"] % 4 == 3 for r in rows]
    raising = [not m and r["vf_index"] % 5 == 4 for r, m in zip(rows, lacking)]
    assert any(lacking) and any(raising) and not all(a or b for a, b in zip(lacking, raising))
    for row, res, s, lacks, raises in zip(rows, out, sessions, lacking, raising):
        assert len(s.turns) == 1  # each episode's one request, in its own session
        if lacks or raises:  # the task's reward broke: this episode only is unscorable
            assert res["reward"] is None and res["metrics"] == {}
            assert ("KeyError" in res["error"]) if lacks else ("fails on purpose" in res["error"])
            continue
        reply = (s.turns[0].content or "").strip()  # the reply as the API returned it
        exact, short = float(reply == row["expected_answer"]), float(len(reply) <= 8)
        assert res["error"] is None and res["reward"] == pytest.approx(exact + 0.5 * short)
        assert res["metrics"] == {"exact": exact, "short": short, "reply_chars": float(len(reply))}
    printed = capsys.readouterr().out
    assert printed.count("verifiers environment '_nl_vf_helpers:load_environment'") == 1
    # A second batch with failures prints nothing more: they are counted by the trainer.
    _run(env, server, [r for r, m in zip(rows, lacking) if m])
    assert "verifiers environment" not in capsys.readouterr().out
    # A reward function that returns NaN: the episode is unscorable (verifiers passes NaN through).
    nan_rows = _rows(environment="_nl_vf_helpers:load_environment", args={"num_tasks": 2, "nan_rewards": True},
                     validation_percent=0)
    out, _ = _run(env, server, nan_rows)
    assert [r["reward"] for r in out] == [None, None]
    assert all("non-finite" in r["error"] and "exact" not in r["metrics"] for r in out)


def test_a_tool_call_runs_on_the_environments_mcp_server_and_the_turns_join(server, calc_row):
    env = VerifiersEnvironment({"episode_timeout_s": 120})
    [res], [s] = _run(env, server, [calc_row])
    assert res["error"] is None, res
    replies = [t.raw_text for t in s.turns]
    assert res["metrics"]["tool_calls"] == 1.0, replies  # add ran on the tool server; its result went back
    first, second = s.turns
    assert first.finish_reason == "tool_calls" and second.extends and s.prefix_breaks == 0
    assert second.raw_text.strip() == f"\\boxed{{{calc_row['expected_answer']}}}" and res["reward"] == 1.0


def test_rows_that_name_no_task_cost_only_themselves(server):
    rows = _rows(environment="_nl_vf_helpers:load_environment", args={"num_tasks": 6}, num_samples=2)
    bad = [dict(rows[0], vf_index=999), dict(rows[0], vf_key="another"), {"problem": "x"}]
    env = VerifiersEnvironment({})
    out, sessions = _run(env, server, bad + rows[1:])
    assert "no task 999" in out[0]["error"] and "not the one the dataset was made from" in out[1]["error"]
    assert "no vf_env column" in out[2]["error"]
    assert out[3]["error"] is None and len(sessions[3].turns) == 1


def test_an_episode_past_its_time_is_stopped_and_counted(server):
    rows = _rows(environment="_nl_vf_helpers:load_environment", args={"num_tasks": 6}, num_samples=2)
    env = VerifiersEnvironment({"episode_timeout_s": 0.2})  # less than the harness program takes to start
    t0 = time.monotonic()
    out, _ = _run(env, server, rows)
    assert time.monotonic() - t0 < 10
    assert all(r["timed_out"] and "episode_timeout_s=0.2" in r["error"] and r["reward"] is None for r in out)


def test_splits_are_disjoint_and_sized():
    args = {"environment": "_nl_vf_helpers:load_environment", "args": {"num_tasks": 60}}
    train = _rows(**args)
    val = [dict(r) for r in generate_verifiers_dataset(VerifiersConfig.model_validate(
        {"kind": "verifiers", "split": "validation", **args, "validation_percent": 25}))]
    train25 = _rows(**args, validation_percent=25)
    assert 45 <= len(train) < 60 and {r["vf_key"] for r in val}.isdisjoint(r["vf_key"] for r in train25)
    assert len(val) + len(train25) == 60 and sorted(r["vf_index"] for r in train25 + val) == list(range(60))
    assert len(_rows(**args, num_samples=5, seed=1)) == 5


def test_environments_that_cannot_load_fail_in_one_line_naming_them():
    with pytest.raises(ValueError, match="no verifiers environment package 'no-such-env'"):
        VerifiersConfig.model_validate({"kind": "verifiers", "environment": "no-such-env", "split": "train"})
    with pytest.raises(ValueError, match="cannot be imported: no module 'no_such_pkg'"):
        VerifiersConfig.model_validate({"kind": "verifiers", "environment": "no_such_pkg.env:load", "split": "train"})
    with pytest.raises(ValueError, match="factory form"):
        VerifiersConfig.model_validate({"kind": "verifiers", "environment": "a.b", "split": "train"})
    for spec, what in [("_nl_vf_helpers:broken_factory", "RuntimeError: this factory fails on purpose"),
                       ("_nl_vf_helpers:nothing_here", "has no attribute 'nothing_here'"),
                       ("_nl_vf_helpers:QuestionData", "returned a QuestionData, not a verifiers Env")]:
        with pytest.raises(DataError) as e:
            _rows(environment=spec)
        assert f"verifiers environment '{spec}'" in str(e.value) and what in str(e.value)
        assert "\n" not in str(e.value)


def test_config_and_dataset_pairing_are_checked():
    with pytest.raises(ValueError, match="max_concurrency"):
        VerifiersEnvironment({"max_concurrency": 0})
    assert VerifiersEnvConfig().port == 0

    class DS:
        generator = type("G", (), {"kind": "arithmetic"})()
        prompt = system_prompt = few_shot = None

    with pytest.raises(ValueError, match="kind: verifiers"):
        VerifiersEnvironment.check_dataset(DS(), None)
    DS.generator.kind, DS.prompt = "verifiers", "{} ="
    with pytest.raises(ValueError, match="prompt: a verifiers task is prompted by its environment"):
        VerifiersEnvironment.check_dataset(DS(), None)
