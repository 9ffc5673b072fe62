"""Code grading: the reward rule ``run_tests_sandboxed`` and the ``CodeEnvironment`` actor class.

The reward of a response is the fraction of its task's test snippets that pass when run after the
program extracted from the response, in the sandbox of :mod:`nemo_like.environments.sandbox`
(bubblewrap: no network, read-only root, private tmp, rlimits, wall-clock limit).

Extraction rule (part of the reward spec, see :func:`extract_code`): the content of the LAST closed
fenced block tagged ``python`` (or ``py``/``python3``); else the content of the last closed fenced
block of any kind; else the whole response. Only the last block counts, so a policy gains nothing
from writing several candidate programs.

Scoring: each test (e.g. ``"assert add(1, 2) == 3"``) runs independently in the program's namespace;
a failing test does not stop the others. A program that fails to run (SyntaxError, an exception at
top level, ``sys.exit``), hangs, exits before the tests finish, prints more than the output cap or
breaks a limit scores 0.0 as a whole.

HumanEval items (``prompt``, ``test`` defining ``check(candidate)``, ``entry_point``) become one
program (prompt + completion) and one test (``test`` + ``check(entry_point)``), see
:func:`humaneval_program_and_tests`.

This module imports neither torch nor ray at import time (torch only inside ``step``).
"""

from __future__ import annotations

import math
import re
import threading
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from nemo_like.environments.env_config import TRAINER_SIDE_KEYS, EnvConfig, validate_env_config
from nemo_like.environments.interfaces import (
    EnvironmentInterface,
    EnvironmentReturn,
    normalize_step_inputs,
    required_assistant_text,
)
from nemo_like.environments.sandbox import Sandbox, SandboxConfig, SandboxResult
from nemo_like.environments.sandbox.memory import check_memory_split
from nemo_like.environments.sandbox.mounts import check_extra_ro_binds

if TYPE_CHECKING:
    from nemo_like.data.interfaces import LLMMessageLogType

__all__ = [
    "CodeEnvConfig",
    "extract_code",
    "run_tests_sandboxed",
    "humaneval_program_and_tests",
    "CodeEnvironment",
]

_PYTHON_TAGS = frozenset({"python", "py", "python3"})
_IDENTIFIER_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


# --------------------------------------------------------------------------------- extraction
def extract_code(response: str) -> str:
    """The program in a model response.

    The content of the last closed fenced block whose info string starts with ``python``, ``py`` or
    ``python3`` (case-insensitive); else that of the last closed fenced block of any kind (e.g.
    untagged); else the whole response. A fence is ``` at any position followed by an info string up
    to the end of its line; the block ends at the next ```. An unclosed final fence is not a block
    (a truncated answer then usually fails to compile and scores 0). Linear time.
    """
    if not isinstance(response, str):
        raise TypeError(f"response must be a str, got {type(response).__name__}")
    last_any: str | None = None
    last_python: str | None = None
    pos = 0
    while True:
        start = response.find("```", pos)
        if start < 0:
            break
        eol = response.find("\n", start + 3)
        if eol < 0:
            break
        end = response.find("```", eol + 1)
        if end < 0:
            break
        info = response[start + 3 : eol].strip().split()
        body = response[eol + 1 : end]
        last_any = body
        if info and info[0].lower() in _PYTHON_TAGS:
            last_python = body
        pos = end + 3
    if last_python is not None:
        return last_python
    if last_any is not None:
        return last_any
    return response


