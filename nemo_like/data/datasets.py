"""Math datasets: a procedural arithmetic generator and loading of user files / hub datasets.

Every dataset comes out as a ``datasets.Dataset`` with at least the columns ``problem``,
``expected_answer`` (strings) and ``task_name``, whatever its source, so the rest of the pipeline never
cares where the data came from.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import random
import string
import warnings
from pathlib import Path
from typing import Annotated, Any, Literal

import datasets
from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, field_validator, model_validator

from nemo_like.data.errors import DataError  # re-exported: callers catch nemo_like.data.datasets.DataError
from nemo_like.data.loaders import check_prompt_column, load_hub, load_local
from nemo_like.data.processors import PROCESSOR_REGISTRY
from nemo_like.data.reasoning_gym_tasks import ReasoningGymConfig, generate_reasoning_gym_dataset
from nemo_like.data.textarena_tasks import TextArenaConfig
from nemo_like.data.verifiers_tasks import VerifiersConfig
from nemo_like.environments.reward_fn_environment import get_reward_fn

OPERATORS = ("+", "-", "*")
VALIDATION_PERCENT = 10  # share of the problem space held out for the validation split
# Enumerate the whole problem space when it is at most this big: exact feasibility checks and no
# rejection-sampling stalls when a request asks for nearly all problems of a small space.
_ENUMERATION_LIMIT = 200_000


class ArithmeticConfig(BaseModel):
    """Procedurally generated problems ``"<a><op><b>="`` with integer answers."""

    model_config = ConfigDict(extra="forbid")

    # Which generator this is (the default when left out).
    kind: Literal["arithmetic"] = "arithmetic"
    # Which side of the held-out rule: a problem's split is a hash of its text (10% validation), so
    # the splits never overlap whatever the seeds.
    split: Literal["train", "validation"]
    num_samples: int = Field(gt=0)  # distinct problems to draw from the split
    seed: int  # which problems are drawn, and in what order
    min_value: int = Field(default=0, ge=0)  # smallest operand
    max_value: int = Field(default=999, ge=0)  # largest operand
    # Operators drawn from: "+", "-" (answers may be negative), "*".
    ops: list[str] = Field(default_factory=lambda: ["+"])

    @field_validator("ops")
    @classmethod
    def _check_ops(cls, ops: list[str]) -> list[str]:
        if not ops:
            raise ValueError(f"ops must not be empty (choose from {list(OPERATORS)})")
        bad = [op for op in ops if op not in OPERATORS]
        if bad:
            raise ValueError(f"unsupported ops {bad} (choose from {list(OPERATORS)})")
        return list(dict.fromkeys(ops))

    @model_validator(mode="after")
    def _check_range(self) -> ArithmeticConfig:
        if self.min_value > self.max_value:
            raise ValueError(f"min_value ({self.min_value}) must be <= max_value ({self.max_value})")
        return self


def arithmetic_split_of(problem: str) -> Literal["train", "validation"]:
    """The split a problem text belongs to, stable across processes and Python versions.

    hashlib rather than ``hash()``: Python's string hash is salted per process, which would reshuffle the
    held-out set on every run and leak validation problems into training.
    """
    digest = hashlib.sha256(problem.encode("utf-8")).digest()
    bucket = int.from_bytes(digest[:8], "big") % 100
    return "validation" if bucket < VALIDATION_PERCENT else "train"


def _answer(a: int, op: str, b: int) -> int:
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    return a * b


def generate_arithmetic_dataset(cfg: ArithmeticConfig) -> datasets.Dataset:
    """``num_samples`` distinct problems of ``cfg.split``, deterministic by ``cfg.seed``.

    Columns: ``problem`` (e.g. ``"123+456="``) and ``expected_answer`` (e.g. ``"579"``).
    Raises DataError when the split has fewer distinct problems than requested.
    """
    rng = random.Random(f"nemo_like-arithmetic-{cfg.seed}")
    n_values = cfg.max_value - cfg.min_value + 1
    space = n_values * n_values * len(cfg.ops)
    chosen: list[tuple[int, str, int]]
    if space <= _ENUMERATION_LIMIT:
        pool = [
            (a, op, b)
            for op in cfg.ops
            for a in range(cfg.min_value, cfg.max_value + 1)
            for b in range(cfg.min_value, cfg.max_value + 1)
            if arithmetic_split_of(f"{a}{op}{b}=") == cfg.split
        ]
        if len(pool) < cfg.num_samples:
            raise DataError(_too_few_message(cfg, space, len(pool)))
        chosen = rng.sample(pool, cfg.num_samples)
    else:
        chosen = []
        seen: set[str] = set()
        # Generous budget: even at half the split's size, a draw is accepted about 40% of the time.
        max_draws = 50 * cfg.num_samples + 10_000
        for _ in range(max_draws):
            a = rng.randint(cfg.min_value, cfg.max_value)
            b = rng.randint(cfg.min_value, cfg.max_value)
            op = rng.choice(cfg.ops)
            text = f"{a}{op}{b}="
            if text in seen or arithmetic_split_of(text) != cfg.split:
                continue
            seen.add(text)
            chosen.append((a, op, b))
            if len(chosen) == cfg.num_samples:
                break
        else:
            raise DataError(_too_few_message(cfg, space, None))
    return datasets.Dataset.from_dict(
        {
            "problem": [f"{a}{op}{b}=" for a, op, b in chosen],
            "expected_answer": [str(_answer(a, op, b)) for a, op, b in chosen],
        }
    )


def _too_few_message(cfg: ArithmeticConfig, space: int, available: int | None) -> str:
    share = VALIDATION_PERCENT if cfg.split == "validation" else 100 - VALIDATION_PERCENT
    have = (
        f"only {available} distinct problems fall in that split"
        if available is not None
        else f"the split holds about {space * share // 100}"
    )
    return (
        f"arithmetic generator: cannot make {cfg.num_samples} distinct '{cfg.split}' problems from values "
        f"{cfg.min_value}..{cfg.max_value} and ops {cfg.ops} ({space} problems in all; {have}); "
        "lower num_samples or widen the value range"
    )


class ToolTasksGeneratorConfig(BaseModel):
    """Procedural tool-calling questions (:mod:`nemo_like.data.tool_tasks`)."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["tool"]  # which generator this is
    # Which side of the held-out rule (a stable hash of each question's text).
    split: Literal["train", "validation"]
    num_samples: int = Field(gt=0)  # distinct questions to draw from the split
    seed: int  # which questions are drawn, and in what order
    kinds: list[str] | None = None  # question kinds to draw (see nemo_like.data.tool_tasks); None: every kind
    weights: list[float] | None = None  # relative share of each of `kinds` (None: equal)
    max_value: int = Field(default=99, ge=1)  # largest operand of the arithmetic questions


