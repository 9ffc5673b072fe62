"""Math grading: the reward rule ``verify_math_answer`` and the ``MathEnvironment`` actor class.

The parser is part of the reward spec: the policy will exploit any slack, so the final answer is
only ever the content of the last ``\\boxed{...}`` or the rest of the line after the last ``####``
(no guessing from stray numbers), and everything that is not clearly equivalent scores 0.0.
Equivalence is decided by :mod:`nemo_like.environments.math_parser` (safe parsing, exact rational
arithmetic, size-guarded sympy).

This module imports neither torch nor sympy at import time: the grader subprocesses import it and
must start fast, and the purely numeric fast path never needs sympy.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any, ClassVar

from pydantic import Field, field_validator

from nemo_like.environments.env_config import TRAINER_SIDE_KEYS, EnvConfig, validate_env_config
from nemo_like.environments.grader_pool import GraderPool, resolve_callable
from nemo_like.environments.interfaces import (
    EnvironmentInterface,
    EnvironmentReturn,
    last_assistant_text,
    normalize_step_inputs,
)
from nemo_like.environments.math_parser import AnswerRejected, parse_answer, rational_value, symbolically_equal

if TYPE_CHECKING:
    from nemo_like.data.interfaces import LLMMessageLogType

__all__ = ["verify_math_answer", "extract_final_answer", "normalize_answer", "MathEnvironment", "MathEnvConfig"]

MAX_ANSWER_CHARS = 200  # longer final answers score 0 (this also bounds the parser's work)
DEFAULT_VERIFIER = f"{__name__}.verify_math_answer"


# --------------------------------------------------------------------------------- extraction
_BOXED_RE = re.compile(r"\\boxed\s*\{")


def _braced_content(text: str, start: int) -> str | None:
    """Content from ``start`` up to the brace closing an already-open ``{``.

    Scans at most MAX_ANSWER_CHARS + 1 characters: a longer answer scores 0 anyway, so there is no
    reason to walk a megabyte of hostile braces. ``\\{``/``\\}`` (set braces) do not nest.
    """
    depth, i, end = 1, start, min(len(text), start + MAX_ANSWER_CHARS + 1)
    while i < end:
        c = text[i]
        if c == "\\":
            i += 2
            continue
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return text[start:i]
        i += 1
    return None


def extract_final_answer(response: str) -> str | None:
    """The final answer: the last ``\\boxed{...}`` content, else the rest of the last ``####`` line.

    The last ``\\boxed{`` decides even when it is unclosed or too long (then None): falling back to
    an earlier box would reward a policy for boxing several candidates. Linear time in len(response).
    """
    pos = len(response)
    while (i := response.rfind("\\boxed", 0, pos)) >= 0:
        m = _BOXED_RE.match(response, i)
        if m:
            return _braced_content(response, m.end())
        pos = i
    i = response.rfind("####")
    if i < 0:
        return None
    j = response.find("\n", i)
    return response[i + 4 : j if j >= 0 else len(response)].strip()


# ------------------------------------------------------------------------------ normalisation
_DELETE_RE = re.compile(
    r"\$|\\[,:;! ]|\\(?:left|right|displaystyle|textstyle|quad|qquad)(?![a-zA-Z])"
    r"|\^\s*\{?\s*\\circ\s*\}?|°"  # degree marks: 30^\circ == 30
)
_WS_RE = re.compile(r"\s+")
# Drop a space unless it separates two alphanumerics ("\pi r", "2 3" keep theirs, "- 3" does not):
# gluing "2 3" into "23" would turn a malformed answer into a number.
_SPACE_RE = re.compile(r"(?<![A-Za-z0-9]) | (?![A-Za-z0-9])")
_TEXT_WHOLE_RE = re.compile(r"^\\(?:text|textbf|mathrm|mbox)\{([^{}]*)\}$")
_TRAILING_UNIT_RE = re.compile(r"(?<=.)\\(?:text|mbox|mathrm)\{[^{}]*\}$")
# 1,000 / 12,345,678.5 -> digits only; "1,2" or "1,0000" (a list, a typo) are left alone.
_THOUSANDS_RE = re.compile(r"(?<![\d.,])\d{1,3}(?:,\d{3})+(?![\d,])")
_VAR_EQ_RE = re.compile(r"^[a-zA-Z]=")


def normalize_answer(answer: str) -> str:
    """Canonical text of an answer for the exact comparison (and input to the parser)."""
    s = answer.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac").replace("{,}", ",")
    s = s.replace("\\%", "%").replace("\\$", "$")
    s = _DELETE_RE.sub("", s)
    s = _SPACE_RE.sub("", _WS_RE.sub(" ", s).strip())
    m = _TEXT_WHOLE_RE.match(s)
    if m:
        s = m.group(1).strip()
    s = s.rstrip(".").strip()
    return _THOUSANDS_RE.sub(lambda m: m.group(0).replace(",", ""), s)


def _grade_fast(response: Any, ground_truth: Any) -> float | tuple[tuple, tuple]:
    """Everything short of sympy. Returns the score, or the two ASTs when only sympy can decide.

    Runs in bounded time on any input (linear extraction, 200-char parser input, size-checked
    exact arithmetic), so it is safe to call in-process without a time limit.
    """
    if not isinstance(response, str) or not isinstance(ground_truth, str):
        return 0.0
    answer = extract_final_answer(response)
    truth = extract_final_answer(ground_truth) if ("\\boxed" in ground_truth or "####" in ground_truth) else ground_truth
    if answer is None or truth is None or len(answer) > MAX_ANSWER_CHARS:
        return 0.0
    if len(truth) > MAX_ANSWER_CHARS:  # a long reference answer: exact match only
        return float(answer.strip() == truth.strip() and bool(answer.strip()))
    na, nt = normalize_answer(answer), normalize_answer(truth)
    if not na or not nt:
        return 0.0
    if "=" not in nt:  # "x = 5" answers a question whose reference answer is "5"
        na = _VAR_EQ_RE.sub("", na)
    if na == nt:
        return 1.0
    try:
        ta = parse_answer(_TRAILING_UNIT_RE.sub("", na))
        tt = parse_answer(_TRAILING_UNIT_RE.sub("", nt))
        ra, rt = rational_value(ta), rational_value(tt)
    except (AnswerRejected, ValueError, ZeroDivisionError, OverflowError):
        return 0.0
    if ra is not None and rt is not None:
        return float(ra == rt)
    return ta, tt


def verify_math_answer(response: str, ground_truth: str) -> float:
    """1.0 if the final answer in ``response`` is mathematically equivalent to ``ground_truth``.

    Final answer: last ``\\boxed{...}`` (balanced braces) else the rest of the line after the
    last ``####``; neither -> 0.0. ``\\frac{1}{2}``, ``1/2`` and ``0.5`` are equal, ``1,000`` equals
    ``1000``, spaces and a trailing period do not matter. Never raises; bounded time and size.
    """
    try:
        result = _grade_fast(response, ground_truth)
        if isinstance(result, float):
            return result
        return 1.0 if symbolically_equal(*result) else 0.0
    except Exception:  # includes RecursionError and MemoryError: hostile input scores 0
        return 0.0


# -------------------------------------------------------------------------------- environment
class MathEnvConfig(EnvConfig):
    """``env.math``: checked before Ray starts (see :mod:`nemo_like.environments.env_config`)."""

    # Wall-clock limit of one symbolic (or custom) check.
    timeout_s: float = Field(default=2.0, gt=0, strict=True, allow_inf_nan=False)
    num_workers: int = Field(default=1, ge=1, strict=True)  # grader processes
    # Import path of a custom grading fn(response, ground_truth) -> float; None: verify_math_answer.
    verifier: str | None = Field(default=None, strict=True)
    memory_limit_mb: int = Field(default=2048, ge=0, strict=True)  # address space per grader (0: none)

    @field_validator("verifier")
    @classmethod
    def _importable(cls, v: str | None) -> str | None:
        if v is not None:
            try:  # fail when the config is read, naming the path, not at step 1 inside an actor
                resolve_callable(v)
            except (ImportError, TypeError) as e:
                raise ValueError(str(e)) from None
        return v


class _BadItem(Exception):
    pass


def _ground_truth(meta: Any) -> str:
    truth = meta.get("ground_truth") if isinstance(meta, dict) else None
    if isinstance(truth, (int, float)) and not isinstance(truth, bool):
        truth = str(truth)
    if not isinstance(truth, str):
        raise _BadItem("metadata has no ground_truth string")
    return truth


class MathEnvironment(EnvironmentInterface):
    """Grades the last assistant message of each sample against ``metadata[i]["ground_truth"]``.

    Config keys: ``timeout_s`` (2.0), ``num_workers`` (1), ``verifier`` (None: the built-in
    :func:`verify_math_answer`), ``memory_limit_mb`` (2048). Single turn: every sample terminates.
    Never raises from :meth:`step`: a malformed sample scores 0 and counts in ``num_failures``;
    a check over the time limit scores 0 and counts in ``num_timeouts``.
    """

    config_model: ClassVar[type[EnvConfig]] = MathEnvConfig

    def __init__(self, config: dict | None = None) -> None:
        parsed = validate_env_config("math", MathEnvConfig, config)
        cfg = parsed.model_dump(exclude=set(TRAINER_SIDE_KEYS))
        timeout, workers, memory, verifier = cfg["timeout_s"], cfg["num_workers"], cfg["memory_limit_mb"], cfg["verifier"]
        self.config = cfg
        # The built-in verifier's fast path (extraction, normalisation, exact rational arithmetic)
        # is bounded by construction, so it runs in-process: no IPC for the ~all-numeric answers the
        # trainer sends every step. Only sympy can take unbounded time, so only answers that need
        # it (roots, pi, variables) go to the time-limited processes. A custom verifier is unknown
        # code: every one of its checks goes to the processes.
        self._fast = verifier is None
        self._pool = GraderPool(
            verifier or DEFAULT_VERIFIER,
            workers,
            float(timeout),
            memory_limit_mb=memory,
            warm_imports=("sympy",) if verifier is None else (),
        )

    def step(self, message_log_batch: list[LLMMessageLogType], metadata: list[dict]) -> EnvironmentReturn:
        batch, meta = normalize_step_inputs(message_log_batch, metadata)
        n = len(batch)
        rewards = [0.0] * n
        failures = timeouts = 0
        try:
            jobs: list[tuple[str, str]] = []
            job_rows: list[int] = []
            for i in range(n):
                try:
                    response = last_assistant_text(batch[i])
                    truth = _ground_truth(meta[i])
                    if response is None:
                        raise _BadItem("no assistant message")
                except Exception:  # _BadItem, or a message log that is not even iterable
                    failures += 1
                    continue
                if self._fast:
                    try:
                        fast = _grade_fast(response, truth)
                    except Exception:
                        fast = 0.0
                    if isinstance(fast, float):
                        rewards[i] = fast
                        continue
                jobs.append((response, truth))
                job_rows.append(i)
            for i, (score, status) in zip(job_rows, self._pool.run_or_fail(jobs)):
                rewards[i] = score
                timeouts += status == "timeout"
                failures += status == "error"
        except Exception:  # last line of defence: step must never raise into the trainer
            rewards = [0.0] * n
            failures = n

        import torch  # lazily: grader processes import this module and must not load torch

        reward_t = torch.tensor(rewards, dtype=torch.float32)
        return EnvironmentReturn(
            observations=[
                {"role": "environment", "content": "Environment: correct" if r == 1.0 else "Environment: incorrect"}
                for r in rewards
            ],
            metadata=meta,
            next_stop_strings=[None] * n,
            rewards=reward_t,
            terminateds=torch.ones(n, dtype=torch.bool),
            metrics={
                "num_failures": float(failures),
                "num_timeouts": float(timeouts),
                "accuracy": float(reward_t.mean()) if n else 0.0,
            },
        )

    def shutdown(self) -> None:
        self._pool.shutdown()