# --------------------------------------------------------------------------------- HumanEval
def humaneval_program_and_tests(record: Mapping[str, Any], completion: str | None = None) -> tuple[str, list[str]]:
    """A HumanEval record (``prompt``, ``test``, ``entry_point``) plus a completion -> (program, tests).

    ``completion`` defaults to the record's ``canonical_solution``. If it defines ``entry_point`` at top
    level (``def name(`` at the start of a line: the model rewrote the whole function), the program is
    the prompt (for its imports and helpers) followed by the completion, whose definition wins;
    otherwise the completion continues the prompt (HumanEval's own convention: a function body).
    The single test is the record's ``test`` code followed by ``check(<entry_point>)``.
    """
    if not isinstance(record, Mapping):
        raise TypeError(f"a HumanEval record must be a mapping, got {type(record).__name__}")
    prompt, test, entry = record.get("prompt"), record.get("test"), record.get("entry_point")
    if not isinstance(prompt, str) or not isinstance(test, str) or not isinstance(entry, str):
        raise ValueError("a HumanEval record needs string fields 'prompt', 'test' and 'entry_point'")
    if not _IDENTIFIER_RE.match(entry):
        raise ValueError(f"entry_point must be a Python identifier, got {entry!r}")
    if completion is None:
        completion = record.get("canonical_solution")
    if not isinstance(completion, str):
        raise ValueError("no completion given and the record has no 'canonical_solution' string")
    if re.search(rf"^(?:async\s+)?def\s+{re.escape(entry)}\s*\(", completion, re.MULTILINE):
        program = prompt + "\n" + completion
    else:
        program = prompt + completion
    return program, [f"{test}\ncheck({entry})\n"]


# --------------------------------------------------------------------------------- grading rule
_default_sandboxes: dict[float, Sandbox] = {}
_default_lock = threading.Lock()


def _default_sandbox(timeout_s: float) -> Sandbox:
    with _default_lock:
        sandbox = _default_sandboxes.get(timeout_s)
        if sandbox is None:
            sandbox = _default_sandboxes[timeout_s] = Sandbox(SandboxConfig(timeout_s=timeout_s))
        return sandbox


def run_tests_sandboxed(
    program: str, tests: Sequence[str], *, timeout_s: float = 5.0, sandbox: Sandbox | None = None
) -> float:
    """Fraction of ``tests`` that pass after running ``program``, in the sandbox.

    Each test is a code snippet (``"assert add(1, 2) == 3"``) run in the program's namespace,
    independently of the others. 0.0 when the program fails, hangs past ``timeout_s``, breaks a
    limit, when there are no tests, or when the arguments are not strings. ``sandbox`` defaults to a
    shared default :class:`Sandbox` (raises SandboxUnavailableError if bubblewrap is unusable).
    """
    if not isinstance(program, str) or isinstance(tests, str):
        return 0.0
    try:
        tests = list(tests)
    except TypeError:
        return 0.0
    if not tests or not all(isinstance(t, str) for t in tests):
        return 0.0
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not 0 < timeout_s < math.inf:
        raise ValueError(f"timeout_s must be a positive number, got {timeout_s!r}")
    sandbox = sandbox if sandbox is not None else _default_sandbox(float(timeout_s))
    return sandbox.run(program, tests, timeout_s=timeout_s).pass_fraction


# -------------------------------------------------------------------------------- environment
class CodeEnvConfig(EnvConfig):
    """``env.code``: checked before Ray starts (see :mod:`nemo_like.environments.env_config`); each
    key maps onto the :class:`~nemo_like.environments.sandbox.SandboxConfig` field of that name."""

    timeout_s: float = Field(default=5.0, gt=0, strict=True, allow_inf_nan=False)  # wall clock of one run (all its tests)
    max_concurrency: int = Field(default=2, ge=1, strict=True)  # programs run at once
    # memory of one run, all its processes together (0: none); each of max_processes must get >= 24 MiB
    memory_limit_mb: int = Field(default=512, ge=0, strict=True)
    # processes + threads a run may have; 8 leaves each 64 MiB of the default 512 (16 left 32: a
    # thread stack or a list of a million ints away from a MemoryError in a correct program)
    max_processes: int = Field(default=8, ge=1, strict=True)
    max_output_bytes: int = Field(default=65536, ge=1, strict=True)  # a program printing more is killed, scores 0
    reward_mode: Literal["fraction", "all_or_nothing"] = "fraction"  # fraction of tests passed, or all or nothing
    # samples of one step that wrote the same program for the same tests share one run (a group's
    # samples often agree); false: every sample runs, e.g. to grade programs that may pass by chance
    share_identical_runs: bool = Field(default=True, strict=True)
    allow_unsandboxed: bool = Field(default=False, strict=True)  # without bubblewrap: rlimits only (warned), not an error
    bwrap_path: str | None = Field(default=None, min_length=1, strict=True)  # None: `bwrap` on PATH
    python_executable: str | None = Field(default=None, min_length=1, strict=True)  # None: the interpreter behind sys.executable
    # host paths programs may read (nothing outside the system dirs is visible otherwise; never Ray's temp dirs)
    extra_ro_binds: list[str] = Field(default_factory=list, strict=True)
    # a delegated cgroup v2 dir (memory controller on for its children) to cap runs in; None: automatic
    cgroup_parent: str | None = Field(default=None, min_length=1, strict=True)

    @field_validator("extra_ro_binds")
    @classmethod
    def _visible_paths(cls, v: list[str]) -> list[str]:
        check_extra_ro_binds(v, "extra_ro_binds")  # ValueError: relative, missing, or Ray's
        return v

    @model_validator(mode="after")
    def _memory_split(self) -> CodeEnvConfig:
        check_memory_split(self.memory_limit_mb, self.max_processes)  # names both keys
        return self