class CodeTasksGeneratorConfig(BaseModel):
    """Procedural code-writing problems (:mod:`nemo_like.data.code_tasks`)."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["code"]  # which generator this is
    # Which side of the held-out rule (a sha256 bucket of each problem's text).
    split: Literal["train", "validation"]
    num_samples: int | None = Field(default=None, gt=0)  # problems to draw; None: every problem of the split
    seed: int = 0  # which problems are drawn, and in what order
    templates: list[str] | None = None  # problem templates to draw from (see nemo_like.data.code_tasks); None: all


def _generator_kind(value: Any) -> str | None:
    """Which generator a config is, by its ``kind`` (``arithmetic`` when left out): errors then name
    that generator's keys only, not every generator's."""
    return value.get("kind", "arithmetic") if isinstance(value, dict) else getattr(value, "kind", None)


GENERATOR_KINDS = ("arithmetic", "tool", "code", "reasoning_gym", "textarena", "verifiers")
GeneratorConfig = Annotated[
    Annotated[ArithmeticConfig, Tag("arithmetic")] | Annotated[ToolTasksGeneratorConfig, Tag("tool")]
    | Annotated[CodeTasksGeneratorConfig, Tag("code")] | Annotated[ReasoningGymConfig, Tag("reasoning_gym")]
    | Annotated[TextArenaConfig, Tag("textarena")] | Annotated[VerifiersConfig, Tag("verifiers")],
    Discriminator(_generator_kind, custom_error_type="generator_kind",
                  custom_error_message=f"generator.kind must be one of {', '.join(GENERATOR_KINDS)}")]


def _generate(gen: GeneratorConfig) -> datasets.Dataset:
    if isinstance(gen, ArithmeticConfig):
        return generate_arithmetic_dataset(gen)
    if isinstance(gen, ReasoningGymConfig):
        return generate_reasoning_gym_dataset(gen)
    if isinstance(gen, TextArenaConfig):  # imports textarena (an extra) only when it is used
        from nemo_like.data.textarena_tasks import generate_textarena_dataset

        return generate_textarena_dataset(gen)
    if isinstance(gen, VerifiersConfig):
        from nemo_like.data.verifiers_tasks import generate_verifiers_dataset

        return generate_verifiers_dataset(gen)
    if isinstance(gen, ToolTasksGeneratorConfig):
        from nemo_like.data.tool_tasks import generate_tool_dataset

        extra: dict = {"kinds": gen.kinds} if gen.kinds else {}
        if gen.weights is not None:
            extra["weights"] = gen.weights
        try:
            return generate_tool_dataset(gen.split, gen.num_samples, gen.seed, max_value=gen.max_value, **extra)
        except ValueError as e:
            raise DataError(f"tool task generator: {e}") from e
    from nemo_like.data.code_tasks import CodeTasksConfig, generate_code_tasks

    fields = gen.model_dump(exclude={"kind"}, exclude_none=True)
    ds = generate_code_tasks(CodeTasksConfig(**fields))
    # The reference program doubles as the "answer" column every dataset has (used for SFT).
    return ds.add_column("expected_answer", ds["reference_solution"])


class RewardFnConfig(BaseModel):
    """One weighted reward function: a registered name or an import path ``pkg.mod:fn``."""

    model_config = ConfigDict(extra="forbid")

    # A registered reward function (math_accuracy, boxed_format, or register_reward_fn's) or an import
    # path "pkg.mod:fn".
    fn: str
    # Multiplies the function's score; a sample's reward is the weighted sum of its functions' scores.
    weight: float = 1.0
    # Label of its metrics (<name>/mean, ...); None: the function's __name__.
    name: str | None = None


class FewShotExample(BaseModel):
    """A worked example shown before the question as an earlier user turn (``prompt`` applied to
    ``problem``) and the assistant's ``response``: how a small chat model learns the answer format."""

    model_config = ConfigDict(extra="forbid")

    # The example's question, formatted by the dataset's prompt like the real ones.
    problem: str
    # The assistant's answer to it, in the format the grader reads.
    response: str


