"""reasoning-gym as a task source: any of its procedural datasets as rows, graded by its own scorer.

`reasoning-gym <https://github.com/open-thought/reasoning-gym>`_ (PyPI ``reasoning-gym``) has about a
hundred generators, each a dataclass config plus a dataset whose ``score_answer(answer, entry)`` gives
a float in [0, 1]. A dataset config names one and its own options::

    generator: {kind: reasoning_gym, dataset: basic_arithmetic, split: train, num_samples: 2000, seed: 1,
                options: {min_digits: 1, max_digits: 2, operators: ["+", "-"]}}

Rows carry ``problem`` (the question), ``expected_answer`` and what regenerates their entry exactly
(``rg_dataset``, ``rg_options`` as JSON, ``rg_index``), so the ``reasoning_gym`` environment scores with
the generator's own ``score_answer`` on the very entry (metadata included) the question came from.

Train and validation never overlap: a question's split is decided by a hash of its text (as for the
project's arithmetic generator), so two configs with any seeds agree on it.

reasoning-gym imports three packages published without wheels (``SOURCE_ONLY_DEPENDENCIES``) that four
of its generators use; the project installs it without them (``[[tool.uv.dependency-metadata]]`` in
pyproject.toml), and :func:`import_reasoning_gym` stands in modules that name the missing package
only if such a generator is used.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import importlib.machinery
import importlib.util
import json
import sys
import types
from functools import lru_cache
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from nemo_like.data.errors import DataError

__all__ = ["SOURCE_ONLY_DEPENDENCIES", "ReasoningGymConfig", "generate_reasoning_gym_dataset", "import_reasoning_gym", "reasoning_gym_entry",
           "reasoning_gym_dataset_names", "score_reasoning_gym_answer", "split_of_question"]

VALIDATION_PERCENT = 10  # share of each generator's questions held out for the validation split
# Keys of a generator's dataclass the row source owns: the split decides which questions are kept,
# num_samples how many, and the seed is the generator config's own.
_OWNED_OPTIONS = ("seed", "size")


# Requirements of reasoning-gym published as source archives only, left out of the install (see
# pyproject.toml), with the generators that use them.
SOURCE_ONLY_DEPENDENCIES = {"pycosat": ["zebra_puzzles"], "cellpylib": ["game_of_life", "game_of_life_halting"],
                            "zss": ["codeio"]}


class _Missing(types.ModuleType):
    """Stands in for a package reasoning-gym imports at import time but only a few generators use:
    importing works, using it raises an ImportError that names the package."""

    __nemo_like_stand_in__ = True

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        users = " and ".join(SOURCE_ONLY_DEPENDENCIES.get(self.__name__, []))
        raise ImportError(f"this generator needs the `{self.__name__}` package (used by reasoning-gym's {users}), "
                          f"which is published as source only and is not installed with nemo_like: "
                          f"`uv pip install {self.__name__}`, or pick another dataset")


def import_reasoning_gym() -> Any:
    """``import reasoning_gym``, with a clear error when it is not installed."""
    for name in SOURCE_ONLY_DEPENDENCIES:
        if name not in sys.modules and importlib.util.find_spec(name) is None:
            stand_in = _Missing(name)
            stand_in.__spec__ = importlib.machinery.ModuleSpec(name, None)  # find_spec() works on it
            sys.modules[name] = stand_in
    try:
        import reasoning_gym
    except ImportError as e:
        raise DataError(f"reasoning-gym is not installed ({e}); it is a dependency of nemo_like: run `uv sync`") from e
    return reasoning_gym


def reasoning_gym_dataset_names() -> list[str]:
    return sorted(import_reasoning_gym().factory.DATASETS)


def _config_class(name: str) -> type:
    rg = import_reasoning_gym()
    if name not in rg.factory.DATASETS:
        close = difflib.get_close_matches(name, reasoning_gym_dataset_names(), n=3)
        hint = f"did you mean {' or '.join(repr(c) for c in close)}?" if close else \
            "see reasoning_gym.factory.DATASETS for the names"
        raise ValueError(f"dataset: reasoning-gym has no dataset {name!r} ({hint})")
    return rg.factory.DATASETS[name][1]


class ReasoningGymConfig(BaseModel):
    """Rows from one reasoning-gym generator. ``options`` are the generator's own config keys
    (its dataclass fields, e.g. ``min_digits`` for ``basic_arithmetic``), checked before Ray starts."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["reasoning_gym"]  # which generator this is
    dataset: str  # a reasoning-gym generator's name (basic_arithmetic, chain_sum, ...)
    # Which side of the held-out rule: a question's split is a hash of its text (10% validation).
    split: Literal["train", "validation"]
    num_samples: int = Field(gt=0)  # distinct questions to keep from the split
    seed: int = 0  # the generator's seed
    # The generator's own config keys (its dataclass fields, e.g. min_digits), checked against it.
    options: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _check_dataset_and_options(self) -> ReasoningGymConfig:
        cls = _config_class(self.dataset)
        fields = [f.name for f in dataclasses.fields(cls) if f.name not in _OWNED_OPTIONS]
        for key in self.options:
            if key in _OWNED_OPTIONS:
                raise ValueError(f"options.{key}: set by the row source ({'num_samples' if key == 'size' else key} "
                                 "on the generator itself), not as a reasoning-gym option")
            if key not in fields:
                close = difflib.get_close_matches(key, fields, n=1)
                hint = f"did you mean options.{close[0]}?" if close else f"its options: {', '.join(fields)}"
                raise ValueError(f"options.{key}: not an option of reasoning-gym's {self.dataset!r} ({hint})")
        try:  # the generator's own checks (asserts on ranges), now rather than inside an actor
            cfg = cls(**self.options)
            if hasattr(cfg, "validate"):
                cfg.validate()
        except (AssertionError, TypeError, ValueError) as e:
            raise ValueError(f"options: reasoning-gym's {self.dataset!r} refuses {self.options}: "
                             f"{e or type(e).__name__}") from None
        return self