_MAX_TESTS = 1000  # per sample: more makes the sample malformed (bounds the result channel)


class _BadItem(Exception):
    pass


def _answer(message_log: Any) -> tuple[str, int]:
    try:
        return required_assistant_text(message_log)
    except (TypeError, ValueError) as e:
        raise _BadItem(str(e)) from None


def _job(message_log: Any, meta: Any) -> tuple[str, list[str]]:
    """(program, tests) of one sample, or _BadItem."""
    response = _answer(message_log)[0]
    if not isinstance(meta, Mapping):
        raise _BadItem("metadata is not a dict")
    code = extract_code(response)
    if "entry_point" in meta or "test" in meta:  # HumanEval format
        try:
            return humaneval_program_and_tests(meta, code)
        except (TypeError, ValueError) as e:
            raise _BadItem(str(e)) from None
    tests = meta.get("tests")
    if isinstance(tests, (str, bytes, Mapping)) or not hasattr(tests, "__iter__"):
        raise _BadItem("metadata has no 'tests' list (or HumanEval 'prompt'/'test'/'entry_point')")
    tests = list(tests)  # a list, a tuple, or e.g. a numpy array of strings from a dataset
    if not tests or len(tests) > _MAX_TESTS or not all(isinstance(t, str) for t in tests):
        raise _BadItem(f"'tests' must be 1..{_MAX_TESTS} strings")
    return code, tests


def _observation(result: SandboxResult | None) -> str:
    if result is None:
        return "Environment: malformed sample, not graded"
    n = len(result.tests_passed)
    if result.status == "ok":
        k = result.num_passed
        return f"Environment: all {n} tests passed" if k == n else f"Environment: {k}/{n} tests passed"
    if result.status == "timeout":
        return "Environment: the program timed out"
    if result.status == "output_limit":
        return "Environment: the program printed too much output"
    if result.status == "program_error":
        return f"Environment: the program failed: {result.error[:200]}"
    if result.status == "crashed":
        return f"Environment: the program {result.error[:200]}"
    return "Environment: the program could not be run"