class DatasetConfig(BaseModel):
    """Where a dataset comes from: a local file or hub dataset (``path``) or the arithmetic ``generator``."""

    model_config = ConfigDict(extra="forbid")

    # A local .jsonl/.json/.parquet/.csv file, or "hf:<name>": a hub dataset, or a local folder laid out
    # as one (its README.md's `configs:` listing each subset's data_files).
    path: str | None = None
    # hf: datasets: the split to read ("train", "test", or a slice such as "train[:500]"); ignored for
    # local files and the generator.
    split: str = "train"
    # hf: datasets: the subset (the hub's config name, e.g. gsm8k's "main"); None: the dataset's only one.
    subset: str | None = None
    # A procedural generator instead of a file (kind: arithmetic, the default, tool, code, reasoning_gym), or
    # another library's tasks (kind: textarena games, verifiers environments' datasets).
    generator: GeneratorConfig | None = None
    num_samples: int | None = Field(default=None, gt=0)  # keep at most this many rows (the first ones)
    # Column holding the question (renamed to "problem"): text, or a conversation (a list of
    # {"role": system|user|assistant, "content": ...} messages, TRL's conversational format) rendered
    # by the chat template as written, with prompt and few_shot unset.
    problem_key: str = "problem"
    # Column holding the reference answer the grader checks against (renamed to "expected_answer").
    answer_key: str = "expected_answer"
    # The task label: its samples go to one environment actor per task, and metrics and validation are
    # reported per task. Datasets with the same task_name share the first one's actor.
    task_name: str = "math"
    # The registered environment that grades this data (math, code, tool, reward_fn, reasoning_gym, or
    # yours), with the options under env.<env_name>.
    env_name: str = "math"
    # Data processor by name (see data.processors). None: the one registered under env_name, or "math"
    # (prompt-only rows, every column passed to the environment) for an environment without one.
    processor: str | None = None
    prompt: str | None = None  # format string with exactly one "{}"
    # Text of a system message before the prompt; None: none of ours (a chat template may add its own).
    # A conversational prompt with a system message of its own keeps it (a warning counts those rows).
    system_prompt: str | None = None
    few_shot: list[FewShotExample] | None = None  # worked examples, as chat turns before the question
    # Plain callables as the grader (TRL style): graded by the "reward_fn" environment.
    reward_fns: list[RewardFnConfig] | None = None
    # Share of GRPO prompts drawn from this dataset, relative to the other train datasets' (set it
    # on all of them or on none; none: in proportion to their sizes). SFT bootstrapping ignores it.
    sampling_weight: float | None = Field(default=None, gt=0)

    @field_validator("prompt")
    @classmethod
    def _check_prompt(cls, prompt: str | None) -> str | None:
        if prompt is None:
            return None
        try:
            fields = [f for _, f, _, _ in string.Formatter().parse(prompt) if f is not None]
        except ValueError as e:
            raise ValueError(f"prompt is not a valid format string ({e}): {prompt!r}") from e
        if fields != [""]:
            raise ValueError(
                f"prompt must contain exactly one '{{}}' placeholder for the problem (write '{{{{' / '}}}}' "
                f"for literal braces), got {prompt!r}"
            )
        return prompt

    def few_shot_turns(self) -> list[dict[str, str]] | None:
        return [e.model_dump() for e in self.few_shot] if self.few_shot else None

    @model_validator(mode="after")
    def _check_source(self) -> DatasetConfig:
        if (self.path is None) == (self.generator is None):
            raise ValueError("set exactly one of 'path' and 'generator'")
        if self.path is not None and not self.path.strip():
            raise ValueError("path must not be empty")
        if self.reward_fns is not None:
            if not self.reward_fns:
                raise ValueError("reward_fns must list at least one function (or be left out)")
            if "env_name" not in self.model_fields_set or self.env_name == "math":
                # The functions are the grader: in place of the built-in math one (often inherited from a
                # recipe, where env_name: math is written out); {fn: math_accuracy} keeps its check.
                self.env_name = "reward_fn"
            elif self.env_name != "reward_fn":
                raise ValueError(f"reward_fns are graded by env_name 'reward_fn' (the functions are the grader), but "
                                 f"env_name is {self.env_name!r}: set env_name: reward_fn, or leave reward_fns out")
            if self.processor is None:
                self.processor = "math"  # prompt-only rows; every column reaches the functions
        if self.processor is None and self.env_name not in PROCESSOR_REGISTRY:
            # An environment of the user's (register_env) grades prompt-only rows unless a processor of
            # its name is registered too; decided now, so the config on disk says which processor ran.
            self.processor = "math"
        if self.subset is not None and not (self.path or "").startswith("hf:"):
            raise ValueError(f"subset={self.subset!r} selects a subset of an hf: dataset, but path is "
                             f"{self.path!r}; remove subset (a local file is one subset)")
        return self