def split_of_question(question: str) -> Literal["train", "validation"]:
    """The split a question belongs to, stable across processes (hashlib, not the salted ``hash()``)."""
    digest = hashlib.sha256(question.encode("utf-8")).digest()
    return "validation" if int.from_bytes(digest[:8], "big") % 100 < VALIDATION_PERCENT else "train"


def _generator_options(cfg: ReasoningGymConfig, size: int) -> dict[str, Any]:
    # Tuples in a dataclass default (operators=("+", "-")) come back from JSON as lists: the same values.
    return {**cfg.options, "seed": cfg.seed, "size": size}


@lru_cache(maxsize=64)
def _dataset(name: str, options_json: str) -> Any:
    return import_reasoning_gym().create_dataset(name, **json.loads(options_json))


def reasoning_gym_entry(name: str, options_json: str, index: int) -> dict[str, Any]:
    """The generator's entry (question, answer, metadata) that a row was made from, regenerated."""
    return _dataset(name, options_json)[int(index)]


def score_reasoning_gym_answer(name: str, options_json: str, index: int, answer: str | None) -> float:
    """The generator's ``score_answer`` of ``answer`` on the entry a row was made from."""
    ds = _dataset(name, options_json)
    return ds.score_answer(answer, ds[int(index)])


def generate_reasoning_gym_dataset(cfg: ReasoningGymConfig) -> Any:
    """``num_samples`` distinct questions of ``cfg.split``, deterministic by ``cfg.seed``; a
    ``datasets.Dataset`` with ``problem``, ``expected_answer``, ``rg_dataset``, ``rg_options``,
    ``rg_index``. Raises DataError when the generator cannot make that many distinct questions."""
    import datasets

    share = VALIDATION_PERCENT if cfg.split == "validation" else 100 - VALIDATION_PERCENT
    # Indices to draw from: the split's share of them, less repeats (generators favour small cases),
    # must cover num_samples. Entries are made on access, so a generous bound costs nothing.
    size = int(cfg.num_samples * 100 / share * 8) + 1000
    options_json = json.dumps(_generator_options(cfg, size), sort_keys=True)
    try:
        ds = _dataset(cfg.dataset, options_json)
    except ImportError as e:
        raise DataError(f"reasoning_gym generator {cfg.dataset!r}: {e}") from e
    rows: dict[str, list] = {"problem": [], "expected_answer": [], "rg_dataset": [], "rg_options": [], "rg_index": []}
    seen: set[str] = set()
    for i in range(size):
        try:
            entry = ds[i]
        except ImportError as e:
            raise DataError(f"reasoning_gym generator {cfg.dataset!r}: {e}") from e
        except Exception as e:  # a generator bug on one seed: name it, not a traceback
            raise DataError(f"reasoning_gym generator {cfg.dataset!r} (options {cfg.options}) failed on entry {i}: "
                            f"{type(e).__name__}: {e}") from e
        q = entry["question"]
        if q in seen or split_of_question(q) != cfg.split:
            continue
        seen.add(q)
        rows["problem"].append(q)
        rows["expected_answer"].append(str(entry["answer"]))
        rows["rg_dataset"].append(cfg.dataset)
        rows["rg_options"].append(options_json)
        rows["rg_index"].append(i)
        if len(seen) == cfg.num_samples:
            return datasets.Dataset.from_dict(rows)
    raise DataError(f"reasoning_gym generator {cfg.dataset!r} (options {cfg.options}): only {len(seen)} distinct "
                    f"'{cfg.split}' questions in {size} draws, {cfg.num_samples} asked; lower num_samples or "
                    "widen the options")