class CodeEnvironment(EnvironmentInterface):
    """Grades the last assistant message of each sample by running its program against tests.

    ``metadata[i]`` holds either ``tests`` (a list of code snippets, e.g. ``"assert f(3) == 10"``) or a
    HumanEval record (``prompt``, ``test``, ``entry_point``). Config: :class:`CodeEnvConfig`.
    Construction raises if bubblewrap is missing (unless ``allow_unsandboxed``). Single turn: every
    sample terminates.

    Never raises from :meth:`step`: a malformed sample scores 0 and counts in ``num_failures`` (as
    does a run the sandbox itself could not start); a program over the time limit counts in
    ``num_timeouts``. Metrics: ``accuracy`` (share of samples passing all their tests),
    ``pass_fraction_mean``, ``num_failures``, ``num_timeouts``, ``num_runtime_errors`` (program
    raised, exited early or was killed by a limit), ``num_output_limits``, ``num_runs`` (sandbox
    runs: samples that wrote the same program for the same tests share one, ``share_identical_runs``).
    """

    config_model: ClassVar[type[EnvConfig]] = CodeEnvConfig

    def __init__(self, config: dict | None = None) -> None:
        parsed = validate_env_config("code", self.config_model, config)
        cfg = parsed.model_dump(exclude=set(TRAINER_SIDE_KEYS))
        self.config = cfg
        sandbox_keys = [k for k in cfg if k not in ("reward_mode", "share_identical_runs")]
        sandbox_config = SandboxConfig(**{k: tuple(cfg[k]) if k == "extra_ro_binds" else cfg[k] for k in sandbox_keys})
        self._sandbox = Sandbox(sandbox_config)  # raises SandboxUnavailableError without bubblewrap

    @property
    def sandbox_mode(self) -> str:
        """"bwrap" or "unsandboxed"."""
        return self._sandbox.mode

    @property
    def memory_mode(self) -> str:
        """How a run's memory is capped: "cgroup", "rlimit" or "none" (see ``sandbox.memory``)."""
        return self._sandbox.memory_mode

    def step(self, message_log_batch: list[LLMMessageLogType], metadata: list[dict]) -> EnvironmentReturn:
        batch, meta = normalize_step_inputs(message_log_batch, metadata)
        n = len(batch)
        rewards = [0.0] * n
        fractions = [0.0] * n
        results: list[SandboxResult | None] = [None] * n
        counts = {"failures": 0, "timeouts": 0, "runtime_errors": 0, "output_limits": 0}
        num_runs = 0
        try:
            jobs: list[tuple[str, list[str]]] = []
            rows: list[int] = []
            for i in range(n):
                try:
                    jobs.append(_job(batch[i], meta[i]))
                    rows.append(i)
                except Exception:  # _BadItem, or a message log that is not even iterable
                    counts["failures"] += 1
            # Each distinct (program, tests) runs once; its result goes to every sample that wrote it.
            distinct: dict[tuple[str, tuple[str, ...]], int] = {}
            share = self.config["share_identical_runs"]
            which = [distinct.setdefault((p, tuple(t)), len(distinct)) if share else k for k, (p, t) in enumerate(jobs)]
            runs = [(p, list(t)) for p, t in distinct] if share else jobs
            num_runs = len(runs)
            if jobs:
                try:
                    ran = self._sandbox.run_many(runs)
                except Exception as e:  # e.g. cannot start threads: score 0, keep training
                    ran = [SandboxResult("sandbox_error", [False] * len(t), error=repr(e)) for _, t in runs]
                outcomes = [ran[k] for k in which]
                all_or_nothing = self.config["reward_mode"] == "all_or_nothing"
                for i, result in zip(rows, outcomes):
                    results[i] = result
                    fractions[i] = result.pass_fraction
                    rewards[i] = float(result.all_passed) if all_or_nothing else result.pass_fraction
                    if result.status == "timeout":
                        counts["timeouts"] += 1
                    elif result.status == "output_limit":
                        counts["output_limits"] += 1
                    elif result.status in ("program_error", "crashed"):
                        counts["runtime_errors"] += 1
                    elif result.status == "sandbox_error":
                        counts["failures"] += 1
        except Exception:  # last line of defence: step must never raise into the trainer
            rewards = [0.0] * n
            fractions = [0.0] * n
            results = [None] * n
            counts = {"failures": n, "timeouts": 0, "runtime_errors": 0, "output_limits": 0}
            num_runs = 0

        import torch  # lazily: importing this module must stay cheap

        accuracy = sum(1 for r in results if r is not None and r.all_passed) / n if n else 0.0
        return EnvironmentReturn(
            observations=[{"role": "environment", "content": _observation(r)} for r in results],
            metadata=meta,
            next_stop_strings=[None] * n,
            rewards=torch.tensor(rewards, dtype=torch.float32),
            terminateds=torch.ones(n, dtype=torch.bool),
            metrics={
                "num_failures": float(counts["failures"]),
                "num_timeouts": float(counts["timeouts"]),
                "num_runtime_errors": float(counts["runtime_errors"]),
                "num_output_limits": float(counts["output_limits"]),
                "accuracy": float(accuracy),
                "pass_fraction_mean": float(sum(fractions) / n) if n else 0.0,
                "num_runs": float(num_runs),  # sandbox runs: fewer than samples when some wrote the same program
            },
        )

    def shutdown(self) -> None:
        """Nothing to release: every run's processes are gone when its ``run`` returns."""