# The names under which a reward function is handed the reference answer column.
_ANSWER_KWARGS = {"ground_truth", "expected_answer"}


def _graded_without_answers(cfg: DatasetConfig) -> bool:
    """Only reward functions grade these rows, and none names the answer (``ground_truth``) as a
    parameter: a function that asks for it would get "" for every row and score 0 in silence."""
    if cfg.env_name != "reward_fn" or not cfg.reward_fns:
        return False
    for r in cfg.reward_fns:
        try:
            fn = get_reward_fn(r.fn)
        except (ImportError, KeyError, TypeError):
            return False  # named before Ray starts (env_config), with its own error
        params = inspect.signature(fn).parameters if callable(fn) else {}
        if _ANSWER_KWARGS & set(params):
            return False
    return True


def load_dataset_from_config(cfg: DatasetConfig) -> datasets.Dataset:
    """Load the dataset ``cfg`` describes, with columns ``problem``, ``expected_answer`` and ``task_name``.

    Columns named ``cfg.problem_key``/``cfg.answer_key`` are renamed to ``problem``/``expected_answer``
    (both cast to strings, except a problem column of conversations: lists of messages, kept as they are
    and checked); other columns are kept (e.g. ``response`` for SFT). ``task_name`` is set to
    ``cfg.task_name`` on every row. Raises DataError naming the file (and line) when the data is bad.

    Conversations are rendered as written, so ``cfg.prompt`` and ``cfg.few_shot`` must be unset.
    ``cfg.system_prompt`` is put first in the conversations without a system message; one that has its
    own keeps it (a UserWarning counts those rows).
    """
    if cfg.generator is not None:
        ds = _generate(cfg.generator)
        source = f"{cfg.generator.kind} generator (split={cfg.generator.split}, seed={cfg.generator.seed})"
    else:
        assert cfg.path is not None
        if cfg.path.startswith("hf:"):
            ds = load_hub(cfg.path[3:], cfg.subset, cfg.split)
            source = cfg.path + (f" (subset {cfg.subset}, split {cfg.split})" if cfg.subset else f" (split {cfg.split})")
        else:
            ds = load_local(cfg.path, cfg.problem_key)
            source = cfg.path
    conversational = check_prompt_column(ds, cfg.problem_key, source)
    if conversational:
        _check_conversation_options(ds[cfg.problem_key], cfg, source)
    ds = _normalise_columns(ds, cfg, source, conversational)
    if cfg.num_samples is not None and len(ds) > cfg.num_samples:
        ds = ds.select(range(cfg.num_samples))
    return ds


def _check_conversation_options(conversations: list[Any], cfg: DatasetConfig, source: str) -> None:
    for key, value in (("prompt", cfg.prompt), ("few_shot", cfg.few_shot)):
        if value:
            raise DataError(f"{source}: column '{cfg.problem_key}' holds conversations (lists of messages), "
                            f"rendered as written, so this dataset cannot also have a {key} "
                            f"({cfg.few_shot_turns() if key == 'few_shot' else value!r}); set its {key} to null "
                            "(a parent config may have set it)")
    if cfg.system_prompt:
        own = sum(1 for c in conversations if c and c[0].get("role") == "system")
        if own:
            warnings.warn(f"{source}: {own} of {len(conversations)} conversations have a system message of "
                          f"their own and keep it; system_prompt ({cfg.system_prompt!r}) is put first in the "
                          "others only", UserWarning, stacklevel=3)


def _normalise_columns(ds: datasets.Dataset, cfg: DatasetConfig, source: str, conversational: bool) -> datasets.Dataset:
    present = list(ds.column_names)
    if cfg.answer_key not in present and _graded_without_answers(cfg):
        # Reward functions that read other columns (or none) need no reference answer: the rows get an
        # empty one, as generated code tasks do, so every row has the same columns.
        ds = ds.add_column(cfg.answer_key, [""] * len(ds))
        present.append(cfg.answer_key)
    for key, role, target in (
        (cfg.problem_key, "problem_key", "problem"),
        (cfg.answer_key, "answer_key", "expected_answer"),
    ):
        if key not in present:
            needs = ("" if role == "problem_key" or cfg.env_name != "reward_fn" else
                     " (a reward function takes ground_truth, the answer column)")
            raise DataError(f"{source}: missing column '{key}' ({role}){needs}; columns present: {present}")
        if key != target and target in present:
            raise DataError(
                f"{source}: cannot rename column '{key}' ({role}) to '{target}': a '{target}' column "
                f"already exists; columns present: {present}"
            )
    renames = {k: t for k, t in ((cfg.problem_key, "problem"), (cfg.answer_key, "expected_answer")) if k != t}
    if renames:
        ds = ds.rename_columns(renames)
    for column in ("expected_answer",) if conversational else ("problem", "expected_answer"):
        if ds.features[column] != datasets.Value("string"):
            try:
                ds = ds.cast_column(column, datasets.Value("string"))
            except Exception as e:
                raise DataError(
                    f"{source}: column '{column}' cannot be read as text ({type(e).__name__}: {e})"
                ) from e
    nulls = [i for i, (p, a) in enumerate(zip(ds["problem"], ds["expected_answer"])) if p is None or a is None]
    if nulls:
        raise DataError(
            f"{source}: {len(nulls)} row(s) lack a problem or an answer (first at row {nulls[0]})"
        )
    if "task_name" in ds.column_names:
        ds = ds.remove_columns("task_name")
    return ds.add_column("task_name", [cfg.task_name] * len(ds))


def write_jsonl(dataset: datasets.Dataset | list[dict[str, Any]], path: str | os.PathLike) -> Path:
    """Write rows as JSON Lines (parent folders created); returns the path. Written atomically."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    with tmp.open("w", encoding="utf-8") as f:
        for row in dataset:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    os.replace(tmp, out)
    return out
